#!/usr/bin/env bash
# The GPU check (issue "The H200 numbers"): on a CUDA machine with torch and triton preinstalled (no
# network), in one call of about 8 minutes: every test on CUDA, the GPU-only ones first, and the
# benchmark sweeps, the issue's targets first. Each phase gets a share of the time left and is cut
# at it; the benchmark writes its rows after every configuration, so a cut phase keeps what it measured.
#
#   bash bench/gpu_check.sh            from anywhere; results go to $OUT if set, else bench/results/
#
# Phases: 1. the GPU-only tests and the kernel matrix (CUDA graphs, offsets past 2^31 elements, the
# grid limit, Philox, the kernels against the references, sequence parallelism in one process, the
# losses under sequence parallelism on NCCL: one rank per GPU, world 1 on a one-GPU machine);
# 2. the step benchmark at the issue's target shapes (bf16, sde and cps, every implementation);
# 3. the step benchmark at the other sizes of 1M elements or more, then the small ones; 4. every
# other test on CUDA (diffusers is not on the GPU image: its tests skip); 5. the step benchmark of
# the other modes (bf16) and of fp32 (sde, cps), and the losses suite. Out: gpu_check.log (everything printed, each
# benchmark table included) and gpu_check_results.tar (each benchmark's CSV and .md, the tests'
# JUnit XML): two files, well inside what a lease brings back.
#
# Env: PYTHON (default python3), TOTAL_S (default 480: the whole script's wall-clock budget),
# BENCH_ARGS (extra arguments for every bench/run.py call), DRY_RUN=1 (no CUDA needed: every phase
# on the CPU with tiny shapes and a few test files, to check this script itself; tests/repo/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=${PYTHON:-python3}
out=${OUT:-bench/results}
total_s=${TOTAL_S:-480}
dry=${DRY_RUN:-0}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu_check.log"
: > "$log"
remaining() { echo $(( total_s - SECONDS )); }
# share PERCENT: that share of the time left, at least 20 s
share() { local s=$(( $(remaining) * $1 / 100 )); echo $(( s < 20 ? 20 : s )); }
say() { echo "$*" | tee -a "$log"; }

{
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('triton', triton.__version__)"
} 2>&1 | tee -a "$log"

if [ "$dry" = 1 ]; then
  device=cpu
  # all skip without CUDA: the phase's plumbing only
  first_tests=(tests/kernels/test_gpu.py tests/losses/test_losses_distributed.py::test_losses_under_sequence_parallelism_on_nccl)
  rest_tests=(tests/ops/test_validation.py)
  target_shapes=1x64x32,1x2x3x8x8
  sweep_shapes=2x64x32
  dry_bench=(--impls flowrl-torch,eager --no-compile --timing-budget 0.02 --threads 1)
elif ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say "CUDA is not available: nothing to check here (DRY_RUN=1 checks this script on the CPU)"
  exit 2
else
  device=cuda
  # The issue's list: CUDA graphs, int64 offsets, grid limits (test_gpu), the kernels against the
  # references (test_kernels), in-kernel noise (test_philox), host reads (test_capturable), sequence
  # parallelism in one process (test_distributed, test_per_token_distributed), torch.compile of a
  # training step through the custom ops on CUDA (test_torch_compile), the losses under sequence
  # parallelism (test_losses_distributed: its NCCL variant, one rank per GPU, runs only here).
  first_tests=()
  for f in test_gpu.py test_kernels.py test_philox.py test_capturable.py test_torch_compile.py test_distributed.py test_per_token_distributed.py test_losses_distributed.py; do
    path=$(find tests -name "$f" -print -quit)  # tests/<layer>/$f
    [ -n "$path" ] && first_tests+=("$path")
  done
  rest_tests=(tests)
  target_shapes=32x4096x64,4x16x21x60x104
  # the other sizes of 1M elements or more, B = 1 last (its own torch.compile graphs), then the small ones
  sweep_shapes=8x4096x64,8x16x128x128,32x16x128x128,1x16x21x60x104,1x4096x64,1x16x128x128
  dry_bench=()
fi

