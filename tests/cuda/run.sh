#!/usr/bin/env bash
# The GPU check, one command on a CUDA machine (README "GPU"): the CUDA tests (tests/gpu, compiled
# Triton kernels, the engine on the card), then tests/cuda/gpu_check.py on the model given: float32
# tokens against the CPU's, invariance of the default mode, fp8 KV drift, --gpu-memory-utilization,
# and W1 at 1, 16, 64, 256 concurrent requests against transformers. Writes OUT_DIR/gpu_check.json.
#
#   tests/cuda/run.sh MODEL.gguf [OUT_DIR]     (W1 from $KVSERVE_WORKLOADS, as `kvserve bench` reads it)
#
# Python packages the machine lacks (gguf, redis, pyzmq on a bare CUDA image) are installed from
# wheels in .whl/ beside the checkout when it is there: no network is needed.
set -uo pipefail
cd "$(dirname "$0")/../.."
model=${1:?usage: tests/cuda/run.sh MODEL.gguf [OUT_DIR]}
out=${2:-gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvserve-site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/kvserve-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/nvidia-smi.csv"
$py -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/pytest.log"
$py -m tests.cuda.gpu_check --model "$model" --out "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log"
