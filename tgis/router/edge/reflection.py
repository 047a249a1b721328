"""gRPC server reflection whose descriptors carry ``json_name``, as TGIS's do.

Python's generated descriptors leave ``json_name`` unset, so a client that renders JSON from
reflected descriptors (grpcurl) prints the proto field names, ``generated_token_count``,
where against TGIS, or with ``-proto``, it prints ``generatedTokenCount``: scripts written
against one break against the other. Reflection here serves copies of the served files
with every field's ``json_name`` filled in by protobuf's rule (underscores dropped, the
letter after each one upper-cased), from a descriptor pool of their own.
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc import aio
from grpc_reflection.v1alpha import reflection


def json_name(field_name: str) -> str:
    """protobuf's default JSON name of a field: ``generated_token_count`` ->
    ``generatedTokenCount``."""
    out: list[str] = []
    upper_next = False
    for ch in field_name:
        if ch == "_":
            upper_next = True
        elif upper_next:
            out.append(ch.upper())
            upper_next = False
        else:
            out.append(ch)
    return "".join(out)


def _name_fields(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    for message in messages:
        for field in message.field:
            if not field.HasField("json_name"):
                field.json_name = json_name(field.name)
        _name_fields(message.nested_type)


def with_json_names(file: FileDescriptor) -> descriptor_pb2.FileDescriptorProto:
    """``file`` as a FileDescriptorProto whose fields all carry ``json_name``."""
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    _name_fields(proto.message_type)
    return proto


def reflection_pool(files: Iterable[FileDescriptor]) -> descriptor_pool.DescriptorPool:
    """A pool holding ``files`` and their imports (dependencies first), with json names."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        pool.Add(with_json_names(file))
        added.add(file.name)

    for file in files:
        add(file)
    return pool


def enable_reflection(
    server: aio.Server, service_names: Iterable[str], files: Iterable[FileDescriptor]
) -> None:
    """Register the reflection service for ``service_names``, whose definitions are in
    ``files`` (the reflection service's own file is added here)."""
    from grpc_reflection.v1alpha import reflection_pb2

    pool = reflection_pool([*files, reflection_pb2.DESCRIPTOR])
    names = (*service_names, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server, pool=pool)
