#!/usr/bin/env bash
# Device calls on the 2-GPU H200 kind (nvidia-h200-x2) for issues 13 (RL) and 17 (two GPUs);
# results under $OUT. One step per call, in this order on one warm machine:
#   dist  (carry .stage/vllm/part1): installs vLLM part 1; DDP/FSDP2 vs one GPU (torchrun,
#         both GPUs) while GPU 0 also runs the kernel tests
#   rl    (carry .stage/vllm/part2): installs vLLM part 2; the three RL setups at once
#         (flamia-fp8 on GPU 0, flamia-nvfp4 and bf16-fa-fp8 on GPU 1), merged + plotted
#   tp    (vLLM already installed): vLLM TP=1 vs TP=2 per cache dtype, then the RL GPU tests
#   rl-tis (vLLM installed): the NVFP4-cache and FP8-cache setups with truncated importance
#         sampling (--tis-cap 2), merged with benchmarks/results/rl.json into $OUT/rl.json
#   tp-trained (vLLM installed): a digit-reversal model trained by flamia rl, served at TP=1
#         and TP=2 per cache dtype: greedy answers compared (a random model's are not stable)
#   bash benchmarks/run_multi_gpu.sh dist
set -uo pipefail
step=${1:?step: dist, rl, tp, rl-tis or tp-trained}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLAMIA_RESULTS_DIR=$OUT
export HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee "$OUT/gpu_$step.txt"
RUN_TAIL="-c 3000"
source "$(dirname "$0")/device_run.sh"
case $step in
dist)
  bash .stage/vllm/part1/install.sh > "$OUT/install1.log" 2>&1; echo "install part1: $?"
  run pytest_kernels 500 env CUDA_VISIBLE_DEVICES=0 python -m pytest -q \
    tests/kernels/test_common.py tests/kernels/test_quant.py tests/kernels/test_attn_fwd.py \
    tests/kernels/test_attn_bwd.py tests/kernels/test_gpu_bwd.py tests/kernels/test_gpu.py \
    tests/kernels/test_paged.py tests/kernels/test_gpu_paged.py tests/test_nonfinite.py &
  run distributed 520 torchrun --standalone --nproc-per-node 2 -m flamia_serve.train.distributed \
    --mode ddp fsdp2 --model-size small --data stdlib --steps 150 --json "$OUT/distributed.json"
  wait
  ;;
rl)
  bash .stage/vllm/part2/install.sh > "$OUT/install2.log" 2>&1; echo "install part2: $?"
  python -c "import vllm; print('vllm', vllm.__version__)" || exit 1
  rl_run() {  # rl_run GPU SETUP
    run "rl_$2" 480 env CUDA_VISIBLE_DEVICES="$1" python -m flamia_serve.train.rl --setup "$2" \
      --time-limit "${RL_SECONDS:-240}" --json "$OUT/rl_$2.json"
  }
  rl_run 0 flamia-fp8 &
  rl_run 1 flamia-nvfp4 &
  sleep 15; rl_run 1 bf16-fa-fp8 &
  wait
  ls "$OUT"/rl_*.json && python -m flamia_serve.train.rl --merge "$OUT"/rl_*.json \
    --json "$OUT/rl.json" && python benchmarks/plot_rl.py "$OUT/rl.json" --out "$OUT/rl.png"
  ;;
tp)
  run vllm_tp 480 python benchmarks/vllm_tp.py --budget-s 440 --per-engine-s 120 \
    --configs flash_attn-auto,flamia-auto,flamia-fp8_per_token_head,flamia-nvfp4
  run pytest_rl 100 env CUDA_VISIBLE_DEVICES=0 python -m pytest -q -m gpu tests/train/test_rl.py
  ;;
rl-tis)
  run rl_tis_nvfp4 480 env CUDA_VISIBLE_DEVICES=0 python -m flamia_serve.train.rl \
    --setup flamia-nvfp4 --tis-cap 2 --time-limit 300 --no-progress --json "$OUT/rl_tis_b.json" &
  run rl_tis_fp8 480 env CUDA_VISIBLE_DEVICES=1 python -m flamia_serve.train.rl \
    --setup flamia-fp8 --tis-cap 2 --time-limit 300 --no-progress --json "$OUT/rl_tis_a.json" &
  wait
  python -m flamia_serve.train.rl --merge benchmarks/results/rl.json "$OUT"/rl_tis_*.json \
    --json "$OUT/rl.json" && python benchmarks/plot_rl.py "$OUT/rl.json" --out "$OUT/rl.png"
  ;;
tp-trained)
  run rl_model 300 env CUDA_VISIBLE_DEVICES=0 python -m flamia_serve.train.rl --setup flamia-fp8 \
    --steps 60 --model-dir /tmp/rl_model --no-progress --json "$OUT/rl_model.json"
  run vllm_tp_trained 420 python benchmarks/vllm_tp.py --model /tmp/rl_model/flamia-fp8 \
    --prompts digits --name vllm_tp_trained --budget-s 400 --per-engine-s 90 \
    --configs flash_attn-auto,flamia-auto,flamia-fp8_per_token_head,flamia-nvfp4
  ;;
*) echo "unknown step $step"; exit 2 ;;
esac
pack_out
