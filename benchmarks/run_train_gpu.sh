#!/usr/bin/env bash
# One device call of the training-path checks and measurements (H200), results under $OUT.
#   bash benchmarks/run_train_gpu.sh smoke,bench,host,numerics    # or tests,tune,pretrain,packs,
#                                                   # cutebwd, cutebwd-check, variants, workspace,
#                                                   # host-baseline, mixed, quant, fwd-pv,
#                                                   # fused-q, fused-q-bench, windows-two-pass,
#                                                   # bwd-bench, bwd-profile, bwd-pass, stagger,
#                                                   # quant-tune, quant-profile, items,
#                                                   # q-producer, quant-prefetch, d256-bwd,
#                                                   # p2, d256-tune, own-layout, s18, d256-numerics,
#                                                   # mixed-short, s19, s19-bench, dv-step,
#                                                   # d128-passes, s19-w, grad-input,
#                                                   # nvfp4-search, s22-checks,
#                                                   # host-marginal, s23, s25, s26-h200,
#                                                   # bwd-items, work-order, work-rounds, s28,
#                                                   # s28-w, s28-tests, s29-fwd-ab,
#                                                   # s29-fwd-tests, w-table, per-wg-dq,
#                                                   # s30-windows-q, s30-windows-kernel,
#                                                   # fwd-item-profile, s32-d64-tests,
#                                                   # s32-d64, s32-regs-ab
# Expects the fa4 bundle installed with FLAMIA_SITE=/tmp/site_fa4 (../shared/device/stage.sh
# fa4; the vllm bundle pins another apache-tvm-ffi, so they live in separate sites).
set -uo pipefail
export PYTHONPATH=${FLAMIA_SITE:-/tmp/site_fa4}:$PWD PYTHONUNBUFFERED=1 FLAMIA_RESULTS_DIR=$OUT
steps=",${1:-smoke,bench,host,numerics},"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
source "$(dirname "$0")/device_run.sh"
log_clocks
if [[ $steps == *,smoke,* ]]; then
  run smoke 120 python - <<'PY'
import torch
from flamia_serve import flamia_attn_varlen
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention
for recipe in ("mxfp8", "mixed_nvfp4"):
    q, k, v, cu, ms = make_pack((300, 1, 700, 47), 8, 2, 128, seed=1, device="cuda")
    do = torch.randn_like(q)
    res = []
    for fn in (flamia_attn_varlen, attention):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = fn(*leaves, cu, ms, recipe=recipe); o.backward(do)
        res.append([o.detach(), *(x.grad for x in leaves)])
    rel = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(*res)]
    print(recipe, "kernel vs reference rel err O/dQ/dK/dV:", [f"{r:.2e}" for r in rel])
PY
fi
if [[ $steps == *,cutebwd,* ]]; then  # the CuTe backward against the reference and Triton,
  # and its column copies / dQ read-back (kernels/columns.py) against their twins
  run pytest_gpu_cute_bwd "${FLAMIA_TEST_SECS:-200}" python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_gpu_cute_bwd.py tests/kernels/test_gpu_bwd.py tests/kernels/test_columns.py
fi
if [[ $steps == *,mixed,* ]]; then  # the mixed recipes on the CuTe kernels (BF16 scores), the
  # backward tests on the CuTe layout, the serving no-recompile test
  run pytest_gpu_cute_mixed "${FLAMIA_TEST_SECS:-420}" python -m pytest -v -W ignore::DeprecationWarning \
    "tests/kernels/test_gpu_cute.py::test_cute_fwd_mixed_matches_reference_and_triton" \
    "tests/kernels/test_gpu_cute.py::test_cute_rejects_what_it_does_not_run" \
    tests/kernels/test_gpu_paged.py tests/kernels/test_gpu_cute_bwd.py tests/kernels/test_gpu_bwd.py \
    tests/kernels/test_attn_bwd.py -k "${FLAMIA_TEST_K:-not test_gpu_paged or compile_nothing}"
fi
if [[ $steps == *,quant,* ]]; then  # the quantizers bit-exact on the GPU, then their launch sweep
  run pytest_gpu_quant "${FLAMIA_TEST_SECS:-240}" python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_common.py tests/kernels/test_quant.py tests/kernels/test_paged.py \
    tests/kernels/test_gpu_paged.py \
    "tests/kernels/test_gpu_cute.py::test_cute_fwd_mixed_matches_reference_and_triton" \
    "tests/kernels/test_gpu_cute.py::test_cute_fwd_reads_only_the_score_operands" \
    -k "${FLAMIA_QUANT_K:-not test_paged or nvfp4}"
  run tune_quant 240 python benchmarks/tune_quant.py --workloads W1,W3,W7 \
    --recipes mxfp8,mixed_nvfp4 --scores-only
fi
if [[ $steps == *,fwd-pv,* ]]; then  # the CuTe forward's P̂·V̂ accumulated in the wgmma against
  # promoted per tile: GPU tests of the variants, accuracy on long documents, forward speed
  run pytest_gpu_cute_pv "${FLAMIA_TEST_SECS:-240}" python -m pytest -q -m gpu -W ignore::DeprecationWarning \
    tests/kernels/test_gpu_cute.py \
    -k "${FLAMIA_TEST_K:-(pv-in-mma and ([0- or [1-) and not 128x64) or (d256 and pv-in-mma and causal)}"
  run fwd_accumulation 200 python benchmarks/fwd_accumulation.py
  run train_attention_pv 360 python benchmarks/train_attention.py --quick --passes fwd \
    --workloads "${FLAMIA_PV_WORKLOADS:-W1,W2,W3,W4,W5,W6,W7,W8,W9,P1,P2,P3,P4,P5}" \
    --impls "${FLAMIA_IMPLS:-flamia-mxfp8-pv-promoted,flamia-mxfp8-pv-in-mma,flamia-mxfp8-pv-in-mma-overlap,fa4}" \
    --name "${FLAMIA_BENCH_NAME:-train_attention_pv}"
fi
if [[ $steps == *,fused-q,* ]]; then  # Q quantized inside the CuTe forward: its bits against the
  # quantization launch's codes, the default path
  run pytest_gpu_cute_fused_q "${FLAMIA_TEST_SECS:-300}" python -m pytest -q -m gpu -W ignore::DeprecationWarning \
    tests/kernels/test_gpu_cute.py tests/kernels/test_gpu.py \
    -k "${FLAMIA_TEST_K:-quantizing_q or default_here or leakage or fp16_output or ticket}"
  run fwd_repeatability 240 python benchmarks/check_fwd_repeatability.py
