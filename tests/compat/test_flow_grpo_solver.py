"""flowrl.compat.flow_grpo: Flow-GRPO's newer step functions, checked against transcriptions below.

Peer: yifan123/flow_grpo at commit 54809b5fcf4d3930d2a17fa553928704bd0b719e,
- flow_grpo/diffusers_patch/solver.py: ``flow_grpo_step``, ``dance_grpo_step``, ``ddim_step`` (with its
  ``convert_model_output`` and ``ddim_update``) and the loop that calls them, ``run_sampling`` (used by
  ``pipeline_with_logprob`` in flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py, which passes
  ``self.scheduler.sigmas.float()`` as the schedule);
- flow_grpo/diffusers_patch/sd3_sde_with_logprob.py: ``ode_step_with_logprob``.

The ``peer_*`` functions are written here from those files' math, operation for operation and dtype for
dtype (the peer is not a dependency). Run ``pytest tests/compat/test_flow_grpo_solver.py -s`` to print the
measured agreement quoted in docs/integration.md.
"""
import math

import pytest
import torch

import flowrl
from flowrl.compat.flow_grpo import dance_grpo_step, ddim_noise_level, ddim_step, flow_grpo_step, ode_step_with_logprob

diffusers = pytest.importorskip("diffusers")
from diffusers import FlowMatchEulerDiscreteScheduler as DiffusersScheduler  # noqa: E402
from diffusers.utils.torch_utils import randn_tensor  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
TOL = dict(rtol=2e-5, atol=2e-5)  # within float32 rounding, as tests/compat/test_compat.py


# ----------------------------------------------------------------------------------------- peers
def _mean_over_elements(t):
    return t.mean(dim=tuple(range(1, t.ndim)))


def peer_flow_grpo_step(model_output, latents, eta, sigmas, index, prev_sample, generator=None):
    sigma = sigmas[index].to(model_output.device)
    sigma_next = sigmas[index + 1].to(model_output.device)
    dt = sigma_next - sigma
    x0 = latents - sigma * model_output
    s = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1].item(), sigma))) * eta
    mean = latents * (1 + s**2 / (2 * sigma) * dt) + model_output * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    if prev_sample is None:
        eps = randn_tensor(model_output.shape, generator=generator, device=model_output.device, dtype=model_output.dtype)
        prev_sample = mean + s * torch.sqrt(-1 * dt) * eps
    std = s * torch.sqrt(-1 * dt)
    lp = -((prev_sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    return prev_sample, x0, _mean_over_elements(lp)


def peer_dance_grpo_step(model_output, latents, eta, sigmas, index, prev_sample):
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    mean = latents + dsigma * model_output
    x0 = latents - sigma * model_output
    std = eta * math.sqrt(sigma - sigmas[index + 1])
    score = -(latents - x0 * (1 - sigma)) / sigma**2
    mean = mean + (-0.5 * eta**2 * score) * dsigma
    if prev_sample is None:
        prev_sample = mean + torch.randn_like(mean) * std
    # the peer's statement ends here; its "- log(std) - log(sqrt(2 pi))" is a separate expression
    lp = -((prev_sample.detach().to(F32) - mean.to(F32)) ** 2) / (2 * (std**2))
    return prev_sample, x0, _mean_over_elements(lp)


def peer_ddim_update(x0, sigmas64, index, sample, eta, noise=None):
    t, s = sigmas64[index + 1], sigmas64[index]
    std = eta * t
    dt_sqrt = torch.sqrt(1.0 - t**2 * (1 - s) ** 2 / (s**2 * (1 - t) ** 2))
    rho = std * dt_sqrt
    x1 = (sample - (1 - s) * x0) / s
    if noise is None:
        noise = torch.randn_like(x0)
    mean = (1 - t) * x0 + torch.sqrt(t**2 - rho**2) * x1
    return mean + rho * noise, mean, std, dt_sqrt


def peer_ddim_step(model_output, latents, eta, sigmas, index, prev_sample, score_given=False):
    """Flow-GRPO's ddim_step. ``score_given=True`` is not the peer: it scores the given prev_sample
    with the peer's mean and std (the peer itself discards it and scores a fresh sample)."""
    x0 = latents - sigmas[index] * model_output
    drawn, mean, std, dt_sqrt = peer_ddim_update(x0, sigmas.to(torch.float64), index, latents, eta)
    if not score_given:
        prev_sample = drawn  # the peer's assignment overwrites the argument
    lp = (-((prev_sample.detach() - mean) ** 2) / (2 * ((std * dt_sqrt) ** 2)) - torch.log(std * dt_sqrt)
          - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return prev_sample, x0, _mean_over_elements(lp)


def peer_ode_step_with_logprob(self, model_output, mean_model_output, timestep, sample, noise_level=0.7,
                               prev_sample=None, generator=None, sde_type="sde", return_sqrt_dt=False):
    model_output, sample = model_output.float(), sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    step_index = [self.index_for_timestep(t) for t in timestep]
    shape = (-1, *([1] * (len(sample.shape) - 1)))
    sigma = self.sigmas[step_index].view(shape)
    sigma_prev = self.sigmas[[i + 1 for i in step_index]].view(shape)
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, self.sigmas[1].item(), sigma))) * noise_level
    if prev_sample is None:
        prev_sample = sample + model_output * dt
    mean = sample + mean_model_output * dt
    lp = _mean_over_elements(-((prev_sample.detach() - mean) ** 2))
    if return_sqrt_dt:
        return prev_sample, lp, mean, std_dev_t, torch.sqrt(-1 * dt)
    return prev_sample, lp, mean, std_dev_t


