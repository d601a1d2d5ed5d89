#!/usr/bin/env bash
# A Python 3.12 venv that compiles the CuTe DSL kernels for sm_90a on a CPU machine (fake
# tensors, no GPU): DSL errors, registers, spills and SASS before device time is spent.
#
#   ../shared/device/stage.sh fa4        # once: caches the CuTe DSL / FA4 wheels (cp312)
#   bash benchmarks/cute_venv.sh [DIR]   # builds DIR (default /tmp/cute312), then e.g.
#   FLASH_ATTENTION_ARCH=sm_90 CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD \
#       /tmp/cute312/bin/python benchmarks/compile_cute_bwd_sm90.py --keep /tmp/cubins
#
# The torch in this venv may be a CUDA build (no CPU wheel for 3.12 here): keep the venv out
# of the project.
set -euo pipefail
dir=${1:-/tmp/cute312}
wheels=${FLAMIA_STAGE_CACHE:-$HOME/.cache/flamia-stage}/fa4
py=${PYTHON312:-}
if [ -z "$py" ]; then
    for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if "$c" -c "" 2>/dev/null; then py=$(command -v "$c"); break; fi
    done
fi
[ -n "$py" ] || { echo "cute_venv.sh: no python3.12 (set PYTHON312)" >&2; exit 2; }
ls "$wheels"/*.whl >/dev/null 2>&1 || {
    echo "cute_venv.sh: no wheels in $wheels (run ../shared/device/stage.sh fa4 first)" >&2
    exit 2
}
"$py" -m venv "$dir"
"$dir/bin/pip" install -q --no-deps "$wheels"/*.whl
"$dir/bin/pip" install -q "cuda-bindings>=13,<14" protobuf einops "numpy<2.3" torch==2.13.0
"$dir/bin/python" -c "import cutlass, flash_attn.cute, quack; print('cute venv ready:', '$dir')"
