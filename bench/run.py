#!/usr/bin/env python3
"""Benchmark flowrl's step operations against the Flow-GRPO-style eager baseline (bench/baseline.py).

    python bench/run.py            full sweep (the issue's sizes; meant for a GPU)
    python bench/run.py --quick    reduced sweep that ends in a few minutes on a small CPU

Operations: ``rollout`` (``sde_step`` with given float32 noise, no mean returned), ``recompute_fwd``
(``step_log_prob`` under no_grad), ``recompute_fwd_bwd`` and ``kl_fwd_bwd`` (``step_log_prob`` /
``step_kl`` plus ``torch.autograd.grad`` with respect to ``model_output``). Modes ``sde`` (Gaussian
log-prob) and ``cps`` (``sq_err`` log-prob), as Flow-GRPO computes them.

Conditioned video steps (``--ops rollout_cond,recompute_fwd_cond,recompute_fwd_bwd_cond``, 5-D
[B, C, F, H, W] shapes only, in the full sweep for its video shapes; not for ddim and dpm_sde, which
refuse per-token sigmas, so their rows skip these ops): the op with a per-frame schedule
(``token_sigmas`` [B, 1, F, 1, 1]; frame 0 at sigma 0, the others at the step's sigma) and frame 0
frozen (``frozen`` [1, 1, F, 1, 1]), as an image-to-video rollout steps (Wan 2.2 TI2V). The kernels
take the per-token path (per-element coefficients from the compact per-frame table, the mask) for
every element. The baseline computes the same values the way trainers do it today: the peers'
formula on the frames after the conditioning one, sliced off by hand (Flow-Factory); outputs are
compared on those frames (the gradient on every frame: frame 0's is 0).

Implementations: ``flowrl-triton`` (CUDA only; what ``backend="auto"`` runs on CUDA), ``flowrl-torch``
(the reference; what ``"auto"`` runs on CPU), ``eager`` (the baseline) and ``compile`` (``torch.compile``
of the baseline, given [B, N] views with ``dynamic=True`` so the sweep compiles one graph per op, mode,
dtype and B == 1 / B > 1 rather than one per shape; elementwise work and bytes are the same).

Every implementation's outputs are checked against the eager baseline (loose tolerance) before it is
timed. Time: median after warm-up (GPU: ``triton.testing.do_bench``; CPU: wall clock). GB/s counts
the minimal bytes (each input read once, each output written once, see ``min_bytes``), also shown as
a percentage of a large device-to-device copy measured in the same run; for ``flowrl-triton`` also
over the bytes its kernels move by their launch design (``kernel_bytes``, "model" columns), which
says how close they run to the bandwidth limit. Both byte counts are shown per element. Peak memory of
``recompute_fwd_bwd`` is what the op allocates beyond its inputs (GPU: ``max_memory_allocated``;
CPU: the allocator's running total as recorded by ``torch.profiler`` with ``profile_memory=True``).
Results: a markdown table on stdout and a CSV (plus the table as .md) under bench/local/ (ignored by git;
--out bench/results for the recorded ones);
``--table-from CSV`` prints an earlier CSV's table with the byte columns recomputed from its times.

The code, by topic, beside this file (this module is the command line and the step sweep, and re-exports the
others' names: the tests, bench/gpu_check.sh and the docs use them as run.X): cases.py (the ops, shapes and
constants, ``make_case``), impls.py (each implementation of a step op, ``build``), measure.py (the check
against the eager baseline, timing, copy bandwidth, peak memory), roofline.py (the byte counts and the static
roofline bound), table.py (``Row``, the markdown table, the CSV), loss_suite.py (``--suite losses``).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baseline  # noqa: E402,F401  (bench/baseline.py, next to this file)
# the modules beside this file; every name is importable from here as before the split (run.X)
from cases import (  # noqa: E402,F401
    CHECK_RTOL, COND_OPS, COND_SUFFIX, COPY_BYTES, DTYPES, FLOWRL_BACKEND, FULL_SHAPES, IMPLS, LOSS_OPS,
    MODELLED_IMPLS, MODES, NOISE_LEVEL, NOISE_SOURCES, NUM_STEPS, OPS, PEAK_OP, QUICK_DTYPES, QUICK_IMPLS,
    QUICK_MODES, QUICK_SHAPES, SHIFT, STEP_INDEX, TREE_OPS, Case, base_op, make_case, make_sigmas, noise_level,
)
from impls import (  # noqa: E402,F401
    _COMPILED, _baseline_fn, _baseline_kl, _baseline_log_prob, _baseline_rollout, _check_cond, _compiled,
    _flowrl_cond_fn, _flowrl_fn, _set_recompile_limit, build,
)
from loss_suite import (  # noqa: E402,F401
    AUDIO_SHIFT, DGPO_BETA, DPO_BETA, GUIDANCE_SCALE, JOINT_WEIGHTS, LOSS_CLIP, LOSS_IMPLS, LOSS_KL_COEF,
    LOSS_SEED, NFT_ADV_MAX, NFT_BETA, PAIR_OPS, LossCase, _eager_issue24_loss, _eager_loss, _flowrl_loss,
    _grpo_surrogate, build_loss, make_loss_case, run_loss_sweep,
)
from measure import (  # noqa: E402,F401
    _cpu_peak_bytes, _loadavg, _sync, check, copy_gbps, machine_name, peak_extra_bytes, time_all, time_ms,
    time_rows, triton_version,
)
from roofline import (  # noqa: E402,F401
    DOCS_KERNELS, LOSS_BACKWARD_INPUTS, LOSS_INPUTS, LOSS_SUMS, _check_variant, _op_kernels, kernel_bytes,
    loss_kernel_bytes, loss_min_bytes, min_bytes, roofline_table, set_bytes, set_rates, static_bound,
)
from table import Row, _fmt, _slug, markdown_table, retabulate, write_results  # noqa: E402,F401

import flowrl  # noqa: E402,F401
from flowrl.backends import _dispatch  # noqa: E402
from flowrl.backends import reference  # noqa: E402,F401
from flowrl.contract import CHUNK_SIZE  # noqa: E402,F401
from flowrl.core import _validate as V  # noqa: E402,F401
from flowrl.data.tree import BranchSpec  # noqa: E402,F401


# ---- the step sweep (here, beside main: a test replaces run.build, which the sweep looks up here) -----------

def run_sweep(
    device: torch.device, shapes, dtypes, modes, ops, impls, *, time_budget_s: float = math.inf,
    timing_budget_s: float = 0.5, log=print, progress: Optional[Callable[[List[Row], float], None]] = None,
) -> Tuple[List[Row], float, List[str]]:
    """Check and time every configuration; returns (rows, copy GB/s, notes). ``progress(rows, copy)``
    is called after each configuration (the results so far survive a run killed at a time limit)."""
    notes: List[str] = []
    impls = list(impls) + ([] if "eager" in impls else ["eager"])  # every row is checked against it
    if "flowrl-triton" in impls and device.type != "cuda":
        impls.remove("flowrl-triton")
        notes.append("flowrl-triton is timed on CUDA only (the Triton interpreter is not a measurement)")
    if "flowrl-triton" in impls and not _dispatch.triton_available():
        impls.remove("flowrl-triton")
        notes.append(f"flowrl-triton unavailable: {_dispatch._triton_import_error()}")
    copy = copy_gbps(device, budget_s=max(timing_budget_s, 1.0))
    log(f"# copy bandwidth: {copy:.1f} GB/s")
    rows: List[Row] = []
    started = time.perf_counter()
    configs = [(s, d, m) for s in shapes for d in dtypes for m in modes]
    for done, (shape, dname, mode) in enumerate(configs):
        if time.perf_counter() - started > time_budget_s:
            notes.append(f"time budget of {time_budget_s:.0f} s reached: {done} of {len(configs)} "
                         "shape/dtype/mode configurations measured")
            break
        dtype = DTYPES[dname]
        case = make_case(shape, dtype, mode, device)
        numel, batch, itemsize = case.x.numel(), shape[0], case.x.element_size()
        shape_s = "x".join(map(str, shape))
        for op in ops:
            if op in COND_OPS and case.token_sigmas is None:
                continue  # conditioned steps are video steps of the first-order flow modes (make_case)
            eager = build("eager", case, op)
            expected = eager()
            op_rows = {impl: Row(op, mode, dname, shape_s, impl) for impl in impls}
            for row in op_rows.values():
                set_bytes(row, numel, batch, itemsize)
            rows.extend(op_rows.values())
            fns: Dict[str, Callable] = {}
            for impl, row in op_rows.items():
                try:
                    fn = eager if impl == "eager" else build(impl, case, op)
                    row.check_err = check(fn(), expected)
                    fns[impl] = fn
                except AssertionError as exc:
                    row.note = f"CHECK FAILED: {exc}"
                except Exception as exc:  # e.g. torch.compile without a working compiler: report it
                    row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            time_rows(op_rows, fns, device, timing_budget_s, numel, copy, itemsize, with_peak=op in PEAK_OP)
            for row in op_rows.values():
                if "compile" in op_rows:
                    row.x_compile = op_rows["compile"].time_ms / row.time_ms
                log(f"# {op:18s} {mode} {dname} {shape_s:18s} {row.impl:14s} {row.time_ms:10.4f} ms  {row.note}")
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if progress is not None:
            progress(rows, copy)
    return rows, copy, notes


def parse_shapes(text: str) -> List[Tuple[int, ...]]:
    try:
        shapes = [tuple(int(d) for d in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes are like 1x4096x64,8x16x128x128; got {text!r}") from None
    if not shapes or any(len(s) < 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"each shape needs a batch and at least one more positive dim; got {text!r}")
    return shapes


def _choices(allowed: Sequence[str]):
    def parse(text: str) -> List[str]:
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}; got {text!r}")
        return items
    return parse


def default_ops(quick: bool) -> List[str]:
    """The step suite's ops without --ops: all, and with --quick all but the tree step (its torch
    reference's CPU Philox doubled the quick run, 26 s -> 50 s on the 2-core machine)."""
    return list(OPS + COND_OPS + (() if quick else TREE_OPS))