PEERS = {"flow": (flow_grpo_step, peer_flow_grpo_step), "dance": (dance_grpo_step, peer_dance_grpo_step),
         "ddim": (ddim_step, peer_ddim_step)}


# ------------------------------------------------------------------------------------- fixtures
def scheduler(steps=10, shift=3.0):
    sched = DiffusersScheduler(shift=shift)
    sched.set_timesteps(steps)
    return sched


def schedule(steps=10):
    return scheduler(steps).sigmas.float()  # what pipeline_with_logprob hands run_sampling


def tensors(shape=(3, 4, 8, 8), dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def run_peer(name, v, x, eta, sigmas, i, prev, seed):
    fn = PEERS[name][1]
    if name == "flow":
        return fn(v, x, eta, sigmas, i, prev, generator=gen(seed))
    torch.manual_seed(seed)
    return fn(v, x, eta, sigmas, i, prev)


def run_ours(name, v, x, eta, sigmas, i, prev, seed, **kw):
    fn = PEERS[name][0]
    if name == "flow":
        return fn(v, x, eta, sigmas, i, prev, gen(seed), **kw)
    torch.manual_seed(seed)
    return fn(v, x, eta, sigmas, i, prev, **kw)


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", list(PEERS))
@pytest.mark.parametrize("eta", [0.3, 0.7, 1.0])
def test_solver_steps_match_the_peer(name, eta):
    """Rollout (same noise stream) and recompute, float32 inputs as run_sampling passes them: within
    float32 rounding on every step the peer gives a finite log-prob."""
    sigmas = schedule()
    x, v = tensors()
    worst = 0.0
    last = len(sigmas) - 1 if name != "ddim" else len(sigmas) - 2  # ddim's last step: the peer is NaN
    for i in range(last):
        ours, peer = run_ours(name, v, x, eta, sigmas, i, None, i), run_peer(name, v, x, eta, sigmas, i, None, i)
        assert len(ours) == len(peer) == 3
        for label, a, b in zip(("prev_sample", "pred_original_sample", "log_prob"), ours, peer):
            assert a.shape == b.shape and a.dtype == b.dtype == F32, label
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name} step {i} {label}: {m}")
            worst = max(worst, (a - b).abs().max().item())
        # the recompute scores the given sample (ddim: against the peer's formula applied to it)
        prev = peer[0]
        v1, v2 = v.clone().requires_grad_(), v.clone().requires_grad_()
        again = PEERS[name][0](v1, x, eta, sigmas, i, prev)
        ref = (peer_ddim_step(v2, x, eta, sigmas, i, prev, score_given=True) if name == "ddim"
               else PEERS[name][1](v2, x, eta, sigmas, i, prev))
        assert again[0] is prev
        torch.testing.assert_close(again[2].detach(), ref[2].detach(), **TOL)
        again[2].sum().backward()
        ref[2].sum().backward()
        # the gradient is r / std^2: the means' float32 rounding over a small std (ddim's step 8: std
        # 2e-3) moves it by up to 5.4e-5 of its largest element (measured), hence a scale-relative atol
        torch.testing.assert_close(v1.grad, v2.grad, rtol=1e-4, atol=1e-4 * v2.grad.abs().max().item())
    print(f"\n{name} eta={eta}: max |flowrl - peer| over the returns {worst:.2g}")


