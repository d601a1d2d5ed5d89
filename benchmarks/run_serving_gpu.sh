#!/usr/bin/env bash
# One device call of the serving-kernel checks and measurements (H200), results under $OUT.
#   bash benchmarks/run_serving_gpu.sh tests,tune      # or decode / prefill, one per call:
# all nine decode workloads with FlashInfer take ~220 s, the prefill ones more than 150 s
# FlashInfer baselines need the flashinfer bundle (../shared/device/stage.sh flashinfer; carry
# .stage/flashinfer/part1 and run its install.sh first, FLAMIA_SITE=/tmp/site).
# The CuTe decodes (default on sm_90 with nvidia-cutlass-dsl) need the fa4 bundle's
# cutlass-dsl in /tmp/site_fa4 (its two parts, two calls; FlashInfer's tvm-ffi differs, so
# FlashInfer runs in a process of its own):
#   bash benchmarks/run_serving_gpu.sh cute-tests,cute-tune,cute-decode   # ~8 min
#   bash benchmarks/run_serving_gpu.sh cute-ring-tests,cute-ring-tune     # NVFP4 ring stages
#   bash benchmarks/run_serving_gpu.sh cute-fused-combine   # applies an experiment patch first
#     (it applies to e10c587, before the WARPS knob: check that tree out to rerun it)
#   bash benchmarks/run_serving_gpu.sh l2-decode   # decode after a dirty / a clean L2 flush
#   bash benchmarks/run_serving_gpu.sh cute-warps  # CTAs of 8 warps (tests, then the tune)
#     (the fa4 bundle in /tmp/site_fa4, the flashinfer bundle in /tmp/site)
# The fp8 cache's CuTe prefill needs the whole fa4 bundle (flash-attn-4 too):
#   bash benchmarks/run_serving_gpu.sh cute-prefill-tests,cute-prefill
#   bash benchmarks/run_serving_gpu.sh prefill-layouts   # the layout kernel's program shapes
#     bit-equal to 16 keys x 1 head on the GPU, then their times (needs only triton)
#   bash benchmarks/run_serving_gpu.sh flashinfer-warm,s28-prefill   # extend lists' order
#   bash benchmarks/run_serving_gpu.sh cute-prefill-tests,s29-prefill  # Q in the forward
set -uo pipefail
export PYTHONPATH=${FLAMIA_SITE:-/tmp/site}:$PWD PYTHONUNBUFFERED=1 FLAMIA_RESULTS_DIR=$OUT
steps=",${1:-tests,tune},"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
source "$(dirname "$0")/device_run.sh"
log_clocks
if [[ $steps == *,tests,* ]]; then
  run pytest_serving 300 python -m pytest -q tests/kernels/test_paged.py \
    tests/kernels/test_gpu_paged.py tests/numerics/test_serving_numerics.py
fi
if [[ $steps == *,tune,* ]]; then
  run tune_decode 200 python benchmarks/tune_paged.py --cases decode --formats fp8,nvfp4 \
    --name tune_paged_decode
  run tune_prefill 150 python benchmarks/tune_paged.py --cases prefill --formats fp8,nvfp4,bf16 \
    --name tune_paged_prefill
fi
CUTE_SITE=/tmp/site_fa4:$PWD
if [[ $steps == *,cute-tests,* ]]; then
  PYTHONPATH=$CUTE_SITE run pytest_gpu_cute_decode 300 python -m pytest -q -m gpu \
    tests/kernels/test_gpu_cute_decode.py tests/kernels/test_gpu_paged.py
fi
if [[ $steps == *,cute-tune,* ]]; then
  PYTHONPATH=$CUTE_SITE run tune_decode_cute 240 python benchmarks/tune_decode_cute.py --quick
fi
if [[ $steps == *,cute-nvfp4-ctas,* ]]; then  # NVFP4 decode register cap: 2 vs 3 CTAs per SM
  PYTHONPATH=$CUTE_SITE run tune_decode_cute_nvfp4_ctas 200 python \
    benchmarks/tune_decode_cute.py --quick --formats nvfp4 --depths 1 --ctas 0,3 \
    --name tune_decode_cute_nvfp4_ctas
fi
if [[ $steps == *,cute-ring-tests,* ]]; then  # the NVFP4 decode's shared-memory ring
  PYTHONPATH=$CUTE_SITE run pytest_gpu_cute_decode_ring 300 python -m pytest -q -m gpu \
    tests/kernels/test_gpu_cute_decode.py
