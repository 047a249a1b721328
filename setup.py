"""Build hook: generate the gRPC stubs from protos/ before packaging (see scripts/gen_protos.py)."""

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProtos(build_py):
    def run(self) -> None:
        gen = runpy.run_path(str(Path(__file__).parent / "scripts" / "gen_protos.py"))
        gen["generate"]()
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