def test_dance_grpo_step_log_prob_is_the_kernel_kind():
    """The peer's dance log-prob is -r^2 / (2 std^2) only; flowrl's Gaussian kind is lower by the constants."""
    sigmas = schedule()
    x, v = tensors()
    torch.manual_seed(0)
    prev, _, lp = dance_grpo_step(v, x, 0.7, sigmas, 3, None)
    gaussian = flowrl.step_log_prob(x, v, prev, sigmas, 3, mode="dance", noise_level=0.7)
    std = 0.7 * math.sqrt(float(sigmas[3] - sigmas[4]))
    torch.testing.assert_close(gaussian, lp - math.log(std) - math.log(math.sqrt(2 * math.pi)), **TOL)
    assert torch.equal(lp, flowrl.step_log_prob(x, v, prev, sigmas, 3, mode="dance", noise_level=0.7, log_prob_kind="kernel"))


def test_ddim_step_is_cps_at_the_mapped_noise_level_and_first_order_dpm_sde_at_eta_one():
    sigmas = schedule()
    x, v = tensors()
    for i in range(len(sigmas) - 2):
        s, t = float(sigmas[i]), float(sigmas[i + 1])
        q = t * (1 - s) / (s * (1 - t))
        eta_c = ddim_noise_level(sigmas, i, 0.7)
        assert t * math.sin(eta_c * math.pi / 2) == pytest.approx(0.7 * t * math.sqrt(1 - q * q), rel=1e-12)
        torch.manual_seed(i)
        prev, _, lp = ddim_step(v, x, 1.0, sigmas, i, None)
        dpm = flowrl.step_log_prob(x, v, prev, sigmas, i, mode="dpm_sde", noise_level=1.0)
        torch.testing.assert_close(lp, dpm, rtol=1e-4, atol=1e-4)
    # eta = 0 is the Euler step (flowrl's ode): deterministic
    prev, _, lp = ddim_step(v, x, 0.0, sigmas, 4, None)
    euler = flowrl.sde_step(x, v, sigmas, 4, mode="ode").prev_sample
    torch.testing.assert_close(prev, euler, **TOL)
    assert torch.equal(lp, torch.zeros(3))


@pytest.mark.parametrize("name", list(PEERS))
def test_deterministic_steps_give_zero_where_the_peer_gives_nan(name):
    sigmas = schedule()
    x, v = tensors()
    peer_lp = run_peer(name, v, x, 0.0, sigmas, 3, None, 0)[2]
    assert torch.isnan(peer_lp).all()
    prev, x0, lp = run_ours(name, v, x, 0.0, sigmas, 3, None, 0)
    assert torch.equal(lp, torch.zeros(3))
    torch.testing.assert_close(prev, run_peer(name, v, x, 0.0, sigmas, 3, None, 0)[0], **TOL)
    if name == "ddim":  # the last step (sigma' = 0): std 0 at any eta
        last = len(sigmas) - 2
        assert torch.isnan(run_peer(name, v, x, 0.7, sigmas, last, None, 0)[2]).all()
        prev, _, lp = ddim_step(v, x, 0.7, sigmas, last, None)
        assert torch.equal(lp, torch.zeros(3))
        torch.testing.assert_close(prev, run_peer(name, v, x, 0.7, sigmas, last, None, 0)[0], **TOL)


@pytest.mark.parametrize("name", list(PEERS))
def test_out_dtype_and_peer_compatible(name):
    sigmas = schedule()
    x, v = tensors()
    prev, _, lp = run_ours(name, v, x, 0.7, sigmas, 2, None, 1, out_dtype=BF16)
    assert prev.dtype == BF16
    assert torch.equal(PEERS[name][0](v, x, 0.7, sigmas, 2, prev.float())[2], lp)  # scored as stored
    prev_c, _, lp_c = run_ours(name, v, x, 0.7, sigmas, 2, None, 1, peer_compatible=True)
    peer = run_peer(name, v, x, 0.7, sigmas, 2, None, 1)
    assert prev_c.dtype == F32
    torch.testing.assert_close(prev_c, peer[0], **TOL)
    torch.testing.assert_close(lp_c, peer[2], **TOL)
    with pytest.raises(ValueError, match="peer_compatible=True with out_dtype"):
        run_ours(name, v, x, 0.7, sigmas, 2, None, 1, peer_compatible=True, out_dtype=BF16)