fi
if [[ $steps == *,fused-q-bench,* ]]; then  # forward speed with Q quantized inside or not, FA4
  run train_attention_fused_q 420 python benchmarks/train_attention.py --quick --passes fwd \
    --workloads "${FLAMIA_FUSED_Q_WORKLOADS:-W1,W2,W3,W4,W5,W6,W7,W8,W9,P1,P2,P3,P4,P5}" \
    --impls "${FLAMIA_IMPLS:-flamia-mxfp8,flamia-mxfp8-separate-q,flamia-mxfp8-quant,fa4}" \
    --name "${FLAMIA_BENCH_NAME:-train_attention_fused_q}"
fi
if [[ $steps == *,windows-two-pass,* ]]; then  # experiment: the window kernel's NaN path in a
  # second launch, V̂ rows from the quantizer; per-kernel times before (this tree) and after
  run profile_windows_before 120 python benchmarks/profile_windows.py P1 P4
  p=benchmarks/experiments/windows-two-pass-v-rows.patch
  git apply "$p" 2>/dev/null || patch -p1 < "$p" || exit 1
  run pytest_windows_two_pass "${FLAMIA_TEST_SECS:-240}" python -m pytest -q \
    -W ignore::DeprecationWarning tests/kernels/test_attn_fwd.py tests/kernels/test_quant.py \
    -k "window or v_rows or bit_exact"
  run profile_windows_after 120 python benchmarks/profile_windows.py P1 P4
  run train_attention_windows_two_pass 240 python benchmarks/train_attention.py --quick \
    --passes fwd --workloads P1,P2,P4 --impls flamia-mxfp8,flamia-mxfp8-no-windows,fa4 \
    --name train_attention_windows_two_pass
fi
if [[ $steps == *,bench,* ]]; then
  run train_attention 400 python benchmarks/train_attention.py --quick --check \
    --passes fwd,fwd+bwd,bwd --impls "${FLAMIA_IMPLS:-flamia-mxfp8,fa4,cudnn-sdpa,fa2-varlen,flex-docmask}" \
    --flex-workloads W3 --name "${FLAMIA_BENCH_NAME:-train_attention}"
fi
if [[ $steps == *,variants,* ]]; then  # FLAMIA_BWD_VARIANTS="NAME=PATH ..." against the current
  # shellcheck disable=SC2086
  run bwd_variants 300 python benchmarks/bwd_variants.py ${FLAMIA_BWD_VARIANTS:-}
fi
if [[ $steps == *,cutebwd-check,* ]]; then  # both backward kernels, same operands and run
  run bwd_kernels 200 python benchmarks/check_bwd_kernels.py
fi
if [[ $steps == *,host,* ]]; then
  run host_time 120 python benchmarks/host_time.py --breakdown
fi
if [[ $steps == *,host-marginal,* ]]; then  # host time per call at 8 and 32 layers per step,
  # and what one more call adds (the per-step costs taken out), eager and CUDA graphs
  RUN_TAIL="-n 30" run host_time_marginal 300 python benchmarks/host_time.py --layers 8,32
fi
if [[ $steps == *,s23,* ]]; then  # prepared launches (AttnCall.prepared: BoundLaunch, the
  # compiled Triton kernels' runners with each call's addresses; BoundCall, the CuTe TVM-FFI
  # calls): the eager path's tests with plans (fwd+bwd reused across steps and layers, CuTe
  # Q slot, NVFP4, d = 256 own layout, window kernel), the kept column copies / V gather /
  # dQ read-back (test_columns, 2026-12-05 s24), e4m3_value's saturation, the
  # adversarial entry calls, the CuTe forward/backward suites, then host time (eager vs eager-unprepared in the same run; 8 and 32 layers per step)
  # (files in order of importance: a timeout cuts the last ones)
  run pytest_gpu_s23 "${FLAMIA_TEST_SECS:-330}" python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_workspace.py tests/kernels/test_columns.py tests/test_nonfinite.py \
    tests/kernels/test_common.py tests/kernels/test_gpu_cute_bwd.py tests/kernels/test_entry_adversarial.py \
    tests/kernels/test_gpu_cute.py -k "not test_cute_bwd_matches_reference or lens0"
  RUN_TAIL="-n 45" run host_time_s23 300 python benchmarks/host_time.py --breakdown \
    --layers 8,32
fi
if [[ $steps == *,host-baseline,* ]]; then  # host_time.py of an earlier tree on this machine:
  # FLAMIA_BASELINE_TREE, e.g. scratch/old from `git archive COMMIT flamia_serve benchmarks/*.py`
  mkdir -p "$OUT/baseline"
  (cd "${FLAMIA_BASELINE_TREE:?}" && PYTHONPATH=${FLAMIA_SITE:-/tmp/site_fa4}:$PWD \
    FLAMIA_RESULTS_DIR=$OUT/baseline run host_time_baseline 150 python benchmarks/host_time.py)
fi
if [[ $steps == *,workspace,* ]]; then  # the eager path's reused buffers and launches
  run pytest_gpu_workspace "${FLAMIA_TEST_SECS:-400}" python -m pytest -v -W ignore::DeprecationWarning \
    tests/kernels/test_workspace.py tests/kernels/test_quant.py tests/test_nonfinite.py \
    tests/kernels/test_attn_bwd.py tests/kernels/test_gpu_bwd.py \
    tests/kernels/test_gpu_cute_bwd.py -k "not test_cute_bwd_matches_reference or lens0 or lens4"
fi
if [[ $steps == *,packs,* ]]; then  # the pack families P1-P5 (~60 s with FA4 compiled)
  run train_attention_packs 300 python benchmarks/train_attention.py --quick \
    --workloads P1,P2,P3,P4,P5 \
    --impls "${FLAMIA_PACK_IMPLS:-flamia-mxfp8,flamia-mxfp8-quant,fa4,fa2-varlen,cudnn-sdpa}" \
    --name "${FLAMIA_PACK_NAME:-train_attention_packs}"
fi
if [[ $steps == *,numerics,* ]]; then
  run bwd_numerics 150 python benchmarks/bwd_numerics.py
