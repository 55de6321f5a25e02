"""The trainer loops' shared settings and builders (tests/compat/test_trainer_loops.py re-creates each
trainer's rollout + recompute loop with them; tests/compat/test_verl_omni.py's verl-omni loop reuses them):
the mixed-precision dtypes, Flow-GRPO's steps / batch / guidance scale / noise level, the SD3 prompt
embeddings and the first-update ratio's deviation from 1."""
import torch

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = {"fp32": F32, "bf16": BF16, "fp16": F16}
STEPS, BATCH, SCALE, ETA = 6, 2, 4.5, 0.7  # Flow-GRPO's guidance_scale 4.5 and noise_level 0.7


def sd3_embeds(dtype, batch=BATCH):
    g = torch.Generator().manual_seed(11)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731  (text encoders in inference_dtype)
    return dict(pos=r(batch, 5, 16), pos_pooled=r(batch, 8), neg=r(batch, 5, 16), neg_pooled=r(batch, 8))


def ratio_dev(new, old):
    return (torch.exp(new - old) - 1).abs()
