#!/usr/bin/env bash
# One command on a GPU machine: set up from carried wheels, run the GPU tests, benchmark the
# step in process and the served 8B-shaped model, and write everything to OUTDIR.
#
#   benchmarks/gpu_wheels.sh            # here, with a package registry: wheels into .whl/
#   benchmarks/gpu_check.sh OUTDIR      # there, in the repository root, .whl/ carried along
#
# Budget: under 16 minutes on one H100 (each part has its own time limit below). Needs
# python3 with torch (CUDA), triton, transformers, tokenizers, safetensors, numpy, click,
# aiohttp, prometheus-client and pytest, as the GPU image has them; everything else comes
# from .whl/ (gpu_wheels.sh says which). Nothing is installed outside /tmp.
#
# OUTDIR receives: env.json (GPU, driver, versions), gpu-tests.xml and gpu-tests.log (the
# tests marked `gpu`: every CUDA attention backend against the reference, the compiled
# step and the CUDA graphs against eager, NCCL with one rank), step.json and step.log
# (benchmarks/step_bench.py: batch 1/8/32/64 x context 512/4096 on the Llama-3.1-8B shape),
# serve-1.json, serve-64.json and serve.log (benchmarks/serve.py at 1 and 64 streams against
# the launcher serving that shape with --load-format dummy), launcher.log, quant-kernels.log
# (benchmarks/quant_kernels.py --device cuda: one 4-/8-bit layer of the 8B shape by the
# Triton products, dequantized + cuBLAS, and dense, at 1/16/64/256 rows), quant.json and
# quant.log (benchmarks/quant_bench.py: the 8B shape dense against random 4-bit GPTQ
# layers, decode at batch 1 and 64), speculation.log (benchmarks/speculation_bench.py:
# prompt lookup on the embedded model, one stream's TPOT on a copying workload and 32
# streams' throughput, with and without --speculate 6), and summary.txt with each part's
# exit status.
#
# For a dry run of the plumbing elsewhere (a CPU host, say), these override the defaults:
# PYTHON (python3), GPU_CHECK_MODEL (benchmarks/models/llama-3.1-8b), GPU_CHECK_LOAD_FORMAT
# (dummy), GPU_CHECK_BATCHES (1,8,32,64), GPU_CHECK_CONTEXTS (512,4096), GPU_CHECK_PORT
# (8033; HTTP on the next port). GPU_CHECK_PARTS picks parts for a short lease (default
# tests,step,serve,quant,speculation); GPU_CHECK_TEST_WORKERS (8) runs the GPU tests on that
# many pytest-xdist workers sharing the one GPU (their compilations are CPU-bound).
# Stubs already generated in tgis/pb (carried from here) are used as they are.
set -uo pipefail
out="${1:?usage: benchmarks/gpu_check.sh OUTDIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.." || exit 1
root="$(pwd)"
summary="$out/summary.txt"
: >"$summary"
started=$SECONDS
py="${PYTHON:-python3}"
model="${GPU_CHECK_MODEL:-benchmarks/models/llama-3.1-8b}"
format="${GPU_CHECK_LOAD_FORMAT:-dummy}"
batches="${GPU_CHECK_BATCHES:-1,8,32,64}"
contexts="${GPU_CHECK_CONTEXTS:-512,4096}"
port="${GPU_CHECK_PORT:-8033}"
http_port=$((port + 1))
log() { echo "[gpu_check $((SECONDS - started))s] $*" | tee -a "$summary"; }
part() { # part NAME LIMIT_S COMMAND...: run with a time limit, record the exit status
    local name="$1" limit="$2"
    shift 2
    log "$name: start (limit ${limit}s)"
    timeout --signal=TERM --kill-after=15 "$limit" "$@"
    local rc=$?
    log "$name: exit $rc"
    return $rc
}

# ---- set-up: carried wheels, generated stubs, the three console scripts -----------------
site=/tmp/tgis-site
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || { log "set-up: wheel install failed"; exit 1; }
fi
export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ ! -f tgis/pb/generation_pb2.py ] || [ ! -f tgis/pb/shard_pb2_grpc.py ]; then
    "$py" scripts/gen_protos.py >/dev/null || { log "set-up: gen_protos failed"; exit 1; }
fi
parts=",${GPU_CHECK_PARTS:-tests,step,serve,quant,speculation},"
wanted() { [[ "$parts" == *",$1,"* ]]; }
bin=/tmp/tgis-bin
mkdir -p "$bin"
for pair in launcher:tgis.launcher.cli router:tgis.router.cli server:tgis.shard.cli; do
    name="${pair%%:*}" module="${pair#*:}"
    printf '#!/bin/sh\nexec %s -c "import sys; from %s import main; sys.argv[0] = \\"%s\\"; main()" "$@"\n' \
        "$py" "$module" "text-generation-$name" >"$bin/text-generation-$name"
    chmod +x "$bin/text-generation-$name"