fi
if [[ $steps == *,tests,* ]]; then
  run pytest_kernels 540 python -m pytest -q tests/kernels/test_common.py \
    tests/kernels/test_quant.py tests/kernels/test_attn_fwd.py tests/kernels/test_attn_bwd.py \
    tests/kernels/test_gpu_bwd.py tests/kernels/test_gpu.py tests/kernels/test_gpu_cute.py \
    tests/kernels/test_gpu_cute_bwd.py \
    tests/kernels/test_paged.py tests/kernels/test_gpu_paged.py tests/test_nonfinite.py \
    tests/test_readme.py
fi
if [[ $steps == *,pretrain,* ]]; then  # three attention choices, same seed and data
  stdlib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  run pretrain 560 python -m flamia_serve.train.pretrain --source "$stdlib" \
    --attention bf16 mxfp8 mixed_nvfp4 --micro-batches 2 --no-progress --json "$OUT/pretrain.json"
fi
if [[ $steps == *,tune,* ]]; then
  run tune_bwd 240 python benchmarks/tune_bwd.py --workloads W3
fi
if [[ $steps == *,bwd-bench,* ]]; then  # the training backward next to FA4 on W1-W9
  run train_attention_bwd 120 python benchmarks/train_attention.py --quick \
    --passes fwd+bwd,bwd --impls flamia-mxfp8,fa4 --name train_attention_bwd
fi
if [[ $steps == *,bwd-pass,* ]]; then  # a training backward's GPU time, kernel by kernel
  run profile_bwd_pass 120 python benchmarks/profile_bwd_pass.py --workloads W3,W6,W7
  run profile_fwd_pass 90 python benchmarks/profile_bwd_pass.py --workloads W1,W4,W7 --pass fwd
fi
if [[ $steps == *,quant-tune,* ]]; then  # the quantizers around the kernels (warps, programs
  # per SM) and the dQ read-back, W3 / W7 / P3; first their bits
  run pytest_gpu_quant_tune "${FLAMIA_TEST_SECS:-200}" python -m pytest -q \
    -W ignore::DeprecationWarning tests/kernels/test_quant.py tests/kernels/test_columns.py
  RUN_TAIL="-n 80" run tune_bwd_pass 300 python benchmarks/tune_bwd_pass.py
fi
if [[ $steps == *,quant-profile,* ]]; then  # ncu of the three quantization launches of one
  # W7 training step (the forward's K/V, the backward's Q/K/V, dO): the second call's (the
  # forward that make_call runs for its output, and the first call, make 4 before it)
  run ncu_quant 240 ncu -k regex:quantize --launch-skip 4 --launch-count 3 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis python benchmarks/profile_bwd_pass.py --workloads W7 \
    --pass fwd+bwd --once
fi
if [[ $steps == *,stagger,* ]]; then  # the staggered joint dQ (experiments/cute-bwd-stagger.patch,
  # compile-checked only): both forms against the Triton kernel and timed beside the current one
  mkdir -p scratch/stagger_run
  cp flamia_serve/kernels/attn_bwd/cute_sm90.py scratch/stagger_run/s1.py
  patch -s scratch/stagger_run/s1.py benchmarks/experiments/cute-bwd-stagger.patch ||
    sed 's|flamia_serve/kernels/attn_bwd/cute_sm90.py|scratch/stagger_run/s1.py|' \
      benchmarks/experiments/cute-bwd-stagger.patch | git apply -  # (no patch(1) there)
  sed 's/^STAGGER = 1$/STAGGER = 2/' scratch/stagger_run/s1.py > scratch/stagger_run/s2.py
  run bwd_variants_stagger 420 python benchmarks/bwd_variants.py --timeout 380 --ablate nocta \
    stagger=scratch/stagger_run/s1.py stagger_start=scratch/stagger_run/s2.py
fi
if [[ $steps == *,items,* ]]; then  # what a forward work item costs beside its key tiles
  # (fwd_items.py: fit over W1, W3 and 16k tokens in 1..128 equal documents, FA4 beside,
  # timing-only ablations), then those packs' forward and forward+backward next to FA4
  RUN_TAIL="-n 30" run fwd_items 300 python benchmarks/fwd_items.py --ablate noepi,noqq
  run train_attention_equal 240 python benchmarks/train_attention.py --quick \
    --workloads E1,E4,E16,E64,E128 --passes fwd,fwd+bwd --impls flamia-mxfp8,fa4 \
    --name train_attention_equal
fi
if [[ $steps == *,q-producer,* ]]; then  # experiment: the forward's Q quantized by the
  # producer warpgroup's warps 1-2 into two code buffers while the consumers run the item
  # before (experiments/cute-fwd-q-by-producer.patch, compile-checked only): the tree as it
  # is, then patched: bits, leakage, repeatability, then speed beside FA4
  RUN_TAIL="-n 10" run fwd_items_before 150 python benchmarks/fwd_items.py --no-fa4 \
    --name fwd_items_before
  git apply benchmarks/experiments/cute-fwd-q-by-producer.patch || exit 1
  run pytest_gpu_q_producer 300 python -m pytest -q -x -W ignore::DeprecationWarning \
    tests/kernels/test_gpu_cute.py tests/test_nonfinite.py \
    -k "quantizing_q or leakage or ticket or default_here or fp16_output or nonfinite or nan"
  run fwd_repeatability_q_producer 200 python benchmarks/check_fwd_repeatability.py
  RUN_TAIL="-n 10" run fwd_items_q_producer 150 python benchmarks/fwd_items.py \
    --name fwd_items_q_producer
  run train_attention_q_producer 300 python benchmarks/train_attention.py --quick --passes fwd \
    --workloads W1,W4,W7,P3,P4,E16,E64,E128 --impls flamia-mxfp8,fa4 \
    --name train_attention_q_producer
fi
if [[ $steps == *,quant-prefetch,* ]]; then  # experiment: the quantizers load the next
  # item's tiles before they store the current item's codes
  # (experiments/quant-prefetch-next-item.patch): launches timed before and after, the
  # patched quantizers' bits on the GPU, then W7 / P3 beside FA4
  sweep=${FLAMIA_QUANT_SWEEP:-4x32,4x16,8x8}
  RUN_TAIL="-n 12" run tune_quant_before 200 python benchmarks/tune_bwd_pass.py \
    --quant-sweep "$sweep" --name tune_quant_before
  git apply benchmarks/experiments/quant-prefetch-next-item.patch || exit 1
  RUN_TAIL="-n 12" run tune_quant_prefetch 200 python benchmarks/tune_bwd_pass.py \
    --quant-sweep "$sweep" --name tune_quant_prefetch
  run pytest_gpu_quant_prefetch 200 python -m pytest -q -x -W ignore::DeprecationWarning \
    tests/kernels/test_quant.py tests/kernels/test_columns.py tests/kernels/test_gpu_bwd.py
  RUN_TAIL="-n 12" run train_attention_quant_prefetch 200 python benchmarks/train_attention.py \
    --quick --workloads W7,P3 --passes fwd,fwd+bwd --impls flamia-mxfp8,fa4 \
    --name train_attention_quant_prefetch
