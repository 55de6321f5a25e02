"""``teacher_kl_loss``'s block (``flowrl.losses`` checks its no-grad inputs): ``flowrl.step_kl``, which
validates the step's arguments, and the batch mean. Eager mode calls ``teacher_kl``; under
``torch.compile`` the custom op ``flowrl::teacher_kl_loss`` (flowrl/losses/_custom_ops.py) runs it.
"""
from __future__ import annotations

from ..ops.functional import step_kl


def teacher_kl(sample, model_output, teacher_model_output, sigmas, step_index, mode, noise_level, reduction, backend,
               shard=None, token_sigmas=None, frozen=None, stream_weights=None):
    """(loss, per-sample KL [B] detached): the batch mean of ``flowrl.step_kl`` to the teacher (``shard``:
    step_kl's sequence-parallel context; ``token_sigmas``, ``frozen``, tuples of streams and
    ``stream_weights``: step_kl's)."""
    kl = step_kl(sample, model_output, teacher_model_output, sigmas, step_index, mode=mode, noise_level=noise_level,
                 reduction=reduction, backend=backend, shard=shard, token_sigmas=token_sigmas, frozen=frozen,
                 stream_weights=stream_weights)
    # an empty batch (B = 0): kl is [0] on model_output's graph, and its sum the loss's zero (a mean is 0/0)
    return (kl.sum() if kl.shape[0] == 0 else kl.mean()), kl.detach()