# Install this checkout (kernels/ becomes flowrl.kernels, setup.cfg package_dir) into a throwaway
# folder put on PYTHONPATH: --no-deps keeps the machine's torch and triton and installs nothing
# else; --no-build-isolation --no-index build with its setuptools, without network. It builds from a
# copy of the sources, so no build/ or egg-info is left in the checkout.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src" "$tmp/parts"
parts=$tmp/parts
cp -r setup.cfg setup.py pyproject.toml README.md flowrl kernels "$tmp/src/"
say "== install flowrl into $tmp/site"
if ! PIP_ROOT_USER_ACTION=ignore "$py" -m pip install -q --no-deps --no-build-isolation --no-index --disable-pip-version-check \
    --target "$tmp/site" "$tmp/src" 2>&1 | tee -a "$log"; then
  say "pip could not install the checkout (needs pip and setuptools>=64 in $py): nothing checked"
  exit 3
fi
export PYTHONPATH="$tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# pytest-xdist spreads the tests (and their Triton compiles) over the machine's cores when it is there
xdist=()
if [ "$dry" != 1 ] && "$py" -c "import xdist" 2>/dev/null; then
  n=$(( $(nproc) > 2 ? $(nproc) - 2 : 1 )); [ "$n" -gt 12 ] && n=12
  xdist=(-n "$n")
fi

# run_tests NAME PERCENT FILES...: pytest from the install folder (`python -m pytest` puts the current
# folder first on sys.path, and the checkout's flowrl/ has no kernels/ in it), cut at its share.
declare -A rc
run_tests() {
  local name=$1 pct=$2; shift 2
  local limit; limit=$(share "$pct")
  local ignore=()
  if [ "$name" = tests_rest ]; then  # what phase 1 ran, and the ahead-of-time compile (a CPU check)
    ignore=(--ignore="$repo/tests/test_compile.py")
    for f in "${first_tests[@]}"; do ignore+=(--ignore="$repo/$f"); done
  fi
  local files=()
  for f in "$@"; do files+=("$repo/$f"); done
  say "== $name on $device (cut at ${limit} s): ${*}"
  if ! "$py" -c "import pytest" 2>/dev/null; then
    say "pytest is not installed: $name skipped"; rc[$name]=3; return
  fi
  (cd "$tmp/site" && timeout "$limit" "$py" -m pytest "${files[@]}" "${ignore[@]}" "${xdist[@]}" -q -rfE \
      -p no:cacheprovider --junitxml="$parts/$name.xml") 2>&1 | tee -a "$log"
  rc[$name]=${PIPESTATUS[0]}
  say "$name exit code: ${rc[$name]} (124 = cut at its share of the time)"
}

# run_bench NAME PERCENT ARGS...: bench/run.py, soft budget 30 s under its share (no new
# configuration is started after it), hard cut at the share.
run_bench() {
  local name=$1 pct=$2; shift 2
  local limit; limit=$(share "$pct")
  local soft=$(( limit > 60 ? limit - 30 : limit / 2 ))
  say "== benchmark $name on $device (new configurations until ${soft} s, cut at ${limit} s)"
  timeout "$limit" "$py" bench/run.py --device "$device" --time-budget "$soft" --out "$parts" --tag "$name" \
    "$@" "${dry_bench[@]}" ${BENCH_ARGS:-} 2>&1 | tee -a "$log"
  rc[$name]=${PIPESTATUS[0]}
  say "benchmark $name exit code: ${rc[$name]} (124 = cut; its CSV holds the rows measured before)"
}

run_tests tests_gpu 20 "${first_tests[@]}"
run_bench targets 35 --shapes "$target_shapes" --dtypes bf16 --modes sde,cps
run_bench sweep 35 --shapes "$sweep_shapes" --dtypes bf16 --modes sde,cps
run_tests tests_rest 50 "${rest_tests[@]}"
run_bench modes 40 --shapes "$target_shapes" --dtypes bf16 --modes ddim,flash_sde,dpm_sde --no-compile
run_bench fp32 50 --shapes "$target_shapes" --dtypes fp32 --modes sde,cps --no-compile
run_bench losses 90 --suite losses --shapes "$target_shapes" --dtypes bf16

tar -C "$parts" -cf "$out/gpu_check_results.tar" . 2>&1 | tee -a "$log"
status=0
summary="gpu_check on $device in ${SECONDS} s:"
for k in tests_gpu targets sweep tests_rest modes fp32 losses; do
  summary+=" $k=${rc[$k]:-not run}"
  [ "${rc[$k]:-1}" = 0 ] || status=1
done
say "$summary; results: $out/gpu_check_results.tar"
exit $status
