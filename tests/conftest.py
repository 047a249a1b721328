"""Settings every test process shares."""

from __future__ import annotations

import os

# The compiled step costs tens of seconds per model on a CPU; tests run the eager reference
# (the CPU default anyway) unless they ask for the compiled one (tests/shard/test_compiled.py),
# and so do the servers they launch (the variable is inherited).
os.environ.setdefault("TGIS_COMPILE", "0")
