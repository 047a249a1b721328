"""``python -m tgis.shard serve ...`` (same as ``text-generation-server``)."""

from tgis.shard.cli import main

main()
