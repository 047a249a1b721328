"""The router↔shard contract shared by both sides: plain types, their protobuf codec, and the
step channel that carries Steps. Imports neither torch nor the router or shard packages."""
