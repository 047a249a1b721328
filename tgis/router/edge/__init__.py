"""The public edge: the fmaas gRPC service (servicer, registration, protobuf conversion,
replies), reflection, TLS and the HTTP app. Protobuf is read and built only here."""
