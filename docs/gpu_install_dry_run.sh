#!/usr/bin/env bash
# Resolve the README's GPU install command for a Linux x86_64 GPU machine (CPython 3.12)
# with each supported CUDA build of torch, without installing anything: pip resolves for
# that platform from the package index and reports what it would install.
# Usage: bash docs/gpu_install_dry_run.sh [TORCH_VERSION ...]   (default: 2.11.0 2.13.0)
#        EXTRAS=vllm,train,test bash docs/gpu_install_dry_run.sh 2.11.0
# Writes one pip report per version to $OUT (default: a temporary folder) and prints the
# versions of torch, triton and the CUDA runtime each would install.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.11.0 2.13.0)
extras="${EXTRAS:-test}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
# the project as a wheel: a dry run for another platform takes binary distributions only
python -m pip wheel -q --no-deps -w "$out/dist" .
wheel="$(ls "$out"/dist/flamia_serve-*.whl)"
# manylinux tags of glibc 2.39 down to 2.17: what pip accepts on a glibc 2.39 machine
# (Ubuntu 24.04, CPython 3.12, as on our H200 machine)
platforms=()
for minor in $(seq 39 -1 17); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform linux_x86_64)
for v in "${versions[@]}"; do
    # --isolated: this machine's pip configuration (local wheel folders, caps) stays out
    PIP_CONFIG_FILE=/dev/null python -m pip install --isolated --dry-run --ignore-installed \
        --quiet --report "$out/report-torch$v.json" "${platforms[@]}" --python-version 3.12 \
        --only-binary=:all: "torch==$v" "$wheel[$extras]"
    python - "$out/report-torch$v.json" <<'PY'
import json
import sys

report = json.load(open(sys.argv[1]))
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
keys = ("flamia-serve", "torch", "triton", "nvidia-cuda-runtime", "vllm", "transformers")
print(f"resolved ({len(got)} packages):", ", ".join(f"{k} {got.get(k, '-')}" for k in keys))
PY
done
echo "reports in $out"
