"""Generated protobuf and gRPC stubs (built from protos/ at install time; never edited or committed)."""
