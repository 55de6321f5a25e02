"""The Specialization record (one compile of one kernel) and what the lists' builders share: the
launchers' (chunks per program, num_warps) configurations (flowrl.backends' launch tables), the
elementwise steps' switches and the pointers' widths."""
from __future__ import annotations

from typing import Dict, NamedTuple

from flowrl.backends import _triton_ops
from flowrl.contract import CHUNK_SIZE

STORAGES = ("bf16", "fp16", "fp32")
ARCHS = (90, 80)


class Specialization(NamedTuple):
    """One compile of one kernel: argument types (Triton's signature strings), constexpr values, the
    arguments the JIT marks divisible by 16 (pointers 16-byte aligned, integers multiples of 16), the
    launch's warps, a label, and the elements one program covers (for per-element counts)."""

    kernel: str
    signature: Dict[str, str]
    constexprs: Dict[str, object]
    aligned: tuple
    num_warps: int
    label: str = ""
    elements: int = CHUNK_SIZE


def _launch_configs():
    """The distinct (chunks per program, num_warps) of the launcher's table."""
    return sorted({(group, warps) for _, group, warps in _triton_ops.LAUNCH_TABLE})


def _step_config(storage, backward=False, masked_rollout=False, second_order=False, philox=False,
                 philox_mean=False):
    """The step kernels' launch configuration for large latents of ``storage`` (the launcher's
    step_config with 16-byte aligned latents): STEP_LAUNCH_TABLE's largest where tiles are taken
    (tiles_taken, bf16 / fp16), LAUNCH_TABLE's largest, one tile, elsewhere."""
    if storage in ("bf16", "fp16") and _triton_ops.tiles_taken(backward, masked_rollout, second_order, philox,
                                                                  philox_mean):
        return _triton_ops.STEP_LAUNCH_TABLE[-1][1:]
    return _launch_configs()[-1]


def _tiles_even(group, warps, even):
    """The step kernels' TILES (flowrl.backends._triton_ops.element_tiles) and EVEN switches."""
    return {"TILES": _triton_ops.element_tiles(group, warps), "EVEN": even}


def _unaligned_philox_config():
    """Where Philox noise is drawn from an offset that is not a multiple of 4 (a shard cut mid-quad)."""
    return _triton_ops.UNALIGNED_PHILOX_CONFIG


# the compact per-token (sigma, sigma') table and frozen mask of an elementwise step, with their index math
_ELEMENTWISE_SIG = {"tok_ptr": "*fp32", "tok_inner": "i32", "tok_groups": "i32", "tok_stride": "i32",
                    "frozen_ptr": "*u8", "frozen_inner": "i32", "frozen_groups": "i32", "frozen_stride": "i32"}


def _elementwise(elementwise, storage):
    """The switches of an elementwise step: () for none, or a subset of ("token", "frozen"), and "run1"
    for one lookup per element (RUN 1: a table's inner is odd); otherwise RUN is a thread's 16-byte
    vector of ``storage`` (the launcher's ``token_run`` when every inner is a multiple of it)."""
    if not elementwise:  # RUN unused
        return {"PER_TOKEN": False, "HAS_FROZEN": False, "WEIGHTED": False, "RUN": 1}
    per_token = "token" in elementwise
    run = 1 if "run1" in elementwise else 16 // _WIDTH["*" + storage]
    return {"PER_TOKEN": per_token, "HAS_FROZEN": "frozen" in elementwise, "WEIGHTED": per_token, "RUN": run}


def _elementwise_label(elementwise):
    return "".join(" +" + name for name in elementwise)


# the bytes of one element behind a pointer of each type (bytes_per_element, the elementwise steps' RUN)
_WIDTH = {"*bf16": 2, "*fp16": 2, "*fp32": 4, "*u8": 1, "*i64": 8}
