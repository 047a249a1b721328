"""Tensor parallelism for every part of the shard: this rank's place in the group and its
collectives (``group``), and joining the group and the object collectives
(``distributed``). The sharded layers built on them are the native engine's
(``native/linear/sharded.py``)."""