fi
if [[ $steps == *,d256-bwd,* ]]; then  # the d = 256 backward (Triton) with its head dim split
  # over programs (BwdConfig.head_dim_parts): the tests, the kernel alone per config, then
  # P2's forward+backward beside FA4
  run pytest_gpu_bwd_d256 200 python -m pytest -q -x -W ignore::DeprecationWarning \
    tests/kernels/test_attn_bwd.py -k "head_dim_parts or matches_reference or round_trip"
  RUN_TAIL="-n 8" run tune_bwd_d256 240 python benchmarks/tune_bwd.py --workloads P2 \
    --no-extra-shapes --configs "${FLAMIA_BWD_CONFIGS:-8x2x1,8x2x2,4x2x2,8x2x4}" --name tune_bwd_d256
  RUN_TAIL="-n 8" run train_attention_p2 150 python benchmarks/train_attention.py --quick \
    --workloads P2 --passes fwd,fwd+bwd --impls flamia-mxfp8,fa4 --name train_attention_p2_d256
fi
if [[ $steps == *,p2,* ]]; then  # P2 (d = 256) beside FA4, every pass
  RUN_TAIL="-n 10" run train_attention_p2 200 python benchmarks/train_attention.py \
    --quick --workloads P2 --passes fwd,fwd+bwd,bwd --impls flamia-mxfp8,fa4 --name train_attention_p2
fi
if [[ $steps == *,d256-tune,* ]]; then  # the d = 256 CuTe backward: stages / step size
  # (kernel alone, P2's shape and T = 16384), the pass around it, the mixed recipe on P2
  for t in 8192; do
    for cfg in s2:2:0 s3:3:0 s1q64:1:64; do
      IFS=: read -r tag stages step <<< "$cfg"
      RUN_TAIL="-n 1" run "bwd_d256_T${t}_$tag" 120 python benchmarks/profile_bwd.py \
        --kernel cute --d 256 --tokens "$t" --stages "$stages" --step "$step"
    done
  done
  RUN_TAIL="-n 14" run profile_bwd_pass_p2 150 python benchmarks/profile_bwd_pass.py \
    --workloads P2 --pass bwd
  RUN_TAIL="-n 8" run train_attention_p2_mixed 200 python benchmarks/train_attention.py \
    --quick --check --workloads P2 --passes fwd+bwd --impls flamia-mixed_nvfp4,flamia-mxfp8 \
    --name train_attention_p2_mixed
fi
if [[ $steps == *,own-layout,* ]]; then  # the backward on its own layout (a forward on
  # another one: Triton forward, mixed d = 256), then P1 (short documents) with either
  # backward kernel and P2 mixed, beside FA4
  run pytest_gpu_bwd_own_layout 300 python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_gpu_cute_bwd.py tests/kernels/test_attn_bwd.py \
    -k "another_layout or default_on_its_layout or layout or call or compile or default_bwd"
  RUN_TAIL="-n 14" run train_attention_own_layout 240 python benchmarks/train_attention.py \
    --quick --workloads P1,P2 --passes fwd+bwd \
    --impls flamia-mxfp8,flamia-mxfp8-cute-bwd,flamia-mxfp8-triton-bwd,flamia-mixed_nvfp4,fa4 \
    --name train_attention_own_layout
fi
if [[ $steps == *,s18,* ]]; then  # the eighteenth session's last call: the column copies
  # walked in column order and the backward on its own layout, tested; the backward pass's
  # kernels at W6 and P2; P1, P2, W6 beside every baseline
  run pytest_gpu_s18 200 python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_columns.py tests/kernels/test_gpu_cute_bwd.py \
    -k "not test_cute_bwd_matches_reference and not crosses"
  RUN_TAIL="-n 20" run profile_bwd_pass_s18 120 python benchmarks/profile_bwd_pass.py \
    --workloads W6,P2 --pass bwd
  RUN_TAIL="-n 40" run train_attention_s18 280 python benchmarks/train_attention.py \
    --quick --check --workloads P1,P2,W6 --passes fwd,fwd+bwd \
    --impls flamia-mxfp8,flamia-mixed_nvfp4,fa4,cudnn-sdpa,fa2-varlen,flex-docmask \
    --name train_attention_s18
fi
if [[ $steps == *,d256-numerics,* ]]; then  # O/dQ/dK/dV against float64 at d = 256 (and 128)
  for d in 256 128; do
    RUN_TAIL="-n 13" run "bwd_numerics_d$d" 150 python benchmarks/bwd_numerics.py --d "$d" \
      --accuracy-only --name "bwd_numerics_d$d"
  done
fi
if [[ $steps == *,mixed-short,* ]]; then  # the mixed recipe on packs of short documents:
  # the Triton forward (the default under 32 tokens a document) against the CuTe one, and
  # the quantization alone
  RUN_TAIL="-n 14" run train_attention_mixed_short 300 python benchmarks/train_attention.py \
    --quick --workloads P1,W7 --passes fwd,fwd+bwd \
    --impls flamia-mixed_nvfp4,flamia-mixed_nvfp4-cute,flamia-mixed_nvfp4-quant,flamia-mxfp8,fa4 \
    --name train_attention_mixed_short
fi
if [[ $steps == *,dv-step,* ]]; then  # the d = 256 dV pass at 64-query steps (now the
  # default, STEP_DV_PASS): its GPU tests
  run pytest_gpu_dv_step 240 python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_gpu_cute_bwd.py -k "256 or p_hat or passes"
fi
if [[ $steps == *,s19-w,* ]]; then  # W1–W9 and P3–P5 forward+backward beside FA4 and cuDNN
  RUN_TAIL="-n 45" run train_attention_s19_w 420 python benchmarks/train_attention.py \
    --quick --workloads W1,W2,W3,W4,W5,W6,W7,W8,W9,P3,P4,P5 --passes fwd+bwd,bwd \
    --impls "${FLAMIA_IMPLS:-flamia-mxfp8,fa4,cudnn-sdpa}" --name train_attention_s19_w
