#!/usr/bin/env bash
# Download the wheels benchmarks/gpu_check.sh installs on a GPU machine that has no package
# registry, into .whl/ (git-ignored; carry it with the working tree).
#
# The GPU image (PyTorch 2.11 + CUDA 13, Python 3.12) already has torch, triton,
# transformers, tokenizers, safetensors, numpy, click, aiohttp, prometheus-client, pytest
# and grpcio; it lacks grpcio-health-checking, grpcio-reflection, grpcio-tools (protoc, to
# generate the stubs) and llguidance (the router's guided decoding). Each travels at the
# version of this checkout's .venv (grpcio-tools' releases lag grpcio's patch numbers), grpcio
# and protobuf too: generated stubs refuse an older runtime than the generator's.
#
#   benchmarks/gpu_wheels.sh [PYTHON_VERSION]     # default 3.12; about 12 MB in all
set -euo pipefail
cd "$(dirname "$0")/.."
py_version="${1:-3.12}"
pip=".venv/bin/pip"
[ -x "$pip" ] || pip="python3 -m pip"
version() { $pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
missing=()
specs=()
for name in grpcio grpcio-tools grpcio-health-checking grpcio-reflection protobuf llguidance; do
    v="$(version "$name")"
    if [ -z "$v" ]; then missing+=("$name"); else specs+=("$name==$v"); fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "gpu_wheels: not installed here: ${missing[*]}; run 'make install' first" >&2
    exit 1
fi
rm -rf .whl && mkdir -p .whl
for spec in "${specs[@]}"; do
    $pip download --quiet --no-deps --only-binary=:all: --python-version "$py_version" \
        --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "$spec"
done
ls -l .whl
du -sh .whl
