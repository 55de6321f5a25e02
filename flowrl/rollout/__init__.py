"""The rollout side: the drop-in schedulers (``scheduler``, ``ddim``), the rollout recorder
(``recorder``) and the bf16-safe timestep lookup (``timestep_lookup``). Records into ``flowrl.data``;
steps with ``flowrl.ops``."""
from .windows import sde_windows  # noqa: E402  (per-sample SDE windows, verl-omni's rule)

__all__ = ["sde_windows"]