# where a run writes unless told (--out, $OUT): a folder git ignores, so a run leaves the checkout clean
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "local")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"reduced sweep (under a minute on a 2-core CPU): shapes {QUICK_SHAPES}, modes {QUICK_MODES}, "
                        f"dtypes {QUICK_DTYPES}, no torch.compile baseline")
    p.add_argument("--suite", choices=("steps", "losses"), default="steps",
                   help="steps: the step ops (default); losses: flowrl.losses beside the peers' eager loss code")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", type=parse_shapes, help="comma-separated, e.g. 1x4096x64,4x16x21x60x104")
    p.add_argument("--dtypes", type=_choices(list(DTYPES)), default=None, help=f"default {list(DTYPES)}")
    p.add_argument("--modes", type=_choices(MODES), default=None, help=f"default {list(MODES)}")
    p.add_argument("--ops", type=_choices(OPS + COND_OPS + TREE_OPS), default=None,
                   help="the conditioned ops (*_cond) run on 5-D video shapes, in the modes that take per-token "
                        "sigmas (not ddim, dpm_sde); default all, and with --quick all but rollout_tree (the torch "
                        "reference's Philox takes most of a CPU sweep's time)")
    p.add_argument("--impls", type=_choices(IMPLS), default=None, help=f"default {list(IMPLS)}")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch.set_num_threads (1 gives stable timings on a loaded, shared machine)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--time-budget", type=float, default=math.inf,
                   help="stop starting new configurations after this many seconds (the table says so)")
    p.add_argument("--timing-budget", type=float, default=None,
                   help="CPU: seconds of repeated runs per timing (default 0.5, 0.2 with --quick)")
    p.add_argument("--table-from", metavar="CSV",
                   help="print the table of an earlier results CSV, its byte columns recomputed (no run)")
    p.add_argument("--tag", default="",
                   help="appended to the results' file names (several runs on one machine and day)")
    p.add_argument("--out", default=os.environ.get("OUT") or DEFAULT_OUT,
                   help="directory for the CSV and .md (default: $OUT, else bench/local/, which git ignores; "
                        "the recorded tables go to bench/results/ by --out bench/results)")
    args = p.parse_args(argv)
    if args.table_from:
        rows, header = retabulate(args.table_from)
        print("# " + ", ".join(f"{k}={v}" for k, v in header.items()))
        print(markdown_table(rows))
        return 0

    device = torch.device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    shapes = args.shapes or (QUICK_SHAPES if args.quick else FULL_SHAPES)
    if args.modes is None:
        args.modes = list(QUICK_MODES if args.quick else MODES)
    if args.dtypes is None:
        args.dtypes = list(QUICK_DTYPES if args.quick else DTYPES)
    if args.impls is None:
        args.impls = list(QUICK_IMPLS if args.quick else IMPLS)
    if args.ops is None:
        args.ops = default_ops(args.quick)
    impls = [i for i in args.impls if not (args.no_compile and i == "compile")]
    timing_budget = args.timing_budget if args.timing_budget is not None else (0.2 if args.quick else 0.5)

    header = {
        "machine": machine_name(device),
        "device": device.type,
        "torch": torch.__version__,
        "triton": triton_version(),
        "date": datetime.date.today().isoformat(),
        "threads": str(torch.get_num_threads()),
        "load_before": _loadavg(),
    }
    if args.suite == "losses":
        header["suite"] = "losses"
    if args.tag:
        header["tag"] = args.tag
    print("# " + ", ".join(f"{k}={v}" for k, v in header.items()), flush=True)
    started = time.perf_counter()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    def progress(rows: List[Row], copy: float) -> None:
        """The results so far, rewritten after each configuration and marked partial: a run stopped
        at a time limit (a GPU lease) still leaves every row it measured."""
        write_results(rows, {**header, "copy_gbps": f"{copy:.1f}", "partial": "yes"}, markdown_table(rows), args.out)

    if args.suite == "losses":
        rows, copy, notes = run_loss_sweep(device, shapes, args.dtypes, LOSS_OPS, impls, time_budget_s=args.time_budget,
                                           timing_budget_s=timing_budget, log=log, progress=progress)
    else:
        rows, copy, notes = run_sweep(
            device, shapes, args.dtypes, args.modes, args.ops, impls, time_budget_s=args.time_budget,
            timing_budget_s=timing_budget, log=log, progress=progress,
        )
    header["load_after"] = _loadavg()
    header["copy_gbps"] = f"{copy:.1f}"
    header["sweep_s"] = f"{time.perf_counter() - started:.0f}"
    table = markdown_table(rows)
    path = write_results(rows, header, table, args.out)
    print(f"\n{'GPU' if device.type == 'cuda' else 'CPU'} results on {header['machine']} (torch {header['torch']}, "
          f"triton {header['triton']}, {header['date']}); copy bandwidth {copy:.1f} GB/s; CSV: {path}")
    for note in notes:
        print(f"note: {note}")
    print("\n" + table, flush=True)
    # a wrong result fails the run, and so does a flowrl implementation that raised (a kernel that does
    # not compile on this machine); the compile baseline's failures are only reported
    failed = [r for r in rows if r.note.startswith("CHECK FAILED") or (r.note and r.impl in FLOWRL_BACKEND)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
