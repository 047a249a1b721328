"""A small client of the TGIS API (fmaas.GenerationService) through generated stubs.

The stubs: the `tgis` package generates them at install (`tgis.pb`); a client of its own
compiles the same proto file with grpcio-tools::

    python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. \\
        protos/generation.proto      # then: import generation_pb2, generation_pb2_grpc

Examples (against `make run`, or any TGIS-compatible server)::

    python examples/python_client.py "Return the number of"
    python examples/python_client.py --stream --max-new-tokens 30 "Once upon a time"
    python examples/python_client.py --target host:8033 --ca ca.pem \\
        --cert client.pem --key client.key "Hello"          # TLS, mTLS with --cert/--key
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

try:
    from tgis.pb import generation_pb2 as pb
    from tgis.pb import generation_pb2_grpc as pb_grpc
except ImportError:  # stubs compiled next to this file, as the docstring shows
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import generation_pb2 as pb  # type: ignore[no-redef]
    import generation_pb2_grpc as pb_grpc  # type: ignore[no-redef]


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext, or TLS when --ca is given (with a client certificate for mTLS)."""
    if not args.ca:
        return grpc.insecure_channel(args.target)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(args.ca).read_bytes(),
        private_key=Path(args.key).read_bytes() if args.key else None,
        certificate_chain=Path(args.cert).read_bytes() if args.cert else None,
    )
    return grpc.secure_channel(args.target, credentials)


def parameters(args: argparse.Namespace) -> pb.Parameters:
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=args.max_new_tokens))
    if args.temperature > 0:
        params.method = pb.SAMPLE
        params.sampling.temperature = args.temperature
        if args.seed is not None:
            params.sampling.seed = args.seed
    return params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("texts", nargs="+", help="input texts (one request each)")
    parser.add_argument("--target", default="127.0.0.1:8033")
    parser.add_argument("--stream", action="store_true", help="GenerateStream (first text)")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--ca", help="CA certificate (PEM): use TLS")
    parser.add_argument("--cert", help="client certificate (PEM): mTLS")
    parser.add_argument("--key", help="client key (PEM): mTLS")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()

    with open_channel(args) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        info = stub.ModelInfo(pb.ModelInfoRequest(model_id="default"), timeout=args.timeout)
        print(
            f"model: {pb.ModelInfoResponse.ModelKind.Name(info.model_kind)}, "
            f"max sequence length {info.max_sequence_length}"
        )
        if args.stream:
            request = pb.SingleGenerationRequest(
                request=pb.GenerationRequest(text=args.texts[0]), params=parameters(args)
            )
            last = None
            for message in stub.GenerateStream(request, timeout=args.timeout):
                print(message.text, end="", flush=True)
                last = message
            print()
            if last is not None:
                print(
                    f"[{last.generated_token_count} tokens, {pb.StopReason.Name(last.stop_reason)}]"
                )
            return 0
        batch = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=t) for t in args.texts], params=parameters(args)
        )
        for response in stub.Generate(batch, timeout=args.timeout).responses:
            print(
                f"{response.text!r} [{response.generated_token_count} tokens, "
                f"{pb.StopReason.Name(response.stop_reason)}]"
            )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        sys.exit(1)
