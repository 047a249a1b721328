"""The shard process: loads a model, owns its paged KV cache and runs one Step per RPC.

The router (``tgis.router``) decides what runs; the shard only executes the plan it is
sent (see ``protos/shard.proto``). Protobuf appears only in ``serving/servicer.py``
(through ``tgis.shard_api.codec``) and ``serving/server.py`` (which registers the
servicer); everything else works on the plain types of ``tgis.shard_api.messages``, the
contract the router shares.
"""
