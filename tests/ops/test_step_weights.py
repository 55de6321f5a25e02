"""flowrl.step_weights: the per-step weights GRPO variants put on the log-ratio or the loss, each
checked against the peer's code, transcribed here in float64:

- GRPO-Guard: verl-omni ``GRPOGuardLoss`` (verl-project/verl-omni, verl_omni/trainer/diffusion/
  diffusion_algos.py, commit a1139ba): ``scale = sqrt_dt * sigma_t``, ``ratio = exp((log_ratio +
  mean_bias) * scale)``, ``pg_loss = mean(max(-A ratio, -A clip(ratio))) / sqrt_dt**2``; Flow-Factory's
  ``GRPOGuardTrainer`` (X-GenGroup/Flow-Factory, src/flow_factory/trainers/grpo.py) uses the same
  ``scale_factor = sqrt(-dt) * std_dev_t``.
- TempFlow-GRPO: scripts/train_flux_pr.py (Shredded-Pork/TempFlow-GRPO): the clipped loss times
  ``1.73 * std_dev_t`` where sde_step_with_logprob returns ``std_dev_t * sqrt(-dt)``.
- Flash-GRPO: scripts/train_wanx2_1_flash.py and flow_grpo/diffusers_patch/
  wan2_1_pipeline_with_logprob2.py (Shredded-Pork/Flash-GRPO): the loss times ``coe = 1 / (sqrt(-dt) /
  std_dev_t + std_dev_t sqrt(-dt) (1 - sigma) / (2 sigma))`` over its batch mean, std_dev_t their
  ``sigma_min + (sigma_max - sigma_min) sigma``.
"""
from __future__ import annotations

import pytest
import torch

try:  # flowrl's diffusers extra is optional: only the tests that use it skip without it
    import diffusers
except ImportError:
    diffusers = None

import flowrl
from flowrl import step_kl, step_log_prob, step_weights
from flowrl.contract import Mode, Schedule
from mode_coverage import every_mode_but, noise_levels

F64 = torch.float64
# step_weights reads a flow schedule: the modes of another schedule kind are refused (a new Mode joins MODES)
MODES_ELSEWHERE = {m.label: "not a flow schedule (MODE_RULES), so step_weights refuses it: tests/ops/test_step_weights.py, "
                            "test_bad_arguments_name_themselves" for m in Mode if m.rules.schedule is not Schedule.SIGMAS}
MODES = every_mode_but(MODES_ELSEWHERE)
ETA = noise_levels({"sde": 0.7, "dance": 0.5, "cps": 0.5, "flash_sde": 0.8, "dpm_sde": 1.0, "ode": 0.0}, MODES)
needs_diffusers = pytest.mark.skipif(diffusers is None, reason="needs diffusers")


def schedule(steps=10, shift=3.0):
    t = torch.linspace(1, 0, steps + 1, dtype=F64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def flow_grpo_mean_std(x, v, sigmas, i, eta):
    """Flow-GRPO's sde step (std_dev_t = eta sqrt(sigma / (1 - sigma)), sigma = 1 -> sigmas[1])."""
    s64 = sigmas.to(F64)
    sigma, sigma_prev = s64[i], s64[i + 1]
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, s64[1], sigma))) * eta
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t, torch.sqrt(-dt)


def verl_grpo_guard_loss(old_log_prob, log_prob, advantages, old_mean, mean, std_dev_t, sqrt_dt, clip=0.2):
    """verl-omni GRPOGuardLoss's policy loss (adv_clip_max not reached here)."""
    scale = sqrt_dt.mean() * std_dev_t.mean()
    mean_diff_sq = (mean - old_mean).pow(2).mean(dim=tuple(range(1, mean.ndim)))
    ratio_mean_bias = mean_diff_sq / (2 * scale**2)
    ratio = torch.exp((log_prob - old_log_prob + ratio_mean_bias) * scale)
    per_elem = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip, 1 + clip))
    return torch.mean(per_elem) / (sqrt_dt.mean() ** 2)


@pytest.mark.parametrize("i", [0, 3, 8])
def test_grpo_guard_weights_reproduce_verl_omnis_loss(i):
    """flowrl's log-probs, step_kl (the mean-bias term) and step_weights give verl-omni's loss."""
    sigmas, eta = schedule(), 0.7
    g = torch.Generator().manual_seed(i)
    x, v_old, v, x_next = (torch.randn(4, 3, 50, generator=g, dtype=F64) for _ in range(4))
    v = v_old + 0.05 * v  # a policy near the rollout's
    adv = torch.randn(4, generator=g, dtype=F64)
    mean_old, s, sqrt_dt = flow_grpo_mean_std(x, v_old, sigmas, i, eta)
    mean_new, _, _ = flow_grpo_mean_std(x, v, sigmas, i, eta)
    options = dict(mode="sde", noise_level=eta, backend="torch")
    old_lp = step_log_prob(x, v_old, x_next, sigmas, i, **options)
    new_lp = step_log_prob(x, v, x_next, sigmas, i, **options)
    want = verl_grpo_guard_loss(old_lp, new_lp, adv, mean_old, mean_new, s, sqrt_dt)
    w = step_weights("grpo_guard", sigmas, i, mode="sde", noise_level=eta)
    bias = step_kl(x, v, v_old, sigmas, i, **options)  # |mu - mu_old|^2 / (2 std^2), mean over elements
    ratio = torch.exp((new_lp - old_lp + bias) * w.log_ratio.double())
    got = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))) * w.loss.double()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    # the weights themselves: Flow-Factory's scale_factor sqrt(-dt) * std_dev_t, and verl's 1 / sqrt_dt**2
    torch.testing.assert_close(w.log_ratio.double(), sqrt_dt * s, rtol=1e-6, atol=0)
    torch.testing.assert_close(w.loss.double(), 1 / sqrt_dt**2, rtol=1e-6, atol=0)


