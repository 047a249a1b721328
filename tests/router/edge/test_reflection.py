"""The reflected descriptors carry json_name (tgis/router/edge/reflection.py)."""

from __future__ import annotations

from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2

from tgis.pb import generation_pb2
from tgis.router.edge.reflection import json_name, reflection_pool, with_json_names


def test_json_name_rule() -> None:
    assert json_name("generated_token_count") == "generatedTokenCount"
    assert json_name("text") == "text"
    assert json_name("top_n_tokens") == "topNTokens"
    assert json_name("x__y") == "xY"


def test_every_field_of_every_served_message_is_named() -> None:
    proto = with_json_names(generation_pb2.DESCRIPTOR)

    Field = descriptor_pb2.FieldDescriptorProto

    def fields(messages: list[descriptor_pb2.DescriptorProto]) -> list[Field]:
        found: list[Field] = []
        for m in messages:
            found += list(m.field) + fields(list(m.nested_type))
        return found

    named = fields(list(proto.message_type))
    assert len(named) > 40
    assert all(f.json_name == json_name(f.name) for f in named)
    pool = reflection_pool([generation_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR])
    served = descriptor_pb2.FileDescriptorProto()
    pool.FindFileContainingSymbol("fmaas.GenerationResponse").CopyToProto(served)
    response = next(m for m in served.message_type if m.name == "GenerationResponse")
    by_name = {f.name: f.json_name for f in response.field}
    assert by_name["generated_token_count"] == "generatedTokenCount"
    assert pool.FindServiceByName("grpc.health.v1.Health").name == "Health"