fi
if [[ $steps == *,d128-passes,* ]]; then  # experiment: d = 128 in the two passes too, three
  # copies of cute_sm90.py beside the current kernel: PASS_HEAD_DIMS = {128, 256}; and its dV
  # pass at 128-query steps at d = 128 (122 KB of shared memory); and its dK/dQ pass with 3
  # stages at d = 128 (202 KB)
  mkdir -p scratch/s19
  python - <<'PY' || exit 1
from pathlib import Path
src = Path("flamia_serve/kernels/attn_bwd/cute_sm90.py").read_text()
def edit(text, old, new):
    assert text.count(old) == 1, old
    return text.replace(old, new)
passes = edit(src, "PASS_HEAD_DIMS = frozenset({256})", "PASS_HEAD_DIMS = frozenset({128, 256})")
dv128 = edit(passes, 'self.step_q = STEP_DV_PASS if mode == "dv"',
             'self.step_q = (128 if head_dim == 128 else STEP_DV_PASS) if mode == "dv"')
s3 = edit(passes, "    for mode in bwd_modes(d, wide, bf16_kv, bf16_dq):\n",
          "    base_stages = num_stages\n"
          "    for mode in bwd_modes(d, wide, bf16_kv, bf16_dq):\n"
          "        num_stages = 3 if (mode == 'dkdq' and d == 128) else base_stages\n")
for name, text in (("d128passes", passes), ("d128passes_dv128", dv128), ("d128passes_s3", s3)):
    Path(f"scratch/s19/{name}.py").write_text(text)
PY
  run bwd_variants_d128_passes 420 python benchmarks/bwd_variants.py --timeout 400 \
    --shapes 8192x128,16384x128 d128passes=scratch/s19/d128passes.py \
    d128passes_dv128=scratch/s19/d128passes_dv128.py d128passes_s3=scratch/s19/d128passes_s3.py
fi
if [[ $steps == *,s19,* ]]; then  # the d = 256 backward in two passes (dK/dQ, then dV):
  # its GPU tests, the backward pass's kernels at P2, accuracy against float64
  run pytest_gpu_s19 300 python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_gpu_cute_bwd.py
  RUN_TAIL="-n 20" run profile_bwd_pass_s19 120 python benchmarks/profile_bwd_pass.py \
    --workloads P2 --pass bwd
  RUN_TAIL="-n 13" run bwd_numerics_d256_s19 150 python benchmarks/bwd_numerics.py --d 256 \
    --accuracy-only --name bwd_numerics_d256_s19
fi
if [[ $steps == *,s19-bench,* ]]; then  # P2 beside every baseline, every pass
  RUN_TAIL="-n 30" run train_attention_s19 200 python benchmarks/train_attention.py \
    --quick --check --workloads P2 --passes fwd,fwd+bwd,bwd \
    --impls flamia-mxfp8,flamia-mixed_nvfp4,fa4,cudnn-sdpa,fa2-varlen --name train_attention_s19
fi
if [[ $steps == *,grad-input,* ]]; then  # the mxfp8_grad_input recipe (DESIGN N6): its
  # kernel tests on the GPU (quantizer rows, Triton and CuTe backwards vs the twin, autograd,
  # errors), accuracy against float64 at d = 128 and 256 (the library's default backward:
  # Triton for this recipe), fwd+bwd beside mxfp8 and FA4 at W3/P2 with either backward
  run pytest_gpu_grad_input 220 python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_attn_bwd.py tests/kernels/test_gpu_cute_bwd.py -k "grad_input or autograd"
  RUN_TAIL="-n 20" run train_attention_grad_input 180 python benchmarks/train_attention.py \
    --quick --check --workloads W3,P2 --passes fwd+bwd,bwd \
    --impls flamia-mxfp8,flamia-mxfp8_grad_input,flamia-mxfp8_grad_input-cute-bwd,fa4 \
    --name train_attention_grad_input
  RUN_TAIL="-n 17" run bwd_numerics_grad_input 100 python benchmarks/bwd_numerics.py \
    --accuracy-only --name bwd_numerics_grad_input
  RUN_TAIL="-n 17" run bwd_numerics_grad_input_d256 90 python benchmarks/bwd_numerics.py \
    --d 256 --accuracy-only --name bwd_numerics_grad_input_d256
fi
if [[ $steps == *,s22-checks,* ]]; then  # the twenty-second session's CPU-only changes on
  # the GPU: signed zeros in every quantizer and cache writer (E4M3 and E2M1 codes bit for bit
  # against the twin), the numerics and cache entry points' argument checks, the paged kernels
  run pytest_gpu_s22_checks 400 python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_quant.py tests/kernels/test_common.py tests/kernels/test_paged.py \
    tests/kernels/test_gpu_paged.py tests/numerics tests/test_kvcache_api.py
fi
if [[ $steps == *,nvfp4-search,* ]]; then  # NVFP4 block scales by least squared error (three
  # candidates, Recipe.nvfp4_scale_candidates): the quantizers bit-exact against the twin on
  # the GPU, the quantization's time with one and three candidates, accuracy at d = 128
  run pytest_gpu_nvfp4_search 150 python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_quant.py tests/numerics/test_scales.py -k "nvfp4 or mixed"
  RUN_TAIL="-n 16" run tune_quant_nvfp4_search 150 python benchmarks/tune_quant.py \
    --workloads W1,W3,W7 --recipes mixed_nvfp4,mixed_nvfp4:1 --name tune_quant_nvfp4_search
  RUN_TAIL="-n 17" run bwd_numerics_nvfp4_search 100 python benchmarks/bwd_numerics.py \
    --accuracy-only --name bwd_numerics_nvfp4_search
fi
if [[ $steps == *,bwd-profile,* ]]; then  # ncu of one CuTe backward launch (T = 8192,
  # d = ${FLAMIA_PROFILE_D:-128})
  run ncu_bwd 240 ncu --set full --import-source yes -k regex:FlamiaBwd --launch-skip 1 --launch-count 1 \
    -o /tmp/ncu_bwd python benchmarks/profile_bwd.py --kernel cute --once --d "${FLAMIA_PROFILE_D:-128}"
  ncu -i /tmp/ncu_bwd.ncu-rep --page details > "$OUT/ncu_cute_bwd_details.txt" 2>&1
  run ncu_bwd_source 90 python benchmarks/ncu_source_top.py /tmp/ncu_bwd.ncu-rep
