"""Build hooks: generate the gRPC stubs from protos/ before packaging (see
scripts/gen_protos.py), and compile the optional CPU kernels, decode attention and quantized
weights (plain C, no torch headers; the shard falls back to torch when they could not be
built)."""

import runpy
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class BuildWithProtos(build_py):
    def run(self) -> None:
        gen = runpy.run_path(str(Path(__file__).parent / "scripts" / "gen_protos.py"))
        gen["generate"]()
        super().run()


CPU_ATTENTION = Extension(
    "tgis.shard.native.attention._cpu_attention",
    sources=["tgis/shard/native/attention/csrc/cpu_attention.c"],
    extra_compile_args=["-O3", "-fopenmp", "-std=c11", "-ffp-contract=fast", "-Wno-psabi"],
    # libgomp by soname: at run time it binds to the copy torch has already loaded.
    extra_link_args=["-fopenmp"],
    optional=True,
)

# Weight-only 4/8-bit products of quantized checkpoints (tgis/shard/native/linear/cpu_quant.py
# falls back to PyTorch's int4/int8 ops without it).
CPU_QUANT = Extension(
    "tgis.shard.native.linear._cpu_quant",
    sources=["tgis/shard/native/linear/csrc/cpu_quant.c"],
    extra_compile_args=["-O3", "-fopenmp", "-std=c11", "-ffp-contract=fast", "-Wno-psabi"],
    extra_link_args=["-fopenmp"],
    optional=True,
)

setup(cmdclass={"build_py": BuildWithProtos}, ext_modules=[CPU_ATTENTION, CPU_QUANT])
