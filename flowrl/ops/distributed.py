"""Sequence-parallel (SP) log-probs: every rank holds a shard of every sample, every rank gets the
full-sample result, bit for bit the single-device one when shards fall on chunk boundaries.

Each rank passes its shard: a contiguous range of every sample's *flattened* elements, ranks in
order (e.g. ``[B, S / world, C]`` of ``[B, S, C]``, the token sequence split on S). The log-prob is a
reduction over the whole sample, so the ranks exchange the contract's fixed-size chunk partials (an
all-gather of a ``[B, ceil(n_local / CHUNK_SIZE)]`` float32 tensor), concatenate them in rank order
and combine them exactly as a single device does (``flowrl.backends.reference.finalize``). When every rank's
per-sample shard except the last is a multiple of ``CHUNK_SIZE`` (1024) elements, the partials are
the single-device partials and the result is identical bit for bit; otherwise a chunk straddles two
ranks, it is summed as two partials, and the result agrees to float32 rounding only.

Backward: the gather's backward hands each rank its own slice of the partials' gradient. Every rank
computes the same loss from the same gathered value, so no reduction is needed, and the gradient a
rank gets for its shard is the matching slice of the single-device gradient (bit for bit under the
same condition).

Written for any ``torch.distributed`` backend; gloo is tested (CPU processes), NCCL only where a GPU run
is recorded (docs/wire_and_sp.md). The per-rank shard sizes are exchanged once per call (a tiny
all-gather, one host sync); pass ``shard_numels=`` when they are known to skip it. The losses of
``flowrl.losses`` have their group forms here too (``grpo_loss``, ...: flowrl/losses/distributed.py).
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..core import _validate as V
from . import functional as F
from ..contract import CHUNK_SIZE
from ..core.step_spec import GeneratorArg, ShardContext, draw_noise


@dataclass(frozen=True)
class ShardLayout:
    """How the samples are split across the group: ``shard_numels[r]`` elements per sample on rank r."""

    shard_numels: List[int]
    rank: int
    group: Optional[object]

    @property
    def numel(self) -> int:
        """Elements per full sample (the mean's denominator)."""
        return sum(self.shard_numels)

    @property
    def offset(self) -> int:
        """Where this rank's shard starts in the flattened sample."""
        return sum(self.shard_numels[: self.rank])

    @property
    def chunks(self) -> List[int]:
        return [-(-n // CHUNK_SIZE) for n in self.shard_numels]

    @property
    def bit_exact(self) -> bool:
        """True when every shard but the last is a whole number of chunks (single-device bits)."""
        return all(n % CHUNK_SIZE == 0 for n in self.shard_numels[:-1])

    def gather(self, local_partials: torch.Tensor) -> torch.Tensor:
        """This rank's chunk partials [B, P_local] -> the full sample's [B, P], ranks in order;
        differentiable (backward returns this rank's slice)."""
        return _GatherPartials.apply(local_partials, self)

    def noise(self, shape, generator: GeneratorArg, device: torch.device) -> torch.Tensor:
        """This rank's slice of the single-device noise: the full per-sample buffer is drawn (as
        SGLang does) and the rank's flattened range is kept, so it equals the single-device noise's
        slice for a generator, a list of per-sample generators, or the global RNG (same state on
        every rank)."""
        shape = tuple(shape)
        full = draw_noise((shape[0], self.numel), generator, device)
        local = full[:, self.offset: self.offset + self.shard_numels[self.rank]]
        return local.reshape(shape)

    def context(self) -> ShardContext:
        """What a step needs to know of this layout (``StepSpec.shard``)."""
        return ShardContext(numel=self.numel, offset=self.offset, gather=self.gather, draw_noise=self.noise)


class _GatherPartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        chunks = layout.chunks
        if local.dim() != 2 or local.shape[1] != chunks[layout.rank]:
            raise RuntimeError(
                f"rank {layout.rank}: expected chunk partials [B, {chunks[layout.rank]}], got {tuple(local.shape)}"
            )
        # all_gather needs one size on every rank: pad to the widest shard, drop the padding after
        width = max(chunks)
        padded = torch.nn.functional.pad(local, (0, width - local.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in chunks]
        dist.all_gather(parts, padded, group=layout.group)
        ctx.start = sum(chunks[: layout.rank])
        ctx.stop = ctx.start + chunks[layout.rank]
        return torch.cat([p[:, :n] for p, n in zip(parts, chunks)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[:, ctx.start: ctx.stop], None


def _per_sample_numel(sample: torch.Tensor) -> int:
    return math.prod(sample.shape[1:])  # B may be 0 (an empty batch: every rank of the group holds none)


def shard_layout(sample: torch.Tensor, group=None, shard_numels: Optional[Sequence[int]] = None) -> ShardLayout:
    """The layout of ``sample``'s shards across ``group``: from ``shard_numels`` when given (no
    communication), else by all-gathering every rank's (batch size, per-sample element count)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flowrl.distributed needs an initialized torch.distributed process group "
            "(torch.distributed.init_process_group); on one device use flowrl.sde_step / step_log_prob"
        )
    V.check_sample(sample)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    local = _per_sample_numel(sample)
    if shard_numels is not None:
        counts = list(shard_numels) if isinstance(shard_numels, (list, tuple)) else None
        if counts is None or len(counts) != world or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts
        ):
            raise ValueError(f"shard_numels must be a list of {world} positive ints (one per rank); got {shard_numels!r}")
        if counts[rank] != local:
            raise ValueError(
                f"shard_numels[{rank}] = {counts[rank]} but this rank's sample holds {local} elements per sample"
            )
        return ShardLayout(counts, rank, group)
    # gloo reduces CPU tensors; NCCL and other accelerator backends want tensors on the device
    device = sample.device if sample.device.type != "cpu" and dist.get_backend(group) != "gloo" else torch.device("cpu")
    mine = torch.tensor([sample.shape[0], local], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    pairs = torch.stack(everyone).tolist()
    batches = [b for b, _ in pairs]
    if len(set(batches)) != 1:
        # every rank sees the same list, so every rank raises: no rank is left waiting in a collective
        raise ValueError(f"every rank must hold the same batch of samples; batch sizes per rank: {batches}")
    return ShardLayout([n for _, n in pairs], rank, group)


def _with_group(op, note: Optional[str] = None):
    """``op`` (a ``flowrl.ops.functional`` op, or a loss of ``flowrl.losses``) on this rank's shards: the same
    arguments, less ``shard``, plus ``group`` (the process group; None: the default group) and
    ``shard_numels`` (every rank's elements per sample, when known: skips their exchange). The layout
    comes from op's first argument (a tensor of the sample's shape: ``sample``, ``noised_sample`` or
    ``model_output``) and becomes the op's ``shard=`` context; nothing else changes. ``note``: the
    wrapper's doc paragraph (the step ops' by default)."""
    signature = inspect.signature(op)
    first = next(iter(signature.parameters))
    params = [p for name, p in signature.parameters.items() if name != "shard"]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
               for name in ("group", "shard_numels")]

    @functools.wraps(op)
    def on_shards(*args, group=None, shard_numels: Optional[Sequence[int]] = None, **kwargs):
        if "shard" in kwargs:
            raise TypeError(f"flowrl.distributed.{op.__name__} builds the shard from group and shard_numels; "
                            "do not pass shard")
        if args:
            sample = args[0]
        elif first in kwargs:
            sample = kwargs[first]
        else:
            raise TypeError(f"flowrl.distributed.{op.__name__} missing its first argument {first!r}")
        return op(*args, shard=shard_layout(sample, group, shard_numels).context(), **kwargs)

    on_shards.__signature__ = signature.replace(parameters=params)
    on_shards.__module__ = __name__
    on_shards.__doc__ = note.format(name=op.__name__) + (op.__doc__ or "") if note is not None else (
        f"``flowrl.{op.__name__}`` on this rank's shard of every sample (``group``: the process group).\n\n"
        "Tensors of the sample's shape are this rank's shards (and so are ``prev_sample`` and the mean "
        "returned by sde_step); values [B] (log_prob, KL, std_dev) are the full samples', the same on "
        "every rank, and differentiable: each rank's gradient is its slice of the single-device "
        "gradient. Noise drawn from ``generator`` is this rank's slice of the single-device noise; "
        "``noise_seed`` (the same on every rank) draws only this rank's elements of the single-device "
        "Philox noise. ``token_sigmas`` and ``frozen`` are this rank's slices too (broadcastable to its "
        "shard); the scored count is summed over ranks (exact), and so is a per-token gaussian log term "
        "(to float32 rounding: the other kinds are bitwise).\n\n" + (op.__doc__ or "")
    )
    return on_shards


sde_step = _with_group(F.sde_step)
step_log_prob = _with_group(F.step_log_prob)
step_kl = _with_group(F.step_kl)


# The losses' forms (flowrl.distributed.grpo_loss, ...) are built by the same ``_with_group`` in the losses
# layer (flowrl/losses/distributed.py) and re-exported here on first use, as flowrl/__init__.py's lazy names
# are: this module imports nothing above the ops layer.

__all__ = ["CHUNK_SIZE", "ShardLayout", "shard_layout", "sde_step", "step_log_prob", "step_kl"]