fi
if [[ $steps == *,s25,* ]]; then  # 2026-12-06: the three GPU-only failures of the adversarial
  # entry calls (huge logits, 1-token batched shapes) with their messages; the host-time
  # changes (Triton launches past CompiledKernel's runner, TVM-FFI tensors converted once for
  # the kept CuTe calls, M/lse in one allocation, no zero gradients materialised for M/lse,
  # Function.apply's C entry) under the prepared-launch tests; host time; then the rest of
  # the adversarial file and the CuTe forward suite (in order of importance)
  RUN_TAIL="-n 60" run pytest_gpu_adversarial_three 120 python -m pytest -v -rf --tb=short \
    -W ignore::DeprecationWarning -p no:cacheprovider tests/kernels/test_entry_adversarial.py \
    -k "huge_logits or batched_tiny"
  w=tests/kernels/test_workspace.py b=tests/kernels/test_attn_bwd.py
  RUN_TAIL="-n 30" run pytest_gpu_s25_host 130 python -m pytest -v -rf --tb=short \
    -W ignore::DeprecationWarning -p no:cacheprovider \
    $w::test_gpu_compiled_runner_launches_on_the_current_stream_and_calls_hooks \
    $b::test_eager_backward_gets_no_zero_gradients_for_the_statistics \
    $b::test_functorch_transforms_are_refused $w::test_gpu_prepared_launches_reused_across_steps \
    $w::test_gpu_cuda_graph_capture_of_eager_calls_with_a_plan \
    $w::test_gpu_misaligned_inputs_and_other_streams $b::test_torch_compile_fullgraph
  RUN_TAIL="-n 45" run host_time_s25 110 python benchmarks/host_time.py --breakdown --layers 8,32 \
    --impls eager,eager-batched,eager-unprepared
  RUN_TAIL="-n 40" run pytest_gpu_adversarial "${FLAMIA_TEST_SECS:-120}" python -m pytest -q -rf \
    --tb=short -W ignore::DeprecationWarning -p no:cacheprovider \
    tests/kernels/test_entry_adversarial.py tests/kernels/test_gpu_cute.py \
    -k "not huge_logits and not batched_tiny"
fi
if [[ $steps == *,bwd-items,* ]]; then  # why packs of uniform lengths lose most in the backward
  # (H100 2026-12-06: bwd W3 0.74x FA4, W5 0.60, W6 0.52, P3 0.53): the backward beside FA4
  # on T = 16k cut into 1..128 equal documents, then W3/W5/W6/P3; ncu of one W6 launch
  RUN_TAIL="-n 30" run train_attention_bwd_items 300 python benchmarks/train_attention.py \
    --quick --workloads E1,E4,E16,E64,E128,W3,W5,W6,P3 --passes bwd \
    --impls flamia-mxfp8,fa4 --name train_attention_bwd_items
  run ncu_bwd_w6 240 ncu --set full --import-source yes -k regex:FlamiaBwd --launch-skip 1 \
    --launch-count 1 -o /tmp/ncu_bwd_w6 python benchmarks/profile_bwd.py --kernel cute --once \
    --workload "${FLAMIA_PROFILE_WORKLOAD:-W6}"
  ncu -i /tmp/ncu_bwd_w6.ncu-rep --page details > "$OUT/ncu_cute_bwd_w6_details.txt" 2>&1
  run ncu_bwd_w6_source 90 python benchmarks/ncu_source_top.py /tmp/ncu_bwd_w6.ncu-rep
fi
if [[ $steps == *,s26-h200,* ]]; then  # the twenty-sixth session's H100 numbers on an H200
  # (~300 s): grad_input's 64-query backward against 32 (W3/W7, same call), host time, the W
  # table with both recipes beside FA4
  RUN_TAIL="-n 8" run train_attention_grad_input64 120 python benchmarks/train_attention.py \
    --quick --workloads W3,W7 --passes fwd+bwd,bwd --impls flamia-mxfp8,flamia-mxfp8_grad_input \
    --name train_attention_grad_input64
  cp flamia_serve/kernels/attn_bwd/cute_sm90.py /tmp/cute_sm90_s26.py
  sed -i 's/^STEP_BF16_DQ_D128 = 2 \* HALF$/STEP_BF16_DQ_D128 = HALF/' \
    flamia_serve/kernels/attn_bwd/cute_sm90.py
  grep -n "^STEP_BF16_DQ_D128 = HALF$" flamia_serve/kernels/attn_bwd/cute_sm90.py || exit 1
  RUN_TAIL="-n 8" run train_attention_grad_input32 120 python benchmarks/train_attention.py \
    --quick --workloads W3,W7 --passes fwd+bwd,bwd --impls flamia-mxfp8,flamia-mxfp8_grad_input \
    --name train_attention_grad_input32
  cp /tmp/cute_sm90_s26.py flamia_serve/kernels/attn_bwd/cute_sm90.py
  RUN_TAIL="-n 20" run host_time_s26 110 python benchmarks/host_time.py --layers 8,32 \
    --impls eager,eager-batched
  RUN_TAIL="-n 45" run train_attention_s26_w 300 python benchmarks/train_attention.py \
    --quick --workloads W1,W2,W3,W4,W5,W6,W7,W8,W9,P3,P4,P5 --passes fwd+bwd,bwd \
    --impls flamia-mxfp8,flamia-mxfp8_grad_input,fa4 --name train_attention_s26_w
fi
if [[ $steps == *,work-order,* ]]; then  # the CTAs' work-list order (work_order.py): on packs
  # of many documents the longest-first list runs CTAs of different documents at once (H200
  # 2026-12-06: W6's backward 59% DRAM busy, L2 hit 35%); by document the backward gained
  # 20-33% there (H100, this step's first form). Same bits in every order (the CPU test on
  # the GPU: one plan per order, the lists checked to differ; until 2026-12-06 this step's
  # own check reused one plan and so compared an order with itself), then forward times by
  # cost and by document, then the W table beside FA4 with both by document
  run order_check 200 python -m pytest -q -W ignore::DeprecationWarning \
    tests/kernels/test_attn_bwd.py -k work_order_does_not_change_results
  W=W1,W2,W3,W4,W5,W6,W7,W8,W9,P3,P4,P5,E16
  RUN_TAIL="-n 16" run work_order_fwd_cost 150 python benchmarks/work_order.py --fwd cost \
    -- --quick --workloads $W --passes fwd --impls flamia-mxfp8 --name work_order_fwd_cost
  RUN_TAIL="-n 45" run work_order_document 300 python benchmarks/work_order.py --fwd document \
    --bwd document -- --quick --workloads $W --passes fwd,fwd+bwd,bwd --impls flamia-mxfp8,fa4 \
    --name work_order_document