done
export PATH="$bin:$PATH"

"$py" - "$out/env.json" <<'PY'
import json, subprocess, sys
import torch, triton, grpc, google.protobuf
info = {
    "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
    "grpcio": grpc.__version__, "protobuf": google.protobuf.__version__,
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
    "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    if torch.cuda.is_available() else None,
}
try:
    info["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as e:  # noqa: BLE001
    info["nvidia_smi"] = f"unavailable: {e}"
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info))
PY
log "set-up done"

# ---- 1. the GPU tests --------------------------------------------------------------------
if wanted tests; then
    # Only the modules that hold GPU tests are collected: others import tools the GPU image
    # lacks (jsonschema, openai, ...).
    mapfile -t gpu_modules < <(grep -rl "pytest.mark.gpu" tests --include "test_*.py" | sort)
    workers="${GPU_CHECK_TEST_WORKERS:-8}"
    spread=()
    [ "$workers" -gt 1 ] && spread=(-n "$workers" --dist load)
    part gpu-tests 240 "$py" -m pytest -q -m gpu "${gpu_modules[@]}" -p no:cacheprovider \
        "${spread[@]}" -rfE --tb=short --junitxml "$out/gpu-tests.xml" >"$out/gpu-tests.log" 2>&1
    tail -5 "$out/gpu-tests.log" | tee -a "$summary"
fi

# ---- 2. the in-process step benchmark ----------------------------------------------------
if wanted step; then
    part step-bench 150 "$py" benchmarks/step_bench.py --model "$model" --load-format "$format" \
        --batches "$batches" --contexts "$contexts" --steps 20 --json "$out/step.json" \
        >"$out/step.log" 2>&1
    tail -12 "$out/step.log" | tee -a "$summary"
fi

# ---- 3. the served model at 1 and 64 streams ----------------------------------------------
if wanted serve; then
    [ -f "$model/tokenizer.json" ] || "$py" benchmarks/make_synthetic_tokenizer.py "$model" >/dev/null
    text-generation-launcher --model-name "$model" --load-format "$format" \
        --grpc-port "$port" --port "$http_port" >"$out/launcher.log" 2>&1 &
    launcher=$!
    ready=0
    for _ in $(seq 240); do
        if "$py" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$http_port/health', timeout=2)" \
            >/dev/null 2>&1; then ready=1; break; fi
        kill -0 "$launcher" 2>/dev/null || break
        sleep 1
    done
    if [ "$ready" = 1 ]; then
        log "serve: launcher ready"
        for streams in 1 64; do
            part "serve-$streams" 75 "$py" benchmarks/serve.py --target "127.0.0.1:$port" \
                --metrics-url "http://127.0.0.1:$http_port/metrics" --model-label "$model ($format)" \
                --concurrency "$streams" --num-requests $((streams * 2)) \
                --input-tokens 512 --output-tokens 128 --json "$out/serve-$streams.json" \
                >>"$out/serve.log" 2>&1
        done
        tail -30 "$out/serve.log" | tee -a "$summary"
    else
        log "serve: the launcher did not become ready"
        tail -20 "$out/launcher.log" | tee -a "$summary"
    fi
    kill -TERM "$launcher" 2>/dev/null
    wait "$launcher" 2>/dev/null
fi

# ---- 4. quantized weights: one layer by kernel, then the 8B shape dense, 4-bit, FP8 ------
if wanted quant; then
    part quant-kernels 120 "$py" benchmarks/quant_kernels.py --device cuda \
        --shapes 28672x4096,4096x14336,6144x4096 --rows 1,16,64,256 --bits 4,8 \
        >"$out/quant-kernels.log" 2>&1
    tail -25 "$out/quant-kernels.log" | tee -a "$summary"
    part quant-bench 240 "$py" benchmarks/quant_bench.py --model "$model" --dtype bfloat16 \
        --batches 1,64 --contexts 512 --steps 10 --rounds 1 --variants dense,gptq,fp8 \
        --json "$out/quant.json" >"$out/quant.log" 2>&1
    tail -10 "$out/quant.log" | tee -a "$summary"
fi

# ---- 5. speculative decoding: prompt lookup on the embedded (trained) model ---------------
if wanted speculation; then
    part speculation 180 "$py" benchmarks/speculation_bench.py --rounds 1 --repeats 1 \
        --speculate 6 --concurrency 32 >"$out/speculation.log" 2>&1
    tail -8 "$out/speculation.log" | tee -a "$summary"
fi
log "done in $((SECONDS - started)) s"
