"""Flash-GRPO's temporal gradient rectification: ``flowrl.step_weights("flash_grpo", ...,
normalize_over=...)`` against the two peer codes that compute it, each transcribed here in float64.

- UniRL's ``FlashGRPO`` (Tencent-Hunyuan/UniRL pull request 244, branch feature/flashgrpo-unirl of
  NancyFyong/UniRL, commit 2b04387ed69323558fe8ad3de9eb0d6bea93eec2, unirl/algorithms/flashgrpo.py
  lines 190-243): the clipped loss per step times ``coe(i) / mean_{j in pool} coe(j)``, with
  ``coe = 1 / (sqrt(-dt) / std_dev_t + std_dev_t sqrt(-dt) (1 - sigma) / (2 sigma))``, ``std_dev_t =
  eta (sigma_min + (sigma_max - sigma_min) sigma)``, ``sigma_max = sigmas[1]``, ``sigma_min = sigmas[-1]``,
  and each of ``-dt``, ``std_dev_t``, ``sigma`` clamped below at float32's eps; the pool is
  ``rectification_indices`` (its WAN2.1 recipe: steps 0-9 of 20), else the trained steps. Its transition
  (unirl/sde/kernels.py lines 350-451, ``FlashSDEStrategy`` on ``DanceSDEStrategy.step``) is the
  Flow-SDE mean with that std and ``std_var = std_dev_t sqrt(-dt)``.
- Flash-GRPO itself (Shredded-Pork/Flash-GRPO, commit 8cfc97330752136824b0fe40b445155aa63f54f9 as
  stored; UniRL cites bd6051f, not in the stored history), scripts/train_wanx2_1_flash.py lines 983-997:
  ``w = 1 / accelerator.reduce(value_tensor.mean(), reduction="mean")``, loss ``-w value A ratio``
  (clipped), ``value`` their ``coe`` per sample (a hard-coded table of it, checked against flowrl in
  tests/ops/test_step_weights.py) and flow_grpo/diffusers_patch/wan2_1_pipeline_with_logprob2.py lines
  47-52, 81 (std_dev_t with eta = 1, coe).
"""
from __future__ import annotations

import math

import pytest
import torch

from flowrl import step_log_prob, step_weights

F64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps
HALF_ULP32 = 2.0 ** -24  # round to nearest float32: relative error at most this


