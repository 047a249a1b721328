"""``python -m tgis.benchmark``: the same as ``text-generation-benchmark``."""

from tgis.benchmark.cli import main

main()