fi
if [[ $steps == *,cute-ring-tune,* ]]; then  # ring stages x split counts, register ring too
  PYTHONPATH=$CUTE_SITE run tune_decode_cute_ring 300 python benchmarks/tune_decode_cute.py \
    --quick --formats nvfp4 --depths 1 --stages "${FLAMIA_STAGES:-0,3,4,6,8}" \
    --splits 1,2,3,4,6 --name tune_decode_cute_ring
fi
if [[ $steps == *,cute-ring-knobs,* ]]; then  # the ring's edge split (and a register cap)
  PYTHONPATH=$CUTE_SITE run tune_decode_cute_ring_knobs 200 python \
    benchmarks/tune_decode_cute.py --quick --formats nvfp4 --depths 1 --stages 0,3 --edge 0,1 \
    --ctas "${FLAMIA_CTAS:-0}" --splits 1,3 --name tune_decode_cute_ring_knobs
fi
if [[ $steps == *,cute-ring-ncu,* ]]; then  # B64-L8192 NVFP4 decode: register ring vs ring
  for ring in 0 3; do
    PYTHONPATH=$CUTE_SITE run "ncu_decode_nvfp4_B64_ring$ring" 100 ncu -k regex:Decode \
      --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
      --section Occupancy --section MemoryWorkloadAnalysis python benchmarks/profile_paged.py \
      --case decode --dtype nvfp4 --splits 1 --ring $ring
  done
fi
if [[ $steps == *,cute-warps,* ]]; then  # CTAs of 8 warps: fewer splits, no combine at B16
  PYTHONPATH=$CUTE_SITE RUN_TAIL="-n 5" run pytest_gpu_cute_decode_warps 200 python -m pytest \
    -q -m gpu tests/kernels/test_gpu_cute_decode.py -k "warp_counts"
  PYTHONPATH=$CUTE_SITE run tune_decode_cute_warps 240 python benchmarks/tune_decode_cute.py \
    --quick --depths 1 --stages 3 --warps 4,8 --splits 1,2,3 \
    --workloads B16-L8192,B16-L32768 --name tune_decode_cute_warps
fi
if [[ $steps == *,cute-fused-combine,* ]]; then  # experiment: the last split merges (NVFP4)
  p=benchmarks/experiments/decode-nvfp4-fused-combine.patch
  git apply "$p" 2>/dev/null || patch -p1 < "$p" || exit 1
  PYTHONPATH=$CUTE_SITE RUN_TAIL="-n 5" run pytest_gpu_cute_decode_fused_combine 240 python -m \
    pytest -q -s -m gpu tests/kernels/test_gpu_cute_decode.py -k "fused_combine or matches"
  PYTHONPATH=$CUTE_SITE run tune_decode_cute_fused_combine 200 python \
    benchmarks/tune_decode_cute.py --quick --formats nvfp4 --depths 1 --stages 3 --edge 1 \
    --fused 0,1 --splits 1,2,3,4,6 --name tune_decode_cute_fused_combine
fi
if [[ $steps == *,prefill-layouts,* ]]; then  # before moving prefill_operands' default chunk
  PYTHONPATH=$CUTE_SITE run check_prefill_layouts 120 python benchmarks/check_prefill_layouts.py
  PYTHONPATH=$CUTE_SITE run profile_cute_prefill_layouts 200 python \
    benchmarks/profile_cute_prefill.py --quick --no-forward-variants \
    --layouts 16x1,32x1,64x1,128x1 --name profile_cute_prefill_layouts
fi
if [[ $steps == *,flashinfer-warm,* ]]; then  # FlashInfer's prefill JIT, in the background
  FLAMIA_RESULTS_DIR=/tmp python benchmarks/prefill.py --workloads S5-8x1024+0 \
    --impls flashinfer --quick --name flashinfer_warm > /tmp/flashinfer_warm.log 2>&1 &
  warm_pid=$!
fi
# the fp8 cache's prefill on the training forward's CuTe kernel (the fa4 bundle's packages)
if [[ $steps == *,cute-prefill-tests,* ]]; then
  PYTHONPATH=$CUTE_SITE run pytest_gpu_cute_prefill 300 python -m pytest -q -m gpu \
    tests/kernels/test_gpu_cute_prefill.py
fi
if [[ $steps == *,cute-train-tests,* ]]; then
  PYTHONPATH=$CUTE_SITE run pytest_gpu_cute_train "${FLAMIA_TEST_SECS:-330}" python -m pytest -q \
    -m gpu tests/kernels/test_gpu_cute.py tests/kernels/test_gpu_cute_bwd.py -k "${FLAMIA_TEST_K:-}"