fi
if [[ $steps == *,work-rounds,* ]]; then  # by document in rounds (work_order.py --*-chunk):
  # keep the longest items of every document early (the forward by whole documents lost W4:
  # three documents, the second one's long tiles late) while CTAs running at once still
  # share documents; forward rounds of 4 / 8 items (~132 CTAs over 32 heads = 4 items at
  # once), backward rounds of 16 / 32 (~132 CTAs over 8 K/V heads). Partly run (H100
  # 2026-12-06, work_rounds_*_s27: forward 4/8 and backward 16 within noise of the defaults)
  W=W4,W5,W6,W7,E16,P3,P4
  RUN_TAIL="-n 12" run work_rounds_base 200 python benchmarks/work_order.py -- --quick \
    --workloads $W,W1 --passes fwd,bwd --impls flamia-mxfp8,fa4 --name work_rounds_base
  for c in 4 8; do
    RUN_TAIL="-n 12" run "work_rounds_fwd$c" 120 python benchmarks/work_order.py --fwd document \
      --fwd-chunk $c -- --quick --workloads $W --passes fwd --impls flamia-mxfp8 \
      --name "work_rounds_fwd$c"
  done
  for c in 16 32; do
    RUN_TAIL="-n 12" run "work_rounds_bwd$c" 150 python benchmarks/work_order.py --bwd-chunk $c \
      -- --quick --workloads $W,W1 --passes bwd --impls flamia-mxfp8 --name "work_rounds_bwd$c"
  done
  for v in "cost" "document" "document --fwd-chunk 4"; do  # the paged prefill's list
    tag=${v// --fwd-chunk /}
    # shellcheck disable=SC2086  # v holds the script's options
    RUN_TAIL="-n 12" run "work_rounds_prefill_$tag" 150 python benchmarks/work_order.py \
      --script prefill --fwd $v -- --quick --name "work_rounds_prefill_$tag"
  done
fi
if [[ $steps == *,s28,* ]]; then  # the backward step's instructions cut (sm_90a SASS of the
  # unmasked d = 128 step: 1134 -> 1019 per consumer thread): the kernel against the previous
  # one (FLAMIA_BWD_VARIANT: a copy of its cute_sm90.py) in one process, dK/dV bit for bit on
  # the GPU tests' kinds of pack and the workloads
  RUN_TAIL="-n 20" run bwd_step_ab 400 python benchmarks/bwd_variant_ab.py \
    --variant "${FLAMIA_BWD_VARIANT:?a copy of the previous cute_sm90.py}" \
    --workloads W3,W5,W6,P3,E16,W1 --name bwd_step_ab
fi
if [[ $steps == *,s28-w,* ]]; then  # the W table beside FA4 after the step's cut
  RUN_TAIL="-n 45" run bwd_step_w 300 python benchmarks/train_attention.py --quick \
    --workloads W1,W2,W3,W4,W5,W6,W7,W8,W9,P3,P4,P5 --passes fwd,bwd,fwd+bwd \
    --impls flamia-mxfp8,fa4 --name train_attention_s28
fi
if [[ $steps == *,s28-tests,* ]]; then  # the CuTe backward's GPU tests after the step's cut
  run pytest_gpu_cute_bwd_s28 "${FLAMIA_TEST_SECS:-420}" python -m pytest -q \
    -W ignore::DeprecationWarning tests/kernels/test_gpu_cute_bwd.py tests/kernels/test_gpu_bwd.py
fi
if [[ $steps == *,s29-fwd-ab,* ]]; then  # the forward's O rescale skipped where no row's
  # reference moved, against the tree before it (FLAMIA_FWD_VARIANT: a copy of its forward
  # cute_sm90.py, e.g. git show 23b424a:flamia_serve/kernels/attn_fwd/cute_sm90.py), O/M/lse
  # and the prefill's output bit for bit, then times (training forward and prefill)
  RUN_TAIL="-n 30" run fwd_ab 420 python benchmarks/fwd_variant_ab.py \
    --variant "${FLAMIA_FWD_VARIANT:?a copy of the previous forward cute_sm90.py}" \
    --workloads W1,W3,W4,W7,W9,P2,P3,P5 --name fwd_rescale_ab_s29
fi
if [[ $steps == *,w-table,* ]]; then  # the W table beside FA4, each workload's impls timed
  # twice in alternating order (--rounds 2: a short workload after a long one is slower for
  # whichever impl comes first); ~2x the time of one round, up to ~9 min
  RUN_TAIL="-n 45" run w_table 560 python benchmarks/train_attention.py --quick --rounds 2 \
    --workloads W1,W2,W3,W4,W5,W6,W7,W8,W9,P3,P4,P5 --passes fwd,bwd,fwd+bwd \
    --impls flamia-mxfp8,fa4 --name "train_attention_w_${FLAMIA_TAG:-run}"
fi
if [[ $steps == *,per-wg-dq,* ]]; then  # ready to measure (twenty-ninth session; compiled
  # for sm_90a on the CPU only: wgmma pipelined, 16 B stack, 224 KB of shared memory): the
  # d = 128 backward with dQ per warpgroup (each warpgroup's keys, all 128 columns, no CTA
  # barrier per step: the warpgroups may drift apart) against the joint dQ of the tree;
  # "speedup" > 1 means the tree (joint) is faster. mxfp8 only: the variant's grad_input
  # d = 128 and mixed d = 256 parts kernels would need 243-249 KB of shared memory
  mkdir -p /tmp/ab
  sed 's/^        self.joint_dq = self.halves >= NUM_WG$/        self.joint_dq = self.halves > NUM_WG/' \
    flamia_serve/kernels/attn_bwd/cute_sm90.py > /tmp/ab/per_wg_dq.py
  if grep -q "joint_dq = self.halves > NUM_WG" /tmp/ab/per_wg_dq.py; then
    RUN_TAIL="-n 30" run bwd_per_wg_dq 420 python benchmarks/bwd_variant_ab.py \
      --variant /tmp/ab/per_wg_dq.py --rounds 3 --workloads W1,W3,W5,W6,W7,P3 \
      --name bwd_per_wg_dq_ab
  else
    echo "per-wg-dq: the joint_dq line of attn_bwd/cute_sm90.py moved; update the sed"
  fi
fi
if [[ $steps == *,s30-windows-q,* ]]; then  # packs with windows (P4): the CuTe forward
  # quantizes the Q of the documents it runs and the launch only the windows' (q_short);
  # its tests, then against the launch quantizing all of Q (flamia-mxfp8-separate-q) and FA4
  run pytest_gpu_windows_q_s30 "${FLAMIA_TEST_SECS:-300}" python -m pytest -q \
    -W ignore::DeprecationWarning tests/kernels/test_attn_fwd.py tests/kernels/test_quant.py \
    tests/kernels/test_entry_adversarial.py -k "windows or deferred or defer_q or default_config"
  RUN_TAIL="-n 12" run profile_windows_s30 150 python benchmarks/profile_windows.py P4
  RUN_TAIL="-n 30" run windows_q_ab 400 python benchmarks/train_attention.py --quick \
    --rounds 3 --workloads P4,W7 --passes fwd,fwd+bwd \
    --impls flamia-mxfp8,flamia-mxfp8-separate-q,fa4 --name train_attention_windows_q_s30
fi
if [[ $steps == *,s30-windows-kernel,* ]]; then  # the window kernel by (window, K/V head),
  # K̂/V̂ loaded once per query-head group: its tests, then against the kernel before it
  # (FLAMIA_WINDOWS_VARIANT: a copy of that attn_fwd/triton.py) and at 4 / 8 warps
  run pytest_gpu_windows_kernel_s30 "${FLAMIA_TEST_SECS:-300}" python -m pytest -q \
    -W ignore::DeprecationWarning tests/kernels/test_attn_fwd.py \
    tests/kernels/test_entry_adversarial.py -k "windows or deferred"
  RUN_TAIL="-n 12" run windows_ab 300 python benchmarks/windows_ab.py \
    --variant "${FLAMIA_WINDOWS_VARIANT:?a copy of the previous attn_fwd/triton.py}" \
    --warps 4,8 --workloads P4,P1 --name windows_kernel_ab_s30
  RUN_TAIL="-n 12" run profile_windows_s30b 150 python benchmarks/profile_windows.py P4 P1
  RUN_TAIL="-n 16" run windows_fwd_s30b 300 python benchmarks/train_attention.py --quick \
    --rounds 3 --workloads P4,P1 --passes fwd,fwd+bwd \
    --impls flamia-mxfp8,flamia-mxfp8-separate-q,fa4 --name train_attention_windows_s30b
fi
if [[ $steps == *,fwd-item-profile,* ]]; then  # prepared (thirty-first session): where a
  # forward item's time goes on documents of ~10 key tiles (P3, MHA; W5 for GQA): ncu with
  # stall sampling of one CuTe forward launch each, then its source summary (per-opcode stalls,
  # hottest SASS lines: the item boundary's Q quantization, KV gate, epilogue vs the key loop)
  for w in ${FLAMIA_PROFILE_WORKLOADS:-P3 W5}; do
    run "ncu_fwd_$w" 240 ncu --set full --import-source yes -k regex:FlamiaFwdSm90 \
      --launch-skip 1 --launch-count 1 -o "/tmp/ncu_fwd_$w" python benchmarks/profile_fwd.py "$w"
    ncu -i "/tmp/ncu_fwd_$w.ncu-rep" --page details > "$OUT/ncu_fwd_${w}_details.txt" 2>&1
    RUN_TAIL="-n 90" run "ncu_fwd_${w}_source" 120 python benchmarks/ncu_source_top.py \
      "/tmp/ncu_fwd_$w.ncu-rep" --top 80
  done
fi
if [[ $steps == *,s32-d64-tests,* ]]; then  # the backward at d = 64 with the quantizers'
  # two warps (the s31 default): the Triton backward's large packs (no CuTe needed)
  run pytest_gpu_bwd_d64 240 python -m pytest -q -m gpu tests/kernels/test_gpu_bwd.py -k "64"
fi
if [[ $steps == *,s32-d64,* ]]; then  # the same end to end: the CuTe backward's GPU tests at
  # d = 64, then P1 (d = 64) beside FA4 with the quantizers at 4 warps and at the default (2)
  # (FLAMIA_TESTS=0: the times only)
  if [[ ${FLAMIA_TESTS:-1} != 0 ]]; then
    run pytest_gpu_cute_bwd_d64 240 python -m pytest -q -m gpu \
      tests/kernels/test_gpu_cute_bwd.py -k "64"
  fi
  for w in 4 default; do
    FLAMIA_QUANT_WARPS=$w RUN_TAIL="-n 12" run "p1_quant_warps_$w" 200 python -c "
import os, sys
from flamia_serve.kernels.quant import ops
w = os.environ['FLAMIA_QUANT_WARPS']
if w != 'default':  # every quantizer launch of the run at that many warps
    ops.default_warps = lambda head_dim, nvfp4=False: int(w)
from benchmarks.train_attention import main
sys.exit(main(['--quick', '--rounds', '2', '--workloads', 'P1', '--passes', 'fwd,bwd,fwd+bwd',
               '--impls', 'flamia-mxfp8,fa4', '--name', f'train_attention_p1_quant_warps_{w}']))"
  done
fi
if [[ $steps == *,s32-regs-ab,* ]]; then  # the forward's consumers at 216 registers and its
  # producer warpgroup at 72 (room for producer warps that quantize K/V: NOTES, thirty-second
  # session) against today's 240 / 24: same bits, then times (training forward and prefill)
  variant=/tmp/cute_sm90_regs216.py
  sed 's/2: (240, 24), 3: (160, 32)}/2: (216, 72), 3: (160, 32)}/' \
    flamia_serve/kernels/attn_fwd/cute_sm90.py > "$variant"
  if cmp -s "$variant" flamia_serve/kernels/attn_fwd/cute_sm90.py; then
    echo "s32-regs-ab: the register split was not found in cute_sm90.py"
  else
    RUN_TAIL="-n 30" run fwd_regs_ab 400 python benchmarks/fwd_variant_ab.py --variant "$variant" \
      --workloads "${FLAMIA_AB_WORKLOADS:-W1,W3,W7,P3}" --prefill S4-8x512+8192 --rounds 3 \
      --name fwd_regs216_ab_s32
  fi
fi
if [[ $steps == *,s29-fwd-tests,* ]]; then  # the CuTe forward's and prefill's GPU tests
  run pytest_gpu_cute_fwd_s29 "${FLAMIA_TEST_SECS:-300}" python -m pytest -q \
    -W ignore::DeprecationWarning tests/kernels/test_gpu_cute.py \
    tests/kernels/test_gpu_cute_prefill.py
fi
pack_out
