"""Ahead-of-time compile of flowrl's kernels for an NVIDIA target, on a machine without a GPU.

Triton's interpreter runs the kernels as Python and accepts code that real Triton rejects (a module
global that is not a ``tl.constexpr``, for one), so the tests also compile every kernel to PTX and
cubin for a GPU target through ``triton.compile(ASTSource(...), target=GPUTarget(...))``; the wheel
ships ``ptxas``. Run in a process without ``TRITON_INTERPRET`` (under it ``@triton.jit`` makes
interpreted functions) and with a fresh ``TRITON_CACHE_DIR`` (a cached build can hide an error)::

    python -m flowrl.kernels.aot [--arch 90] [--json]

prints one line per compiled specialization and exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Dict, Iterator, NamedTuple

from flowrl.contract import CHUNK_SIZE, LOG2_CHUNK_SIZE, LogProbKind, Mode, NoiseSource, Op


class Specialization(NamedTuple):
    """One compile of one kernel: argument types (Triton's signature strings), constexpr values, the
    pointer arguments that the JIT marks 16-byte aligned, and the launch's warps."""

    kernel: str
    signature: Dict[str, str]
    constexprs: Dict[str, object]
    aligned: tuple
    num_warps: int


def _pointer(dtype: str) -> str:
    return "*" + dtype


def specializations(storage: str = "bf16") -> Iterator[Specialization]:
    """One representative specialization per kernel, the most demanding switches of each (rollout
    with in-kernel Philox noise and the mean written; the Gaussian finalize; the backward writing all
    three grads), for latents stored as ``storage`` (bf16, fp16 or fp32)."""
    partial_ptrs = ("x_ptr", "v_ptr", "third_ptr", "prev_out_ptr", "mean_out_ptr", "partials_ptr", "sigmas_ptr",
                    "step_ptr", "seeds_ptr")
    yield Specialization(
        "step_partials_kernel",
        {
            "x_ptr": _pointer(storage), "v_ptr": _pointer(storage), "third_ptr": _pointer(storage),
            "prev_out_ptr": _pointer(storage), "mean_out_ptr": "*fp32", "partials_ptr": "*fp32",
            "sigmas_ptr": "*fp32", "step_ptr": "*i64", "seeds_ptr": "*i64", "stream_stride": "i32",
            "elem_offset": "i32", "n_per_sample": "i32", "n_chunks": "i32", "sigma_one_tol": "fp32",
            "eta": "fp32", "sin_half_pi_eta": "fp32",
        },
        {"MODE": int(Mode.SDE), "OP": int(Op.ROLLOUT), "WRITE_MEAN": True, "CHUNK": CHUNK_SIZE,
         "LOG2_CHUNK": LOG2_CHUNK_SIZE, "NOISE": int(NoiseSource.PHILOX), "PHILOX_ALIGNED": True},
        partial_ptrs, 4,
    )
    yield Specialization(
        "finalize_kernel",
        {
            "partials_ptr": "*fp32", "sigmas_ptr": "*fp32", "step_ptr": "*i64", "value_ptr": "*fp32",
            "std_ptr": "*fp32", "n_partials": "i32", "numel_f": "fp32", "sigma_one_tol": "fp32", "eta": "fp32",
            "sin_half_pi_eta": "fp32",
        },
        {"MODE": int(Mode.CPS), "KIND": int(LogProbKind.GAUSSIAN), "MEAN": True, "WIDTH": 64, "LOG2_WIDTH": 6},
        ("partials_ptr", "sigmas_ptr", "step_ptr", "value_ptr", "std_ptr"), 1,
    )
    yield Specialization(
        "step_backward_kernel",
        {
            "x_ptr": _pointer(storage), "v_ptr": _pointer(storage), "third_ptr": _pointer(storage),
            "grad_ptr": "*fp32", "grad_x_ptr": _pointer(storage), "grad_v_ptr": _pointer(storage),
            "grad_third_ptr": _pointer(storage), "sigmas_ptr": "*fp32", "step_ptr": "*i64", "n_per_sample": "i32",
            "n_chunks": "i32", "numel_f": "fp32", "sigma_one_tol": "fp32", "eta": "fp32", "sin_half_pi_eta": "fp32",
        },
        {"MODE": int(Mode.SDE), "KIND": int(LogProbKind.GAUSSIAN), "MEAN": True, "IS_KL": False, "NEED_X": True,
         "NEED_V": True, "NEED_THIRD": True, "CHUNK": CHUNK_SIZE},
        ("x_ptr", "v_ptr", "third_ptr", "grad_ptr", "grad_x_ptr", "grad_v_ptr", "grad_third_ptr", "sigmas_ptr",
         "step_ptr"), 4,
    )


def compile_specialization(spec: Specialization, arch: int = 90, kernel=None):
    """Compile ``spec`` for sm_{arch} with the launch options the backend uses (no FMA contraction);
    returns Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``). ``kernel``:
    a @triton.jit function (default: flowrl.kernels.step's kernel named ``spec.kernel``)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the AOT compile needs real @triton.jit functions: unset TRITON_INTERPRET")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flowrl.kernels import step

    kernel = getattr(step, spec.kernel) if kernel is None else kernel
    signature = dict(spec.signature)
    for name in spec.constexprs:
        signature[name] = "constexpr"
    signature = {name: signature[name] for name in kernel.arg_names}  # in argument order
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in spec.aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=dict(spec.constexprs), attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": spec.num_warps, "enable_fp_fusion": False})
    return triton.compile(source, target=target, options=options.__dict__)


def check(arch: int = 90, storages=("bf16", "fp16", "fp32")):
    """Compile every specialization of ``specializations`` for each storage dtype; returns a list of
    result dicts (kernel, storage, ok, error, shared memory, PTX/cubin sizes)."""
    import triton

    results = []
    for storage in storages:
        for spec in specializations(storage):
            row = {"kernel": spec.kernel, "storage": storage, "arch": f"sm_{arch}", "triton": triton.__version__}
            try:
                compiled = compile_specialization(spec, arch)
            except Exception as exc:  # report every failure, then fail the run
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}")
            else:
                row.update(ok=bool(compiled.asm.get("cubin")), shared=compiled.metadata.shared,
                           ptx_lines=compiled.asm["ptx"].count("\n"), cubin_bytes=len(compiled.asm["cubin"]))
            results.append(row)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowrl.kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="SM version to compile for (default 90: H100/H200)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="flowrl-aot-"))
    results = check(args.arch)
    if args.json:
        print(json.dumps(results))
    else:
        for row in results:
            status = "ok" if row["ok"] else f"FAILED {row['error']}"
            print(f"{row['kernel']:22s} {row['storage']:5s} {row['arch']} triton {row['triton']}: {status}")
    return 0 if all(row["ok"] for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
