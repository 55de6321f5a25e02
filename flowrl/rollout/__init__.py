"""The rollout side: the drop-in schedulers (``scheduler``, ``ddim``), the rollout recorder
(``recorder``) and the bf16-safe timestep lookup (``timestep_lookup``). Records into ``flowrl.data``;
steps with ``flowrl.ops``."""
