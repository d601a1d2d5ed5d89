export FLAMIA_SITE=/tmp/site_fa4
bash .stage/fa4/part2/install.sh; echo "part2 rc $?"
export PYTHONPATH=/tmp/site_fa4:$PWD PYTHONUNBUFFERED=1 FLAMIA_RESULTS_DIR=$OUT
source benchmarks/device_run.sh
nvidia-smi --query-gpu=name,clocks.sm --format=csv
RUN_TAIL="-n 70" run packs 480 python benchmarks/train_attention.py --quick --workloads P1,P2,P3,P4,P5 --impls flamia-mxfp8,flamia-mxfp8-quant,fa4,fa2-varlen,cudnn-sdpa --name train_attention_packs
