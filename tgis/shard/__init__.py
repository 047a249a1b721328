"""The shard process: loads a model, owns its paged KV cache and runs one Step per RPC.

The router (``tgis.router``) decides what runs; the shard only executes the plan it is
sent (see ``protos/shard.proto``). Protobuf appears only in ``servicer.py`` and
``pb_convert.py``; everything else works on the plain dataclasses of ``messages.py``.
"""
