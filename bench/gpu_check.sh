#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py), run from the repo root on a lent GPU machine, whose
# Python has JAX with the CUDA plugin but lacks a few of jserve's packages and has no network.
# Prepared here, first:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 -d .whl gguf==0.19.0 msgspec llguidance==1.9.1 \
#     qwix==0.1.8 pyzmq
#   python -m bench.gpu_check cut GGUF .gpu/smollm2-10.gguf --layers 10
#   python -m bench.gguf_to_hf .gpu/smollm2-10.gguf .gpu/smollm2-10.hf
#   JAX_PLATFORMS=cpu python -m bench.gpu_check reference --model .gpu/smollm2-10.gguf --json .gpu/ref_cpu.json
# then .whl and .gpu (without the .hf copy, rebuilt there) travel with the tree; results in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
# jserve is not installed there: its server/ folder, installed as jserve.server, is linked in.
python3 -c "import jserve.server" 2>/dev/null || ln -s ../server jserve/server
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
echo "== (a) kernels against float64, compiled for the GPU"
JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -n0 --tb=line \
  tests/pallas/test_ragged_attention.py tests/pallas/test_kv_fp8.py tests/pallas/test_kv_int8.py \
  -k "triton or xla" 2>&1 | tee "$OUT/kernel_tests.log" | tail -25
echo "== (b) attention and projection timings, with the device-to-device copy bandwidth"
timeout 100 python3 -m bench.kernel_timings --json "$OUT/kernel_timings.json" 2>&1 |
  tee "$OUT/kernel_timings.log" | grep -v "^[EWI][0-9]" | tail -40
echo "== (c) the engine on the GPU against the CPU's tokens"
timeout 60 python3 -m bench.gguf_to_hf .gpu/smollm2-10.gguf .gpu/smollm2-10.hf 2>&1 | tail -1
timeout 200 python3 -m bench.gpu_check engine "$@" --model .gpu/smollm2-10.gguf \
  --reference .gpu/ref_cpu.json --json "$OUT/engine.json" 2>&1 | tee "$OUT/engine.log" |
  grep -v "^[EWI][0-9]" | tail -30
