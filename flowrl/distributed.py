"""``flowrl.distributed``: the sequence-parallel forms of flowrl's ops under one name, for a trainer
that shards every sample over a process group (docs/wire_and_sp.md): the step ops
(``sde_step``, ``step_log_prob``, ``step_kl``, ``shard_layout``; flowrl/ops/distributed.py) and the losses
(``grpo_loss``, ..., ``dgpo_loss``; flowrl/losses/distributed.py), each taking ``group=`` and
``shard_numels=`` instead of ``shard=``. It sits above both layers and only re-exports them.
"""
from __future__ import annotations

from .losses.distributed import (
    LOSSES, awm_log_prob, awm_loss, dgpo_loss, dpo_loss, flow_dppo_loss, grpo_guard_loss, grpo_loss, nft_loss,
    teacher_kl_loss,
)
from .ops.distributed import CHUNK_SIZE, ShardLayout, sde_step, shard_layout, step_kl, step_log_prob

__all__ = ["CHUNK_SIZE", "ShardLayout", "shard_layout", "sde_step", "step_log_prob", "step_kl", "LOSSES", "grpo_loss",
           "grpo_guard_loss", "flow_dppo_loss", "teacher_kl_loss", "nft_loss", "awm_log_prob", "awm_loss", "dpo_loss",
           "dgpo_loss"]
assert set(__all__) >= set(LOSSES)
