#!/usr/bin/env bash
# One device call of the vLLM backend checks and measurements (H200, issue 12), results
# under $OUT:
#   bash benchmarks/run_vllm_gpu.sh tests,e2e        # GPU serving tests, vllm_e2e.py (~5 min)
#   bash benchmarks/run_vllm_gpu.sh throughput-a     # vllm_throughput.py workload a (~7 min)
#   bash benchmarks/run_vllm_gpu.sh throughput-b     # workload b, 8/4-bit caches (~9 min)
#   bash benchmarks/run_vllm_gpu.sh throughput-b-bf16   # workload b, BF16 caches (~8 min)
# then merge the JSONs here: python benchmarks/vllm_throughput.py --merge A.json B.json ...
# Needs the vllm bundle in /tmp/site and the fa4 bundle in /tmp/site_fa4 (the CuTe decodes
# and the fp8 cache's CuTe prefill; its apache-tvm-ffi shadows vLLM's, which a dense Llama
# does not import): ../shared/device/stage.sh vllm fa4, then one call per part (README,
# "Serving with vLLM"): FLAMIA_SITE=/tmp/site for vllm, FLAMIA_SITE=/tmp/site_fa4 for fa4.
# The vllm-serve bundle (for the `serve` part of vllm_e2e.py) goes into /tmp/site too.
set -uo pipefail
export PYTHONPATH=/tmp/site_fa4:/tmp/site:$PWD PYTHONUNBUFFERED=1 FLAMIA_RESULTS_DIR=$OUT
export HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
steps=",${1:-tests,e2e},"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
source "$(dirname "$0")/device_run.sh"
if [[ $steps == *,tests,* ]]; then
  run pytest_gpu_serving 240 python -m pytest -q -m gpu tests/kernels/test_gpu_paged.py \
    tests/kernels/test_gpu_cute_decode.py tests/kernels/test_gpu_cute_prefill.py
fi
if [[ $steps == *,e2e,* ]]; then
  run vllm_e2e 420 python benchmarks/vllm_e2e.py
fi
if [[ $steps == *,throughput-a,* ]]; then
  run vllm_throughput_a 570 python benchmarks/vllm_throughput.py --workloads a \
    --name vllm_throughput_a --budget-s 540 --per-run-s 110
fi
# the 8-bit / 4-bit caches on b (~9 min with TRITON_ATTN, which needs ~170 s alone)
if [[ $steps == *,throughput-b,* ]]; then
  run vllm_throughput_b 570 python benchmarks/vllm_throughput.py --workloads b \
    --configs flamia-nvfp4,flash_attn-fp8,flamia-fp8_per_token_head,triton_attn-fp8_per_token_head \
    --name vllm_throughput_b --budget-s 540 --per-run-s 200
fi
# the BF16 caches on b: 12 requests at a time, ~2-4 min each (not yet measured)
if [[ $steps == *,throughput-b-bf16,* ]]; then
  run vllm_throughput_b_bf16 580 python benchmarks/vllm_throughput.py --workloads b \
    --configs flamia-auto,flash_attn-auto --name vllm_throughput_b_bf16 --budget-s 560 \
    --per-run-s 280
fi
pack_out
