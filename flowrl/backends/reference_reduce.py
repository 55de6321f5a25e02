"""The contract's fixed reduction order for the torch reference backend (``flowrl.backends.reference``
re-exports every name): the pairwise halving tree, the chunk partials and their combination.
"""
from __future__ import annotations

import torch

from ..contract import CHUNK_SIZE, LEAF_SIZE


def _halving_tree_(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by the fixed halving tree ``t[:h] + t[h:]``, level by
    level, in place in ``t`` (no temporaries: on the CPU the allocations cost more than the adds)."""
    width = t.shape[-1]
    while width > 1:
        width //= 2
        t[..., :width] += t[..., width : 2 * width]
    return t[..., 0].clone()


class _PairwiseSum(torch.autograd.Function):
    """The halving tree's backward is the plain sum's (every element has derivative 1): one broadcast
    instead of a slice-backward per level."""

    @staticmethod
    def forward(ctx, t, consume):
        ctx.shape = t.shape
        return _halving_tree_(t.detach() if consume else t.detach().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad.unsqueeze(-1).expand(ctx.shape), None


def _pairwise_sum(t: torch.Tensor, consume: bool = False) -> torch.Tensor:
    """Halving-tree sum over the last dim; ``consume=True`` lets it overwrite ``t`` (a temporary that
    nothing else reads or saved for backward)."""
    if t.requires_grad:
        return _PairwiseSum.apply(t, consume)
    return _halving_tree_(t if consume else t.clone())


def _chunk_partials(sq: torch.Tensor, consume: bool) -> torch.Tensor:
    """The contract's chunk order: each chunk's leaves of LEAF_SIZE consecutive elements by the
    halving tree, then the chunk's leaf sums by the same tree."""
    b, n = sq.shape
    nchunks = -(-n // CHUNK_SIZE)
    pad = nchunks * CHUNK_SIZE - n
    if pad:
        sq, consume = torch.nn.functional.pad(sq, (0, pad)), True
    leaves = _pairwise_sum(sq.reshape(b, nchunks, CHUNK_SIZE // LEAF_SIZE, LEAF_SIZE), consume)
    return _pairwise_sum(leaves, consume=True)


def chunk_partials(sq: torch.Tensor) -> torch.Tensor:
    """[B, N] squared residuals -> [B, ceil(N / CHUNK_SIZE)] chunk partials."""
    return _chunk_partials(sq, consume=False)


def combine_partials(partials: torch.Tensor) -> torch.Tensor:
    """[B, P] chunk partials -> [B] totals, by the halving tree over P zero-padded to a power of two."""
    p = partials.shape[-1]
    width = 1 << max(p - 1, 0).bit_length()
    if width != p:
        partials = torch.nn.functional.pad(partials, (0, width - p))
    return _pairwise_sum(partials)
