"""``teacher_kl_loss``'s block (``flowrl.losses`` checks its no-grad inputs): ``flowrl.step_kl``, which
validates the step's arguments, and the batch mean. Eager mode calls ``teacher_kl``; under
``torch.compile`` the custom op ``flowrl::teacher_kl_loss`` (flowrl/losses/_custom_ops.py) runs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..core.step_spec import ShardContext
from ..ops.functional import step_kl


@dataclass(frozen=True)
class StepKLExtras:
    """``step_kl``'s inputs beyond one stream's step on one device, each None when not used: ``shard``
    (the sequence-parallel context), ``token_sigmas`` and ``frozen`` (per-token schedules and frozen masks)
    and ``stream_weights`` (a joint step's, with tuples of streams). The custom op
    ``flowrl::teacher_kl_loss`` takes none of them: a call with any runs eagerly."""

    shard: Optional[ShardContext] = None
    token_sigmas: Optional[torch.Tensor] = None
    frozen: Optional[torch.Tensor] = None
    stream_weights: Optional[Sequence[float]] = None


def teacher_kl(sample, model_output, teacher_model_output, sigmas, step_index, mode, noise_level, reduction, backend,
               extras: StepKLExtras = StepKLExtras()):
    """(loss, per-sample KL [B] detached): the batch mean of ``flowrl.step_kl`` to the teacher (``extras``:
    step_kl's sequence-parallel context, per-token inputs and stream weights, ``StepKLExtras``)."""
    kl = step_kl(sample, model_output, teacher_model_output, sigmas, step_index, mode=mode, noise_level=noise_level,
                 reduction=reduction, backend=backend, shard=extras.shard, token_sigmas=extras.token_sigmas,
                 frozen=extras.frozen, stream_weights=extras.stream_weights)
    # an empty batch (B = 0): kl is [0] on model_output's graph, and its sum the loss's zero (a mean is 0/0)
    return (kl.sum() if kl.shape[0] == 0 else kl.mean()), kl.detach()