def test_tempflow_weight_is_their_returned_std():
    sigmas, eta = schedule(), 0.9
    x = torch.zeros(1, 4, dtype=F64)
    steps = torch.arange(10)
    w = step_weights("tempflow_grpo", sigmas, steps, mode="sde", noise_level=eta)
    for i in range(10):
        _, s, sqrt_dt = flow_grpo_mean_std(x, x, sigmas, i, eta)
        torch.testing.assert_close(w.loss[i].double(), s * sqrt_dt, rtol=1e-6, atol=0)
    assert torch.equal(w.log_ratio, torch.ones(10))
    # their loss: -1.73 * std_dev_t * adv * ratio, per step
    adv, ratio = torch.tensor([0.5, -1.0]), torch.tensor([1.1, 0.95])
    one = step_weights("tempflow_grpo", sigmas, torch.tensor([2, 7]), mode="sde", noise_level=eta)
    torch.testing.assert_close(-1.73 * one.loss * adv * ratio,
                               -1.73 * w.loss[torch.tensor([2, 7])] * adv * ratio)


def flash_coe(sigmas, i):
    s64 = sigmas.to(F64)
    sigma, sigma_prev = s64[i], s64[i + 1]
    dt = sigma_prev - sigma
    std_dev_t = s64[-1] + (s64[1] - s64[-1]) * sigma
    return 1 / (torch.sqrt(-1 * dt) / std_dev_t + (std_dev_t * torch.sqrt(-1 * dt) * (1 - sigma)) / (2 * sigma))


@needs_diffusers
def test_flash_grpo_weight_is_their_coe_and_their_table():
    sigmas = schedule(20)
    w = step_weights("flash_grpo", sigmas, torch.arange(20), mode="flash_sde", noise_level=1.0)
    for i in range(20):
        torch.testing.assert_close(w.loss[i].double(), flash_coe(sigmas, i), rtol=1e-6, atol=0)
    # Their hard-coded value_dict (train_wanx2_1_flash.py) for Wan's 20-step UniPC flow schedule,
    # shift 3: diffusers' UniPCMultistepScheduler table gives the same numbers within 0.3% (their
    # timesteps from step 2 on are one lower than diffusers', so their sigmas differ slightly).
    theirs = [7.4770, 7.0414, 6.6112, 6.1867, 5.7682, 5.3559, 4.9502, 4.5513, 4.1596, 3.7754]
    unipc = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    unipc.set_timesteps(20)
    table = unipc.sigmas.float()
    ours = step_weights("flash_grpo", table, torch.arange(10), mode="flash_sde", noise_level=1.0).loss
    torch.testing.assert_close(ours.double(), torch.tensor(theirs, dtype=F64), rtol=3e-3, atol=0)


def test_flash_weight_is_zero_on_deterministic_steps_and_weights_are_finite():
    sigmas = schedule()
    steps = torch.arange(10)
    cps = step_weights("flash_grpo", sigmas, steps, mode="cps", noise_level=0.5)
    assert cps.loss[-1] == 0 and (cps.loss[:-1] > 0).all()  # cps' last step (sigma' = 0) has std 0
    for scheme in flowrl.ops.weights.SCHEMES:
        for mode, eta in ETA.items():
            w = step_weights(scheme, sigmas, steps, mode=mode, noise_level=eta)
            assert torch.isfinite(w.log_ratio).all() and torch.isfinite(w.loss).all(), (scheme, mode)
            assert w.loss.dtype == torch.float32 and w.loss.shape == (10,)
    one = step_weights("grpo_guard", sigmas, 3)
    assert one.loss.shape == () and one.log_ratio.shape == ()


def test_bad_arguments_name_themselves():
    sigmas = schedule()
    with pytest.raises(ValueError, match="scheme"):
        step_weights("ppo", sigmas, 0)
    with pytest.raises(ValueError, match="mode"):
        step_weights("grpo_guard", sigmas, 0, mode="heun")
    for mode in MODES_ELSEWHERE:  # ddim: an alpha-bar table
        with pytest.raises(ValueError, match=f"flow schedule.*mode={mode!r}"):
            step_weights("grpo_guard", sigmas, 0, mode=mode, noise_level=0.5)
    with pytest.raises(ValueError, match="step_index"):
        step_weights("grpo_guard", sigmas, 10)
    with pytest.raises(ValueError, match="noise_level"):
        step_weights("grpo_guard", sigmas, 0, noise_level=-1.0)