def _run_sampling(step_fn, v_pred_fn, z, sigmas, eta, **step_kwargs):
    """Flow-GRPO's run_sampling loop for one solver: float32 step, cast back to z's dtype, stored."""
    dtype = z.dtype
    all_latents, all_log_probs = [z], []
    for i in range(len(sigmas) - 1):
        pred = v_pred_fn(z.to(dtype), sigmas[i])
        z, _, log_prob = step_fn(pred.float(), z.float(), eta, sigmas, i, None, **step_kwargs)
        z = z.to(dtype)
        all_latents.append(z)
        all_log_probs.append(log_prob)
    return all_latents, all_log_probs


@pytest.mark.parametrize("name", list(PEERS))
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_run_sampling_loop_ratio_exactly_one_with_out_dtype(name, dtype):
    """run_sampling with the adapter and out_dtype=dtype in its call; the recompute scores each stored
    latent with the same velocity: ratio exactly 1 on every step with a noise (ddim's last is
    deterministic: log-prob 0 on both sides). Import swap alone in bf16 (and the peer): not 1."""
    sigmas = schedule(12)
    w = torch.randn(16, 16, generator=gen(9)) / 4

    def v_pred_fn(z, sigma):
        return (z.float() @ w.to(z.dtype).float() * (1 + sigma)).to(z.dtype)

    z0 = torch.randn(2, 4, 16, generator=gen(1)).to(dtype)
    step_fn = PEERS[name][0]
    for variant in ("flowrl", "import_only", "peer"):
        torch.manual_seed(5)
        if variant == "flowrl":
            lat, lps = _run_sampling(step_fn, v_pred_fn, z0, sigmas, 0.7, out_dtype=dtype)
        elif variant == "import_only":
            lat, lps = _run_sampling(step_fn, v_pred_fn, z0, sigmas, 0.7)
        else:
            peer = PEERS[name][1]
            lat, lps = _run_sampling(lambda *a: peer(*a) if name != "flow" else peer(*a, None), v_pred_fn, z0, sigmas, 0.7)
        worst = 0.0
        steps = len(sigmas) - 1 if name != "ddim" or variant != "peer" else len(sigmas) - 2
        for i in range(steps):
            pred = v_pred_fn(lat[i], sigmas[i])
            again = step_fn(pred.float(), lat[i].float(), 0.7, sigmas, i, lat[i + 1].float())[2]
            worst = max(worst, (torch.exp(again - lps[i]) - 1).abs().max().item())
        print(f"\n{name} {dtype} {variant}: max |ratio - 1| = {worst:.2g}")
        if variant == "flowrl" or dtype == F32 and variant == "import_only":
            assert worst == 0.0
        elif dtype == BF16:
            assert worst > 1e-4


def test_ode_step_with_logprob_matches_the_peer():
    sched = scheduler()
    x, v = tensors()
    v_mean = v + 0.1 * tensors(seed=1)[1]
    for per_sample in (False, True):
        t = sched.timesteps[[1, 5, 8]] if per_sample else sched.timesteps[4].unsqueeze(0)
        ours = ode_step_with_logprob(sched, v, v_mean, t, x, return_sqrt_dt=True)
        peer = peer_ode_step_with_logprob(sched, v, v_mean, t, x, return_sqrt_dt=True)
        for label, a, b in zip(("prev_sample", "log_prob", "prev_sample_mean", "std_dev_t", "sqrt_dt"), ours, peer):
            assert a.shape == b.shape and a.dtype == b.dtype, label
            torch.testing.assert_close(a, b, **TOL)
        assert len(ode_step_with_logprob(sched, v, v_mean, t, x)) == 4
        # recompute from the stored sample, differentiable in mean_model_output
        m1, m2 = v_mean.clone().requires_grad_(), v_mean.clone().requires_grad_()
        a = ode_step_with_logprob(sched, v, m1, t, x, prev_sample=peer[0])
        b = peer_ode_step_with_logprob(sched, v, m2, t, x, prev_sample=peer[0])
        for p, q in zip(a, b):
            torch.testing.assert_close(p.detach(), q.detach(), **TOL)
        a[1].sum().backward()
        b[1].sum().backward()
        torch.testing.assert_close(m1.grad, m2.grad, rtol=1e-4, atol=1e-9)
    # sde_type is not read (std_dev_t is the sde formula either way), as in the peer
    t = sched.timesteps[:1]
    assert torch.equal(ode_step_with_logprob(sched, v, v_mean, t, x, sde_type="cps")[3],
                       ode_step_with_logprob(sched, v, v_mean, t, x)[3])


