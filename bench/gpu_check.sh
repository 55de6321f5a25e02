#!/usr/bin/env bash
# GPU check, shared by the kernels and benchmark issues: on a CUDA machine with torch and triton
# preinstalled (no network, nothing installed), run the kernel tests on CUDA, then the benchmark,
# all in under 5 minutes, printing the benchmark table last.
#
#   bash bench/gpu_check.sh            from anywhere; results go to $OUT if set, else bench/results/
#
# Env: PYTHON (default python3), TOTAL_S (default 290: the whole script's wall-clock budget),
# BENCH_ARGS (extra arguments for bench/run.py).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-bench/results}
total_s=${TOTAL_S:-290}
mkdir -p "$out"
log="$out/gpu_check.log"
: > "$log"

# flowrl installs `kernels/` as `flowrl.kernels` (setup.cfg package_dir). Without installing, map that
# one module name to the checkout's kernels/ with a meta-path finder, then run the real entry point.
bootstrap='
import importlib.machinery, importlib.util, os, runpy, sys
repo = os.getcwd()
sys.path.insert(0, repo)
class _KernelsFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "flowrl.kernels":
            return None
        pkg = os.path.join(repo, "kernels")
        return importlib.util.spec_from_file_location(
            name, os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
sys.meta_path.insert(0, _KernelsFinder)
kind, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = [target] + args
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
'
pyrun() { "$py" -c "$bootstrap" "$@"; }
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

tests_rc=0
echo "== kernel tests on CUDA (tests/test_gpu.py, test_kernels.py, test_philox.py)" | tee -a "$log"
if [ ! -f tests/test_kernels.py ]; then
  echo "tests/test_kernels.py not found: skipped" | tee -a "$log"
elif ! "$py" -c "import pytest" 2>/dev/null; then
  echo "pytest is not installed: kernel tests skipped" | tee -a "$log"
  tests_rc=3
else
  # at most 40% of the budget: the benchmark needs the rest. GPU-only checks first (graph capture,
  # int64 offsets), then the kernel matrix and the in-kernel noise on CUDA.
  gpu_tests=$(ls tests/test_gpu.py tests/test_kernels.py tests/test_philox.py 2>/dev/null)
  timeout $(( total_s * 2 / 5 )) "$py" -c "$bootstrap" module pytest $gpu_tests -q -p no:cacheprovider 2>&1 | tee -a "$log"
  tests_rc=${PIPESTATUS[0]}
  echo "kernel tests exit code: $tests_rc (124 = timed out)" | tee -a "$log"
fi

# The benchmark: the issue's shapes, the most telling first, so the time budget cuts the tail.
# --time-budget stops starting new configurations; timeout is the hard stop, with a margin.
budget=$(( $(remaining) - 60 ))
if [ "$budget" -lt 30 ]; then budget=30; fi
echo "== benchmark (configurations started within ${budget} s)" | tee -a "$log"
timeout $(( $(remaining) > 40 ? $(remaining) - 5 : 40 )) "$py" -c "$bootstrap" path bench/run.py --device cuda \
  --shapes 32x4096x64,4x16x21x60x104,8x16x128x128,1x4096x64,32x16x128x128,8x4096x64,1x16x128x128,1x16x21x60x104 \
  --time-budget "$budget" --out "$out" ${BENCH_ARGS:-} 2> >(tee -a "$log" >&2) | tee -a "$log"
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: kernel tests rc=$tests_rc, benchmark rc=$bench_rc, ${SECONDS} s" >&2
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