fi
if [[ $steps == *,cute-prefill-profile,* ]]; then
  PYTHONPATH=$CUTE_SITE run profile_cute_prefill 300 python benchmarks/profile_cute_prefill.py \
    --quick
fi
if [[ $steps == *,cute-prefill,* ]]; then
  [ -n "${warm_pid:-}" ] && { wait "$warm_pid"; tail -n 5 /tmp/flashinfer_warm.log; }
  PYTHONPATH=$CUTE_SITE run prefill 300 python benchmarks/prefill.py --quick \
    --impls flamia-fp8,flamia-bf16-exact,flamia-nvfp4-exact
  run prefill_flashinfer 300 python benchmarks/prefill.py --quick --impls flashinfer \
    --name prefill_flashinfer
fi
if [[ $steps == *,s28-prefill,* ]]; then  # the extend lists by document (the default since
  # 2026-12-06) against by cost, then FlashInfer (after flashinfer-warm): S1-S4 and MIX
  [ -n "${warm_pid:-}" ] && { wait "$warm_pid"; tail -n 5 /tmp/flashinfer_warm.log; }
  for v in document cost; do
    PYTHONPATH=$CUTE_SITE RUN_TAIL="-n 8" run "prefill_order_$v" 150 python \
      benchmarks/work_order.py --script prefill --fwd $v -- --quick --impls flamia-fp8-exact \
      --name "prefill_order_$v"
  done
  RUN_TAIL="-n 8" run prefill_flashinfer 300 python benchmarks/prefill.py --quick \
    --impls flashinfer --name prefill_flashinfer
fi
if [[ $steps == *,s29-prefill,* ]]; then  # Q quantized in the forward (the default since
  # 2026-12-06) against Q's own launch, two rounds; then FlashInfer where it is installed
  # (after flashinfer-warm): S1-S5 and MIX
  [ -n "${warm_pid:-}" ] && { wait "$warm_pid"; tail -n 5 /tmp/flashinfer_warm.log; }
  for r in 1 2; do
    PYTHONPATH=$CUTE_SITE RUN_TAIL="-n 14" run "prefill_defer_q_r$r" 200 python \
      benchmarks/prefill.py --quick --impls flamia-fp8-exact,flamia-fp8-q-launch \
      --name "prefill_defer_q_s29_r$r"
  done
  if python -c "import flashinfer" 2> /dev/null; then
    RUN_TAIL="-n 8" run prefill_flashinfer 300 python benchmarks/prefill.py --quick \
      --impls flashinfer --name prefill_flashinfer_s29
  fi
fi
if [[ $steps == *,cute-decode,* ]]; then  # four workloads; FlashInfer's JIT takes ~2 min
  W=B16-L8192,B64-L8192,B16-L32768,B64-L32768
  PYTHONPATH=$CUTE_SITE run decode 240 python benchmarks/decode.py --workloads $W --quick
  run decode_flashinfer 300 python benchmarks/decode.py --workloads $W --impls flashinfer \
    --quick --name decode_flashinfer
fi
if [[ $steps == *,l2-decode,* ]]; then  # dirty vs clean L2 before each call, FlashInfer too
  W=B16-L8192,B64-L8192,B16-L32768,B64-L32768
  python benchmarks/decode.py --workloads B1-L1024 --impls flashinfer --quick \
    --name flashinfer_warm > /tmp/flashinfer_warm.log 2>&1 &  # its JIT, meanwhile ours
  warm_pid=$!
  PYTHONPATH=$CUTE_SITE run decode_l2 300 python benchmarks/decode.py --workloads $W --quick \
    --clean-l2 --impls flamia-fp8-exact,flamia-nvfp4-exact,flamia-bf16-exact --name decode_l2
  PYTHONPATH=$CUTE_SITE run decode_overhead 300 python benchmarks/decode_overhead.py
  wait "$warm_pid"; tail -n 3 /tmp/flashinfer_warm.log; rm -f "$OUT"/flashinfer_warm.*
  run decode_l2_flashinfer 300 python benchmarks/decode.py --workloads $W --quick --clean-l2 \
    --impls flashinfer-fp8,flashinfer-bf16 --name decode_l2_flashinfer
fi
if [[ $steps == *,decode,* ]]; then
  run decode 420 python benchmarks/decode.py --quick
fi
if [[ $steps == *,prefill,* ]]; then
  run prefill 420 python benchmarks/prefill.py --quick
fi
pack_out
