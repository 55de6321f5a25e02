"""Sequence-parallel (SP) log-probs: every rank holds a shard of every sample, every rank gets the
full-sample result, bit for bit the single-device one when shards fall on chunk boundaries.

Each rank passes its shard: a contiguous range of every sample's *flattened* elements, ranks in
order (e.g. ``[B, S / world, C]`` of ``[B, S, C]``, the token sequence split on S). The log-prob is a
reduction over the whole sample, so the ranks exchange the contract's fixed-size chunk partials (an
all-gather of a ``[B, ceil(n_local / CHUNK_SIZE)]`` float32 tensor), concatenate them in rank order
and combine them exactly as a single device does (``flowrl.reference.finalize``). When every rank's
per-sample shard except the last is a multiple of ``CHUNK_SIZE`` (1024) elements, the partials are
the single-device partials and the result is identical bit for bit; otherwise a chunk straddles two
ranks, it is summed as two partials, and the result agrees to float32 rounding only.

Backward: the gather's backward hands each rank its own slice of the partials' gradient. Every rank
computes the same loss from the same gathered value, so no reduction is needed, and the gradient a
rank gets for its shard is the matching slice of the single-device gradient (bit for bit under the
same condition).

Works with any ``torch.distributed`` backend (gloo on CPU, NCCL on GPU). The per-rank shard sizes are
exchanged once per call (a tiny all-gather, one host sync); pass ``shard_numels=`` when they are
known to skip it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import _validate as V
from . import functional as F
from .reference import CHUNK_SIZE

GeneratorArg = F.GeneratorArg


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
        full = F.draw_noise((shape[0], self.numel), generator, device)
        local = full[:, self.offset: self.offset + self.shard_numels[self.rank]]
        return local.reshape(shape)


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
    return sample.numel() // sample.shape[0]


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


def sde_step(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    mode: str = "sde",
    noise_level: float = 0.7,
    noise: Optional[torch.Tensor] = None,
    generator: GeneratorArg = None,
    log_prob: str = "gaussian",
    reduction: str = "mean",
    out_dtype: Optional[torch.dtype] = None,
    backend: str = "auto",
    return_prev_sample_mean: bool = True,
    noise_seed: Union[None, int, torch.Tensor] = None,
    group=None,
    shard_numels: Optional[Sequence[int]] = None,
) -> F.SDEStepOutput:
    """``flowrl.sde_step`` on this rank's shard: ``prev_sample`` (and the mean) are this rank's shard,
    ``log_prob`` and ``std_dev`` the full samples' [B], the same on every rank. Noise drawn from
    ``generator`` is this rank's slice of the single-device noise; ``noise=`` is this rank's shard.
    ``noise_seed`` (the same on every rank) draws only this rank's elements of the single-device
    Philox noise (keyed by the element's index in the full sample): no full-sample draw."""
    layout = shard_layout(sample, group, shard_numels)
    return F._sde_step(
        sample, model_output, sigmas, step_index, mode=mode, noise_level=noise_level, noise=noise,
        generator=generator, log_prob=log_prob, reduction=reduction, out_dtype=out_dtype, backend=backend,
        return_prev_sample_mean=return_prev_sample_mean, noise_seed=noise_seed, numel=layout.numel,
        gather=layout.gather, noise_fn=layout.noise, elem_offset=layout.offset,
    )


def step_log_prob(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    prev_sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    mode: str = "sde",
    noise_level: float = 0.7,
    log_prob: str = "gaussian",
    reduction: str = "mean",
    backend: str = "auto",
    group=None,
    shard_numels: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """``flowrl.step_log_prob`` of the full samples [B] from this rank's shards; differentiable, each
    rank's gradient being its slice of the single-device gradient."""
    layout = shard_layout(sample, group, shard_numels)
    return F._step_log_prob(
        sample, model_output, prev_sample, sigmas, step_index, mode=mode, noise_level=noise_level,
        log_prob=log_prob, reduction=reduction, backend=backend, numel=layout.numel, gather=layout.gather,
    )


def step_kl(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    ref_model_output: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    mode: str = "sde",
    noise_level: float = 0.7,
    reduction: str = "mean",
    backend: str = "auto",
    group=None,
    shard_numels: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """``flowrl.step_kl`` of the full samples [B] from this rank's shards; differentiable like
    ``step_log_prob``."""
    layout = shard_layout(sample, group, shard_numels)
    return F._step_kl(
        sample, model_output, ref_model_output, sigmas, step_index, mode=mode, noise_level=noise_level,
        reduction=reduction, backend=backend, numel=layout.numel, gather=layout.gather,
    )


__all__ = ["CHUNK_SIZE", "ShardLayout", "shard_layout", "sde_step", "step_log_prob", "step_kl"]
