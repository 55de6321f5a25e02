"""The data side: the rollout record (``trajectory.RolloutTrajectory``), what the model received
(``denoising_env``), debug tensors (``debug``), the wire format (``serialization``) and the SGLang
converters (``sglang``: from_sglang returns a RolloutTrajectory). Reads ``flowrl.ops`` and below."""
