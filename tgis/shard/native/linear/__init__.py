"""Linear layers and their kernels: the tensor-parallel layers (``sharded``), each weight's
kernel (``quantized_linear``: dense, oneDNN-packed ``cpu_gemm``, 4/8-bit ``cpu_quant`` +
``csrc/cpu_quant.c`` and ``quant_triton``, FP8 ``fp8_linear``), and LoRA's deltas
(``lora_rows``, ``lora_triton``)."""
