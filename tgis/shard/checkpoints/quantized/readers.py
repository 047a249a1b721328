"""The layout reader for a quantization scheme (``scheme.py``)."""

from __future__ import annotations

from tgis.shard.checkpoints.quantized.at_load import AtLoadReader
from tgis.shard.checkpoints.quantized.awq import AwqReader
from tgis.shard.checkpoints.quantized.compressed_tensors import CompressedTensorsReader
from tgis.shard.checkpoints.quantized.fp8 import Fp8Reader
from tgis.shard.checkpoints.quantized.gptq import GptqReader
from tgis.shard.checkpoints.quantized.scheme import QuantScheme
from tgis.shard.checkpoints.quantized.source import LayoutReader


def layout_reader(scheme: QuantScheme | None) -> LayoutReader | None:
    """How ``scheme``'s linear layers are read (None: a dense model, or MXFP4, whose
    linear layers are dense and whose experts gpt-oss dequantizes itself); StartupError, in
    one line naming the format, for a variant tgis does not read."""
    if scheme is None or scheme.method == "mxfp4":
        return None
    if not scheme.pre_quantized:
        return AtLoadReader(scheme.method)
    if scheme.method == "gptq":
        return GptqReader.from_config(scheme.config)
    if scheme.method == "awq":
        return AwqReader.from_config(scheme.config)
    if scheme.method == "compressed-tensors":
        return CompressedTensorsReader.from_config(scheme.config)
    return Fp8Reader.from_config(scheme.config)
