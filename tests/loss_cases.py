"""The losses' shared cases (tests/losses/test_losses.py, test_losses_kl.py, test_gardo.py): the backends,
the device, a rollout step with its schedule, a perturbed velocity, advantages, and the GRPO family's
float64 oracle (oracle_grpo)."""
import pytest
import torch

import flowrl
from flowrl.backends import _dispatch
from flowrl import oracle

T = 10
F64 = torch.float64
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() or _dispatch.interpreter_enabled()), reason="needs CUDA or TRITON_INTERPRET=1")),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = (3, 2, 750)  # 1500 elements per sample: two chunks, the second partial
STEPS = torch.tensor([0, 4, 8])  # the first step (sigma == 1), a middle one, a late one


def schedule(shift=3.0):
    t = torch.linspace(1, 0, T + 1, dtype=F64)
    return (shift * t / (1 + (shift - 1) * t)).to(torch.float32).to(DEVICE)


def rollout(mode="sde", eta=0.7, dtype=torch.float32, seed=0, shape=SHAPE, noise_seed=11, steps=STEPS):
    """A rollout step with in-kernel Philox noise (its mean returned): x, v, sigmas, out."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    v = torch.randn(shape, generator=g).to(DEVICE, dtype)
    sig = schedule()
    out = flowrl.sde_step(x, v, sig, steps.to(DEVICE), mode=mode, noise_level=eta, noise_seed=noise_seed,
                          backend="torch")
    return x, v, sig, out


def perturbed(v, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (v.float() + scale * torch.randn(v.shape, generator=g).to(v.device)).to(v.dtype)


def advantages(batch=3, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, generator=g).to(DEVICE)


def oracle_grpo(x, v, prev, sig, steps, old_lp, adv, mode, eta, clip, kl_coef=0.0, v_ref=None, old_mean=None,
                variant="grpo", kl_threshold=None):
    """The GRPO family in float64 from flowrl/oracle's log-prob, KL and mean (docs/contract.md's formulas)."""
    idx = [int(i) for i in steps]
    lp = oracle.log_prob(x, v, prev, sig, idx, mode, eta)
    log_ratio = lp - old_lp.to(F64)
    std = oracle.std(sig, idx, mode, eta, x.shape[0])
    adv = adv.to(F64)
    tr = None
    if old_mean is not None:
        diff = oracle.mean(x, v, sig, idx, mode, eta) - old_mean.to(F64)
        tr = (diff * diff).reshape(x.shape[0], -1).mean(1) / (2 * std * std)
    ratio = torch.exp((log_ratio + tr) * std) if variant == "guard" else torch.exp(log_ratio)
    if variant == "dppo":
        masked = (tr >= kl_threshold) & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
        per = torch.where(masked, torch.zeros_like(ratio), -adv * ratio)
    else:
        per = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip[0], 1 + clip[1]))
        if variant == "guard":
            d = torch.tensor([float(sig[i]) - float(sig[i + 1]) for i in idx], dtype=F64)
            per = per / d
    loss = per.mean()
    kl = None
    if v_ref is not None:
        kl = oracle.kl(x, v, v_ref, sig, idx, mode, eta)
        loss = loss + kl_coef * kl.mean()
    return loss, lp, ratio, kl, tr
