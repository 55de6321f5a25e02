"""The losses of ``flowrl.losses`` on sequence-parallel shards, each taking ``group`` and ``shard_numels``
instead of ``shard``: built by ``flowrl.ops.distributed._with_group``, the step ops' wrapper (the layout
from the first tensor argument, one all-gather of the shard sizes unless ``shard_numels`` is given), and
re-exported as ``flowrl.distributed.grpo_loss`` etc. (flowrl/distributed.py) (docs/wire_and_sp.md, Losses under SP).
"""
from __future__ import annotations

from ..ops.distributed import _with_group
from . import awm_log_prob as _awm_log_prob
from . import awm_loss as _awm_loss
from . import dgpo_loss as _dgpo_loss
from . import dpo_loss as _dpo_loss
from . import flow_dppo_loss as _flow_dppo_loss
from . import grpo_guard_loss as _grpo_guard_loss
from . import grpo_loss as _grpo_loss
from . import nft_loss as _nft_loss
from . import teacher_kl_loss as _teacher_kl_loss

LOSSES = ("grpo_loss", "grpo_guard_loss", "flow_dppo_loss", "teacher_kl_loss", "nft_loss", "awm_log_prob",
          "awm_loss", "dpo_loss", "dgpo_loss")

NOTE = (
    "``flowrl.losses.{name}`` on this rank's shard of every sample (``group``: the process group).\n\n"
    "Tensors of the sample's shape are this rank's shards (the same contiguous range of every sample's "
    "flattened elements, ranks in order); [B] inputs (advantages, old log-probs, sigma, weights, group "
    "ids) are whole, the same on every rank. The per-sample sums' chunk partials are gathered across the "
    "ranks (the step ops' exchange), so the returned [B] values and the loss are the full samples', the "
    "same on every rank, and ``loss.backward()`` gives each rank its slice of the single-device gradient "
    "(bit for bit when every shard but the last is a whole number of CHUNK_SIZE elements per sample; to "
    "float32 rounding otherwise; docs/wire_and_sp.md). ``noise_seed`` replays this rank's elements of "
    "the single-device Philox noise.\n\n"
)

grpo_loss = _with_group(_grpo_loss, NOTE)
grpo_guard_loss = _with_group(_grpo_guard_loss, NOTE)
flow_dppo_loss = _with_group(_flow_dppo_loss, NOTE)
teacher_kl_loss = _with_group(_teacher_kl_loss, NOTE)
nft_loss = _with_group(_nft_loss, NOTE)
awm_log_prob = _with_group(_awm_log_prob, NOTE)
awm_loss = _with_group(_awm_loss, NOTE)
dpo_loss = _with_group(_dpo_loss, NOTE)
dgpo_loss = _with_group(_dgpo_loss, NOTE)

__all__ = list(LOSSES)