def test_ode_step_with_logprob_rounded_sample_ratio_exactly_one():
    sched = scheduler()
    x, v = tensors(dtype=BF16)
    t = sched.timesteps[[2, 6, 9]]
    prev, lp, _, _ = ode_step_with_logprob(sched, v, v, t, x)
    assert prev.dtype == BF16
    again = ode_step_with_logprob(sched, v, v, t, x, prev_sample=prev)[1]
    assert torch.equal(again, lp)
    # peer_compatible: the float32 sample and its residual (0 with mean_model_output = model_output)
    prev_c, lp_c, _, _ = ode_step_with_logprob(sched, v, v, t, x, peer_compatible=True)
    peer = peer_ode_step_with_logprob(sched, v, v.float(), t, x)
    assert prev_c.dtype == F32
    torch.testing.assert_close(prev_c, peer[0], **TOL)
    torch.testing.assert_close(lp_c, peer[1], **TOL)
    with pytest.raises(ValueError, match="peer_compatible=True with out_dtype"):
        ode_step_with_logprob(sched, v, v, t, x, peer_compatible=True, out_dtype=BF16)


@pytest.mark.parametrize(
    "fn, kwargs, error, match",
    [
        (ddim_step, dict(index=torch.tensor([1, 2, 3])), ValueError, "index"),
        (ddim_step, dict(eta=3.0, index=0), ValueError, "eta"),
        (ddim_step, dict(prev_sample=torch.zeros(3, 4, 8, 8), peer_compatible=True), ValueError, "prev_sample"),
        (flow_grpo_step, dict(eta=-0.1), ValueError, "eta"),
        (flow_grpo_step, dict(index=10), ValueError, "index"),
        (dance_grpo_step, dict(sigmas=[1.0, 0.0]), TypeError, "sigmas"),
        (dance_grpo_step, dict(sigmas=torch.tensor([1.0, 0.5, 0.7, 0.0])), ValueError, "sigmas"),
        (dance_grpo_step, dict(latents=torch.zeros(3, 4)), ValueError, "model_output"),
        (flow_grpo_step, dict(prev_sample=torch.zeros(1)), ValueError, "prev_sample"),
        (flow_grpo_step, dict(out_dtype=torch.int8), TypeError, "out_dtype"),
    ],
)
def test_solver_bad_input_names_the_argument(fn, kwargs, error, match):
    x, v = tensors()
    args = dict(model_output=v, latents=x, eta=0.7, sigmas=schedule(), index=2, prev_sample=None)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        fn(**args)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(sde_type="ode"), ValueError, "sde_type"),
        (dict(mean_model_output=torch.zeros(2, 4, 8, 8)), ValueError, "mean_model_output"),
        (dict(noise_level=-1.0), ValueError, "noise_level"),
        (dict(timestep=torch.tensor([123.456])), ValueError, "timestep"),
        (dict(self=object()), TypeError, "self"),
    ],
)
def test_ode_step_bad_input_names_the_argument(kwargs, error, match):
    sched = scheduler()
    x, v = tensors()
    args = dict(self=sched, model_output=v, mean_model_output=v, timestep=sched.timesteps[:1], sample=x)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ode_step_with_logprob(**args)


@pytest.mark.parametrize("name", ["flow", "dance"])
def test_per_sample_index_tensor(name):
    """flow_grpo_step and dance_grpo_step also take one step per sample (an int64 [B] index)."""
    sigmas = schedule()
    x, v = tensors()
    idx = torch.tensor([0, 4, 9])
    prev = run_ours(name, v, x, 0.7, sigmas, idx, None, 2)[0]
    lp = PEERS[name][0](v, x, 0.7, sigmas, idx, prev)[2]
    for row, i in enumerate(idx.tolist()):
        one = PEERS[name][0](v[row:row + 1], x[row:row + 1], 0.7, sigmas, i, prev[row:row + 1])
        torch.testing.assert_close(one[2], lp[row:row + 1], rtol=0, atol=0)
        torch.testing.assert_close(one[1], x[row:row + 1] - sigmas[i] * v[row:row + 1], rtol=0, atol=0)