def schedule(steps=20, shift=5.0):
    t = torch.linspace(1, 0, steps + 1, dtype=F64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def unirl_coefficients(sigmas, steps, eta):
    """UniRL FlashGRPO._rectification_coefficients in float64 (its clamps kept)."""
    s = sigmas.to(F64)
    idx = torch.as_tensor(steps, dtype=torch.int64)
    sigma, sigma_next = s[idx], s[idx + 1]
    sqrt_neg_dt = torch.sqrt((sigma - sigma_next).clamp_min(EPS32))
    sigma_max, sigma_min = s[1], s[-1]
    std_dev_t = ((sigma_min + (sigma_max - sigma_min) * sigma) * eta).clamp_min(EPS32)
    denom = sqrt_neg_dt / std_dev_t + std_dev_t * sqrt_neg_dt * (1.0 - sigma) / (2.0 * sigma.clamp_min(EPS32))
    return 1 / denom


def unirl_rectification(sigmas, steps, pool, eta):
    """UniRL FlashGRPO._rectification_weights: coe(steps) / mean coe(pool), pool None -> steps."""
    norm = unirl_coefficients(sigmas, steps if pool is None else pool, eta)
    return unirl_coefficients(sigmas, steps, eta) / norm.mean().clamp_min(EPS32)


def rel_err(got, want):
    return float(((got.double() - want).abs() / want.abs()).max())


CASES = [(steps, shift, eta) for steps in (10, 20, 50) for shift in (1.0, 3.0, 5.0) for eta in (1.0, 0.7)]


@pytest.mark.parametrize("steps,shift,eta", CASES)
def test_rectification_is_unirls_in_float64(steps, shift, eta):
    """Every step's rectified weight over three pools: UniRL's recipe (the first half), the whole
    schedule, and the trained steps themselves (UniRL's default). Measured worst over CASES: 5.7e-8
    (the float32 rounding of the result; UniRL's own float32 arithmetic is 3.3e-7 from float64)."""
    sigmas = schedule(steps, shift)
    every = list(range(steps))
    for pool in (list(range(steps // 2)), every, None):
        want = unirl_rectification(sigmas, every, pool, eta)
        got = step_weights("flash_grpo", sigmas, torch.arange(steps), mode="flash_sde", noise_level=eta,
                           normalize_over=every if pool is None else pool)
        assert got.loss.dtype == torch.float32
        assert rel_err(got.loss, want) <= HALF_ULP32 * 1.01, (pool, rel_err(got.loss, want))
        assert torch.equal(got.log_ratio, torch.ones(steps))
    # the coefficient itself (no normalize_over) is UniRL's unnormalised one
    raw = step_weights("flash_grpo", sigmas, torch.arange(steps), mode="flash_sde", noise_level=eta).loss
    assert rel_err(raw, unirl_coefficients(sigmas, every, eta)) <= HALF_ULP32 * 1.01


def test_rectification_is_flash_grpos_batch_mean_over_ranks():
    """Flash-GRPO's w = 1 / reduce_mean(per-rank mean coe): flowrl's normalize_over = every rank's step
    indices (equal per-rank batches), each sample weighted w coe at its own step."""
    sigmas, g = schedule(20, 3.0), torch.Generator().manual_seed(0)
    ranks = [torch.randint(0, 10, (4,), generator=g) for _ in range(3)]  # one step per sample, first half
    s = sigmas.to(F64)

    def coe(i):  # their sde_step_with_logprob's last return value, eta = 1
        sigma, sigma_prev = s[i], s[i + 1]
        dt = sigma_prev - sigma
        std_dev_t = s[-1] + (s[1] - s[-1]) * sigma
        return 1 / (torch.sqrt(-1 * dt) / std_dev_t + (std_dev_t * torch.sqrt(-1 * dt) * (1 - sigma)) / (2 * sigma))

    w = 1 / torch.stack([coe(r).mean() for r in ranks]).mean()  # accelerator.reduce(..., "mean")
    pooled = torch.cat(ranks)
    for r in ranks:
        got = step_weights("flash_grpo", sigmas, r, mode="flash_sde", noise_level=1.0, normalize_over=pooled).loss
        assert rel_err(got, w * coe(r)) <= HALF_ULP32 * 1.01


def test_rectified_weights_average_one_over_their_pool_for_every_scheme():
    sigmas, steps = schedule(12, 3.0), torch.arange(12)
    for scheme in ("grpo_guard", "tempflow_grpo", "flash_grpo"):
        raw = step_weights(scheme, sigmas, steps, mode="sde", noise_level=0.7)
        norm = step_weights(scheme, sigmas, steps, mode="sde", noise_level=0.7, normalize_over=steps)
        torch.testing.assert_close(norm.loss.double().mean(), torch.tensor(1.0, dtype=F64), rtol=1e-6, atol=0)
        assert torch.equal(norm.log_ratio, raw.log_ratio)
        one = step_weights(scheme, sigmas, 3, mode="sde", noise_level=0.7, normalize_over=[3])
        assert one.loss.shape == () and abs(float(one.loss) - 1.0) <= 1e-6


def unirl_flash_transition(x, v, x_next, sigmas, i, eta):
    """UniRL FlashSDEStrategy (DanceSDEStrategy.step with the flash std_dev_t, sigma_max = sigmas[1])
    and DanceSDEStrategy.compute_log_prob, mean over elements, in float64."""
    s = sigmas.to(F64)
    sigma, sigma_next = s[i], s[i + 1]
    dt = sigma_next - sigma
    std_dev_t = (s[-1] + (s[1] - s[-1]) * sigma) * eta
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std_var = std_dev_t * torch.sqrt(-dt)
    lp = -((x_next - mean) ** 2) / (2 * std_var**2) - torch.log(std_var) - 0.5 * math.log(2 * math.pi)
    return lp.mean(dim=tuple(range(1, lp.ndim)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_flash_sde_is_unirls_flash_transition(backend):
    """The mode the rectification rides on: flowrl's flash_sde log-prob (float32 inputs, both
    backends) against UniRL's flash transition in float64. Measured: 1.26e-7 (torch), 1.30e-7 (triton)
    at log-probs of 0.07-0.63."""
    sigmas, eta = schedule(10, 5.0), 1.0
    g = torch.Generator().manual_seed(1)
    x, v, eps = (torch.randn(2, 96, generator=g) for _ in range(3))
    for i in (0, 4, 9):
        s = sigmas.to(F64)  # x_next near the transition's mean: a log-prob of size ~1
        std = (s[-1] + (s[1] - s[-1]) * s[i]) * eta * torch.sqrt(s[i] - s[i + 1])
        x_next = (x.double() + v.double() * (s[i + 1] - s[i]) + std * eps.double()).float()
        want = unirl_flash_transition(x.double(), v.double(), x_next.double(), sigmas, i, eta)
        got = step_log_prob(x, v, x_next, sigmas, i, mode="flash_sde", noise_level=eta, backend=backend)
        assert float((got.double() - want).abs().max()) <= 1e-6, i


def test_bad_normalize_over_names_itself():
    sigmas = schedule(10, 3.0)
    flash = dict(mode="flash_sde", noise_level=1.0)
    with pytest.raises(ValueError, match="normalize_over must be a non-empty"):
        step_weights("flash_grpo", sigmas, 0, normalize_over=[], **flash)
    with pytest.raises(ValueError, match="normalize_over must be a non-empty"):
        step_weights("flash_grpo", sigmas, 0, normalize_over=torch.zeros(2, 2, dtype=torch.int64), **flash)
    with pytest.raises(ValueError, match=r"normalize_over must be in \[0, 9\]"):
        step_weights("flash_grpo", sigmas, 0, normalize_over=[0, 10], **flash)
    with pytest.raises(ValueError, match=r"normalize_over must be in \[0, 9\]"):
        step_weights("flash_grpo", sigmas, 0, normalize_over=torch.tensor([-1, 3]), **flash)
    with pytest.raises(TypeError, match="normalize_over must be an integer tensor"):
        step_weights("flash_grpo", sigmas, 0, normalize_over=torch.tensor([0.0, 1.0]), **flash)
    with pytest.raises(TypeError, match="normalize_over must hold ints"):
        step_weights("flash_grpo", sigmas, 0, normalize_over=[0, True], **flash)
    with pytest.raises(TypeError, match="normalize_over must be an integer tensor"):
        step_weights("flash_grpo", sigmas, 0, normalize_over="0:10", **flash)
    # a pool whose weights are all 0: cps' last step has std 0, flash_sde at noise level 0 every step
    with pytest.raises(ValueError, match=r"normalize_over.*mode='cps'.*must be > 0"):
        step_weights("flash_grpo", sigmas, 0, mode="cps", noise_level=0.5, normalize_over=[9])
    with pytest.raises(ValueError, match=r"normalize_over.*noise_level=0.0.*must be > 0"):
        step_weights("flash_grpo", sigmas, 0, mode="flash_sde", noise_level=0.0, normalize_over=[0, 1])
