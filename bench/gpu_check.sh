#!/usr/bin/env bash
# GPU check, shared by the kernels and benchmark issues: on a CUDA machine with torch and triton
# preinstalled (no network), run the kernel tests on CUDA, then the benchmark, all in under
# 5 minutes, printing the benchmark table last.
#
#   bash bench/gpu_check.sh            from anywhere; results go to $OUT if set, else bench/results/
#
# Env: PYTHON (default python3), TOTAL_S (default 290: the whole script's wall-clock budget),
# BENCH_ARGS (extra arguments for bench/run.py).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=${PYTHON:-python3}
out=${OUT:-bench/results}
total_s=${TOTAL_S:-290}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu_check.log"
: > "$log"
remaining() { echo $(( total_s - SECONDS )); }

{
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('triton', triton.__version__)"
} 2>&1 | tee -a "$log"

if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "CUDA is not available: nothing to check here" | tee -a "$log"
  exit 2
fi

# Install this checkout (kernels/ becomes flowrl.kernels, setup.cfg package_dir) into a throwaway
# folder put on PYTHONPATH: --no-deps keeps the machine's torch and triton and installs nothing
# else; --no-build-isolation --no-index build with its setuptools, without network. It builds from a
# copy of the sources, so no build/ or egg-info is left in the checkout.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src"
cp -r setup.cfg pyproject.toml README.md flowrl kernels "$tmp/src/"
echo "== install flowrl into $tmp/site" | tee -a "$log"
if ! PIP_ROOT_USER_ACTION=ignore "$py" -m pip install -q --no-deps --no-build-isolation --no-index --disable-pip-version-check \
    --target "$tmp/site" "$tmp/src" 2>&1 | tee -a "$log"; then
  echo "pip could not install the checkout (needs pip and setuptools>=64 in $py): nothing checked" | tee -a "$log"
  exit 3
fi
export PYTHONPATH="$tmp/site${PYTHONPATH:+:$PYTHONPATH}"

tests_rc=0
echo "== kernel tests on CUDA (tests/test_gpu.py, test_kernels.py, test_philox.py)" | tee -a "$log"
if [ ! -f tests/test_kernels.py ]; then
  echo "tests/test_kernels.py not found: skipped" | tee -a "$log"
elif ! "$py" -c "import pytest" 2>/dev/null; then
  echo "pytest is not installed: kernel tests skipped" | tee -a "$log"
  tests_rc=3
else
  # at most 40% of the budget: the benchmark needs the rest. GPU-only checks first (graph capture,
  # int64 offsets), then the kernel matrix and the in-kernel noise on CUDA. Run from the install
  # folder: `python -m pytest` puts the current folder first on sys.path, and the checkout's flowrl/
  # has no kernels/ in it.
  gpu_tests=()
  for f in test_gpu.py test_kernels.py test_philox.py; do [ -f "tests/$f" ] && gpu_tests+=("$repo/tests/$f"); done
  (cd "$tmp/site" && timeout $(( total_s * 2 / 5 )) "$py" -m pytest "${gpu_tests[@]}" -q -p no:cacheprovider) 2>&1 | tee -a "$log"
  tests_rc=${PIPESTATUS[0]}
  echo "kernel tests exit code: $tests_rc (124 = timed out)" | tee -a "$log"
fi

# The benchmark: the issue's shapes, the most telling first, so the time budget cuts the tail.
# --time-budget stops starting new configurations; timeout is the hard stop, with a margin.
budget=$(( $(remaining) - 60 ))
if [ "$budget" -lt 30 ]; then budget=30; fi
echo "== benchmark (configurations started within ${budget} s)" | tee -a "$log"
timeout $(( $(remaining) > 40 ? $(remaining) - 5 : 40 )) "$py" bench/run.py --device cuda \
  --shapes 32x4096x64,4x16x21x60x104,8x16x128x128,1x4096x64,32x16x128x128,8x4096x64,1x16x128x128,1x16x21x60x104 \
  --time-budget "$budget" --out "$out" ${BENCH_ARGS:-} 2> >(tee -a "$log" >&2) | tee -a "$log"
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: kernel tests rc=$tests_rc, benchmark rc=$bench_rc, ${SECONDS} s" >&2
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
