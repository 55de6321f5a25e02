"""The one place that chooses the Triton backend's launch configurations (``_triton_ops`` re-exports
every name; the launchers pass the result to the kernel by keyword).

It decides, for each launch, (chunks per program, num_warps) and the step kernels' TILES, EVEN and
register cap: ``step_config`` for the step kernels, ``element_config`` for one-tile element passes,
``step_switches`` for the switches, ``finalize_warps`` for the finalize kernel. Why: the largest
program that keeps a tile's 32 values per thread in registers without a spill (the AOT compile of
every specialization, flowrl/tools/aot; docs/kernels.md, "Launch"), since the kernels are
memory-bound only while their instruction count stays low. No choice changes a bit: each chunk's tree
is the same (tested). The measurements behind each entry are docs/kernels_log.md's.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..contract import CHUNK_SIZE, Mode, NoiseSource, Op


def finalize_warps(width: int) -> int:
    """The finalize kernel's warps for ``width`` partials: 8 values per thread, 1 to 16 warps."""
    return max(1, min(16, width // 256))


# (largest elements per sample, chunks per program, num_warps), first match wins: flowrl.losses' element
# passes (flowrl/backends/_triton_losses.py), and the step kernels wherever STEP_LAUNCH_TABLE is not
# taken. One warp per 1,024-element chunk, 32 values per thread (issue 21, the roofline): a thread's
# values sit 256 elements apart in four runs of 8 (bf16; fp32: 128 apart in eight runs of 4), so the
# chunk's tree (leaves of 8 first) runs in registers and warp shuffles, with no shared memory and no barrier, and
# the per-sample coefficients are spread over 32 values per thread instead of 8. The AOT roofline
# (bf16, sm_90a, triton 3.9) measured the sde log-prob at 71 SASS instructions per element with (4
# chunks, 16 warps), 25 with (1, 1); (2, 1) as one 64-value tile needs up to 254 registers (the
# rollout with the mean) and spills at 128. Any entry gives the same bits.
LAUNCH_TABLE = ((float("inf"), 1, 1),)

# The step kernels' table where tiles are taken (``step_config``): above 4,096 elements per sample a
# one-warp program holds 4 chunks and runs them as 4 static tiles of one chunk (TILES, a loop-free
# tl.static_range), so each tile's 32 values per thread stay in registers while the per-sample work
# (the coefficients' IEEE divisions and square roots with their slow paths, the index math, the
# per-sample loads) is done once per 4,096 elements. Same bits: each chunk's tree is the same.
STEP_LAUNCH_TABLE = ((4096, 1, 1), (float("inf"), 4, 1))

# Registers per thread of a multi-tile program (issue 21: <= 128). Unbounded, ptxas hoists the next
# tiles' loads and needs more registers for no fewer instructions.
MAX_TILE_REGISTERS = 128


# One chunk on four warps, 8 values per thread, for the launches that spill at 32 values per thread
# (tests/kernels/test_compile.py): ddim's float32 rollouts (at (1, 1) 32 bytes spilled on sm_80, and on sm_90a
# with triton 3.6). The chunk's tree then crosses warps (shared memory); the bits are the same.
WIDE_CONFIG = (1, 4)
# Philox from an offset that is not a multiple of 4 (a sequence-parallel shard cut mid-quad: 3 Philox
# calls and 5 Box-Muller pairs per 8 elements): one chunk on two warps, 16 values per thread, 56-95
# registers (sm_90a and sm_80, triton 3.6.0 and 3.9.0). At (1, 4) the per-program work weighed 0.54-0.64
# of copy bandwidth against the target 0.7, at (1, 2) 0.76-0.93; at (1, 1) 167 registers, and under the
# 128 cap 88-128 bytes spilled.
UNALIGNED_PHILOX_CONFIG = (1, 2)


# Elementwise steps (per-token sigmas, frozen masks) run the ordinary step's configuration since their
# per-token coefficients come from a pre-pass (kernels/token.py) and are loaded once per run of
# elements (``token_run``): at (1, 1) they fit in 128 registers on sm_90a without a spill
# (flowrl/tools/aot). Three launches spill there and take WIDE_CONFIG instead (``element_config``):
# one lookup per element (RUN 1) beside Philox noise (the rollout, the loss backward replaying mu_old:
# 8-400 bytes), float32 latents in the loss pass (16 bytes, triton 3.9 sm_90a, a given mu_old and a
# mask), and Philox from an unaligned offset (as without the elementwise switches). The backward step
# kernel does not spill at (1, 1) with any of them.
ELEMENTWISE_CONFIG = LAUNCH_TABLE[0][1:]

# The GRPO family's backward with mu_old replayed from Philox noise runs one chunk per program on one warp
# (the launch table's); at 4 chunks on 16 warps triton 3.6 spilled 16 bytes on sm_80 (float32 latents).
REPLAY_BACKWARD_CONFIG = LAUNCH_TABLE[0][1:]

# One chunk on eight warps, 4 values per thread: float32 latents with one lookup per element (RUN 1), where
# WIDE_CONFIG's 8 values per thread spilled 8 bytes (the GRPO family's pass replaying mu_old from Philox
# noise, sm_80, triton 3.9). The same bits (each chunk's tree is the same).
SLIM_CONFIG = (1, 8)

# Tokens per pre-pass program (the pre-pass reads and writes a few words per token).
TOKEN_TABLE_BLOCK = 256


def launch_config(n_per_sample: int, unaligned_philox: bool = False, table=LAUNCH_TABLE):
    """(chunks per program, num_warps) of the element kernels for samples of ``n_per_sample``
    (``table``: LAUNCH_TABLE, or STEP_LAUNCH_TABLE for tiled step kernels)."""
    if unaligned_philox:
        return UNALIGNED_PHILOX_CONFIG
    for largest, group, num_warps in table:
        if n_per_sample <= largest:
            return group, num_warps
    raise AssertionError("the launch table ends with an unbounded entry")


def tiles_taken(backward: bool, masked_rollout: bool = False, second_order: bool = False, philox: bool = False,
                philox_mean: bool = False) -> bool:
    """Whether a step kernel runs STEP_LAUNCH_TABLE's multi-tile programs (16-bit, 16-byte aligned
    latents): every step but those that spilled at 4 tiles under the 128-register cap, i.e. a masked
    rollout, a Philox rollout writing the mean or of dpm_sde's second order, and dpm_sde's second-order
    backward. Why each case is as it is: docs/kernels_log.md, "Which steps take tiles"."""
    philox_one_tile = philox and (philox_mean or second_order)
    return not (masked_rollout or philox_one_tile or (second_order and backward))


def element_tiles(group: int, num_warps: int) -> int:
    """The step kernels' TILES: a program's ``group`` chunks run in static tiles of at most 32 values
    per thread (one chunk per tile at one warp; one tile at WIDE_CONFIG and ELEMENTWISE_CONFIG)."""
    return max(1, group * CHUNK_SIZE // (32 * 32 * num_warps))


def register_cap(tiles: int, philox_mode: Optional[Mode] = None, latent_bytes: int = 2) -> dict:
    """The ``maxnreg`` of a step launch (issue 21: <= 128 registers per thread), or none: a multi-tile
    program's, and that of a rollout over 16-bit latents (``latent_bytes``) drawing Philox noise
    (``philox_mode``: its mode; unbounded, ptxas took up to 132 with triton 3.6, and none spills at 128)
    except ddim's one-tile rollout, whose sample clip spills under the cap (96 bytes, triton 3.6).
    float32 latents' Philox rollouts spill under it (24-112 bytes) and keep theirs (about 150
    registers). ddim's backward needs none at one tile (its four parts: at most 65 registers)."""
    if tiles > 1 or (latent_bytes == 2 and philox_mode is not None and philox_mode is not Mode.DDIM):
        return dict(maxnreg=MAX_TILE_REGISTERS)
    return {}


def step_switches(group: int, num_warps: int, n_per_sample: int, elementwise: bool = False, accessed=(),
                  philox_mode: Optional[Mode] = None, latent_bytes: int = 2) -> dict:
    """The step kernels' TILES, EVEN (the sample size a multiple of a one-warp program's block: no
    masks, bfloat16 read and 16-bit results written as 32-bit words, so every 16-bit tensor in
    ``accessed`` (the latents the kernel reads or writes; None skipped) must start on 4 bytes; the
    multi-warp WIDE_CONFIG launches and elementwise steps stay masked, one variant each, as
    flowrl/tools/aot compiles them) and register cap (``register_cap``; ``philox_mode``: the mode of a
    rollout drawing Philox noise, ``latent_bytes``: its latents' element size) of a launch."""
    tiles = element_tiles(group, num_warps)
    words = all(t.data_ptr() % 4 == 0 for t in accessed if t is not None and t.element_size() == 2)
    return dict(TILES=tiles, EVEN=(not elementwise and num_warps == 1 and n_per_sample % (group * CHUNK_SIZE) == 0
                                   and words),
                **register_cap(tiles, philox_mode, latent_bytes))


def token_run(inners, storage=None) -> int:
    """Consecutive elements that share one per-token lookup in the element kernels (their RUN): the
    largest power of two dividing every ``inner`` (of the per-token table, of the frozen mask), at most
    a thread's 16-byte vector of ``storage`` (8 16-bit values; 4 float32 ones, the default), so a run's
    values sit in one thread's registers."""
    run = 8 if storage is not None and storage.itemsize == 2 else 4
    for inner in inners:
        while inner % run:
            run //= 2
    return run


def division_magic(d: int) -> Tuple[int, int]:
    """``(m, l)`` for a divisor ``1 <= d < 2**31``: n // d == umulhi(2 n, m) >> l for every 0 <= n <
    2**31: the loss kernels' sample index from their program id (kernels/step.py's _block_offsets) and
    the per-token tables' index math (the pre-pass's header, kernels/token.py; common.compact_index).
    With l = ceil(log2 d) and m = ceil(2**(31 + l) / d) < 2**32, e = m d - 2**(31 + l) lies in [0, d),
    so n m / 2**(31 + l) = n / d + n e / (d 2**(31 + l)), whose error term is below n / (d 2**31) <
    1 / d: too small to reach the next integer."""
    if not 1 <= d < 2**31:
        raise ValueError(f"division_magic takes a divisor in [1, 2**31); got {d}")
    l = (d - 1).bit_length()
    return ((1 << (31 + l)) + d - 1) // d, l


def element_config(spec, n_per_sample: int, unaligned_philox: bool = False, storage=None, run=None):
    """(chunks per program, num_warps) of one-tile element kernels (flowrl.losses' passes; the step
    kernels where ``step_config`` takes no tiles) for ``spec``'s samples of ``n_per_sample`` stored as
    ``storage`` (a torch dtype); ``run``: an elementwise step's RUN (``token_run``), given by the
    forward element passes (the step's, the losses') and the losses' backward."""
    if spec.elementwise:
        if unaligned_philox:
            return UNALIGNED_PHILOX_CONFIG
        if run == 1 and storage == torch.float32:
            return SLIM_CONFIG
        if run == 1 or (run is not None and storage == torch.float32):
            return WIDE_CONFIG
        return ELEMENTWISE_CONFIG
    if spec.mode is Mode.DDIM and spec.op is Op.ROLLOUT and storage == torch.float32:
        return WIDE_CONFIG
    return launch_config(n_per_sample, unaligned_philox=unaligned_philox)


_TILE_DTYPES = (torch.bfloat16, torch.float16)


def step_config(spec, n_per_sample: int, latents, extra=(), backward: bool = False, unaligned_philox: bool = False,
                second_order: bool = False, run=None, write_mean: bool = False):
    """(chunks per program, num_warps) of the step kernels for ``spec``'s samples of ``n_per_sample``.
    Tiles are taken (STEP_LAUNCH_TABLE) when ``tiles_taken`` says so for the spec, every per-element
    tensor in ``latents`` is bf16, or every one fp16, and their addresses and those of ``extra`` (a
    rollout's float32 noise and mean) are 16-byte aligned with the sample size a multiple of 16 (the
    JIT's divisibility specialization: the unaligned variants keep one tile); None entries are
    skipped. Otherwise ``element_config``'s one tile (``run``: an elementwise forward's RUN;
    ``write_mean``: a rollout that writes its mean)."""
    storage = latents[0].dtype
    if spec.elementwise or unaligned_philox:
        return element_config(spec, n_per_sample, unaligned_philox=unaligned_philox, storage=storage, run=run)
    rollout = not backward and spec.op is Op.ROLLOUT
    philox = rollout and spec.noise_source is NoiseSource.PHILOX
    group, _ = launch_config(n_per_sample, table=STEP_LAUNCH_TABLE)
    masked_rollout = rollout and n_per_sample % (group * CHUNK_SIZE) != 0
    latents, extra = [t for t in latents if t is not None], [t for t in extra if t is not None]
    if (storage in _TILE_DTYPES and tiles_taken(backward, masked_rollout, second_order, philox, write_mean)
            and n_per_sample % 16 == 0 and all(t.dtype == storage for t in latents)
            and all(t.data_ptr() % 16 == 0 for t in latents + extra)):
        return launch_config(n_per_sample, table=STEP_LAUNCH_TABLE)
    return element_config(spec, n_per_sample, storage=storage)
