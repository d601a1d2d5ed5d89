#!/usr/bin/env bash
# One device call of the vLLM backend checks and measurements (H200, issue 12), results
# under $OUT:
#   bash benchmarks/run_vllm_gpu.sh tests,e2e        # GPU serving tests, vllm_e2e.py (~5 min)
#   bash benchmarks/run_vllm_gpu.sh throughput-a     # vllm_throughput.py workload a (~6 min)
#   bash benchmarks/run_vllm_gpu.sh throughput-b     # workload b (~6 min)
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
if [[ $steps == *,throughput-b,* ]]; then
  run vllm_throughput_b 570 python benchmarks/vllm_throughput.py --workloads b \
    --name vllm_throughput_b --budget-s 540 --per-run-s 110
fi
ls -la "$OUT"
