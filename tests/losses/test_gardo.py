"""GARDO's per-sample and gated KL (docs/losses.md, Per-sample and gated KL (GARDO)): the GRPO family's
``kl_coef`` as a [B] tensor, and ``flowrl.advantages``' gate helpers, against float64 transcriptions of
GARDO written below (not imported), on both backends (Triton under the interpreter on CPU).

The peer: yifan123/flow_grpo @ 94e23ee5405ab7241fc1f75d30cac8147e2b1f53 (its issue 216),

- scripts/train_sd3_gardo.py ``RiskCompensator`` (the adaptive fraction ``beta``: base 0.1, alpha 0.1,
  clipped to [0.02, 0.2], a window of the last 20 means of the non-negative uncertainties);
- the same file's stat-tracking block in ``main``: per reward (aesthetic, imagereward, the main one) each
  sample's rank in a descending ``torch.sort`` of the gathered batch (1 the largest), ``reward_std =
  rank_main - (rank_aes + rank_ir) / 2`` ("uncertainty estimation"), ``dynamic_controller.update`` on
  the non-negative ones, ``threshold = np.percentile(those, 100 - beta * 100)``, the gate ``reward_std >
  threshold``;
- the training loop: ``idx = sample["reward_std"] > 0``, ``policy_loss = (std_dev_t / mean(std_dev_t)) *
  max(unclipped, clipped)``, ``kl_loss = mean((prev_sample_mean[idx] - prev_sample_mean_ref[idx])^2 /
  (2 std_dev_t[idx]^2))``, ``loss = mean(policy_loss) + beta * mean(kl_loss)`` when a sample is gated,
  else ``mean(policy_loss)``;
- flow_grpo/diffusers_patch/sd3_sde_with_logprob.py (stored @ 54809b5fcf4d3930d2a17fa553928704bd0b719e,
  the version with GARDO's call signature): std_dev_t = sqrt(sigma / (1 - sigma)) * noise_level (sigma = 1
  read as sigmas[1]), the mean and the per-element-mean Gaussian log-prob with std_dev_t sqrt(-dt).

flowrl reproduces GARDO's loss with ``kl_coef = gardo_kl_coef(gate, beta) * D`` (GARDO's KL divides by
std_dev_t^2 = std^2 / D, as Flow-GRPO's) and ``rollout_is_weights = std_dev_t / mean(std_dev_t)``.
"""
import os
import sys

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import flowrl
from flowrl import losses as L
from flowrl import oracle
from flowrl.advantages import GardoGateFraction, gardo_kl_coef, gardo_kl_gate, gardo_uncertainty

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_cases import BACKENDS, DEVICE, perturbed, rollout  # noqa: E402

F64 = torch.float64
B = 6
SHAPE = (B, 2, 750)
STEPS = torch.tensor([0, 2, 4, 5, 7, 8])  # per-sample steps: GARDO's std weights differ per sample
ETA = 0.7
GATE = torch.tensor([True, False, True, True, False, False])


# ------------------------------------------------------------------------- GARDO, transcribed (float64)


def peer_sde_step(sigmas, step_index, sample, model_output, prev_sample, noise_level):
    """flow_grpo sde_step_with_logprob (sde_type 'sde'): (log_prob [B], prev_sample_mean, std_dev_t [B,1,1])."""
    sigmas = sigmas.to(F64)
    view = (-1,) + (1,) * (sample.ndim - 1)
    sigma = sigmas[step_index].view(view)
    sigma_prev = sigmas[step_index + 1].view(view)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (sample * (1 + std_dev_t ** 2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt)
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(np.pi))))
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t


def peer_gardo_loss(sigmas, step_index, x, v, prev, v_ref, old_log_prob, advantages, clip_range, beta, gate):
    """train_sd3_gardo.py's training-loop block (the advantages already clamped: passed as given): the
    loss, and its two terms (mean(policy_loss), the KL term) for the test's messages."""
    log_prob, prev_sample_mean, std_dev_t = peer_sde_step(sigmas, step_index, x, v, prev, ETA)
    with torch.no_grad():
        _, prev_sample_mean_ref, _ = peer_sde_step(sigmas, step_index, x, v_ref, prev, ETA)
    idx = gate
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    s = std_dev_t[:, 0, 0]
    policy_loss = (s / torch.mean(s)) * torch.maximum(unclipped_loss, clipped_loss)
    if True in idx:
        kl_loss = torch.mean((torch.square(prev_sample_mean[idx] - prev_sample_mean_ref[idx]))
                             / (2 * std_dev_t[idx] ** 2))
        loss = torch.mean(policy_loss) + beta * torch.mean(kl_loss)
    else:
        loss = torch.mean(policy_loss)
    return loss, torch.mean(policy_loss).detach(), (loss - torch.mean(policy_loss)).detach()


def peer_ranks(r):
    """The descending rank of each entry, 1 the largest (their sort, here stable: ties in index order)."""
    _, indices = torch.sort(torch.as_tensor(r), descending=True, stable=True)
    ranks = torch.empty_like(torch.as_tensor(r)).long()
    ranks[indices] = torch.arange(1, len(r) + 1)
    return ranks.float()


def peer_uncertainty(aesthetic, imagereward, main):
    reward_std = [peer_ranks(aesthetic), peer_ranks(imagereward), peer_ranks(main)]
    return reward_std[-1] - (reward_std[0] + reward_std[1]) / 2


class PeerRiskCompensator:
    """RiskCompensator (train_sd3_gardo.py), as written."""

    def __init__(self, base=0.1, beta=0.1):
        self.risk_buffer = []
        self.base = base
        self.alpha = 0.1
        self.beta = beta
        self.beta_min = 0.02
        self.beta_max = 0.2

    def update(self, pad_scores):
        if len(self.risk_buffer) == 0:
            self.beta = self.base
        elif np.mean(pad_scores) > max(self.risk_buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif np.mean(pad_scores) < min(self.risk_buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = np.clip(self.beta, self.beta_min, self.beta_max)
        self.risk_buffer.append(np.mean(pad_scores))
        if len(self.risk_buffer) > 20:
            self.risk_buffer = self.risk_buffer[-20:]


def peer_gate(reward_std, controller):
    """The main loop's gate: controller update, percentile threshold, ``reward_std > threshold``."""
    positive = np.array([p for p in reward_std.cpu().numpy() if p >= 0])
    controller.update(positive)
    threshold = np.percentile(positive, 100 - controller.beta * 100)
    return reward_std > threshold


# ------------------------------------------------------------------------------------------- inputs


def _inputs(dtype=torch.float32, ref_scale=0.1):
    x, v, sig, out = rollout("sde", ETA, dtype, shape=SHAPE, steps=STEPS)
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(B, generator=g).to(DEVICE)
    return x, perturbed(v, 0.02, seed=7), sig, out, perturbed(v, ref_scale, seed=5), adv


def _grpo(backend, kl_coef, x, v, sig, out, v_ref, adv, **kw):
    return L.grpo_loss(x, v, out.prev_sample, sig, STEPS.to(DEVICE), old_log_prob=out.log_prob, advantages=adv,
                       clip_range=0.2, kl_coef=kl_coef, ref_model_output=v_ref, backend=backend, **kw)


def _f64(t):
    return t.detach().cpu().to(F64)


def _std_dev_t(sig):
    """GARDO's std_dev_t per sample (float64), for its policy weights."""
    return peer_sde_step(sig.cpu(), STEPS, torch.zeros(B, 1, 1, dtype=F64), torch.zeros(B, 1, 1, dtype=F64),
                         torch.zeros(B, 1, 1, dtype=F64), ETA)[2].reshape(B)


# ------------------------------------------------------------- the [B] coefficient: GARDO's loss


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate", [GATE, torch.zeros(B, dtype=torch.bool)], ids=["gated", "none_gated"])
def test_per_sample_kl_coef_is_gardos_loss(backend, gate):
    """loss, its KL term and d loss / d v against the float64 transcription of GARDO's training-loop
    block. beta and the reference's distance are set so that the KL term is of the policy term's size
    (at GARDO's beta = 0.04 it would be 1e-6 of the loss, and a tolerance on the loss would not see it)."""
    x, v, sig, out, v_ref, adv = _inputs(ref_scale=1.0)
    beta = 100.0
    s = _std_dev_t(sig)
    d = (sig[STEPS] - sig[STEPS + 1]).to(F64).cpu()
    kl_coef = (gardo_kl_coef(gate, beta).to(F64) * d).to(torch.float32).to(DEVICE)
    weights = (s / s.mean()).to(torch.float32).to(DEVICE)
    v1 = v.clone().requires_grad_(True)
    res = _grpo(backend, kl_coef.to(DEVICE), x, v1, sig, out, v_ref, adv, rollout_is_weights=weights)
    res.loss.backward()
    v64 = _f64(v).requires_grad_(True)
    want, want_policy, want_kl = peer_gardo_loss(sig.cpu(), STEPS, _f64(x), v64, _f64(out.prev_sample), _f64(v_ref),
                                                 _f64(out.log_prob), _f64(adv), 0.2, beta, gate)
    want.backward()
    if gate.any():
        assert want_kl.abs() > 0.1 * want_policy.abs()
    # float32 per-sample reductions (the contract's) against float64, measured: the loss within 5e-8 of
    # its terms' size 0.2 (the terms cancel to -0.017), the KL term within 2e-8 relative, the gradient
    # within 3.2e-7 of its largest entry
    torch.testing.assert_close(_f64(res.loss), want.detach(), rtol=1e-6, atol=2e-7)
    torch.testing.assert_close(_f64(res.loss - res.policy_loss), want_kl, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(_f64(v1.grad), v64.grad, rtol=2e-6, atol=2e-6 * v64.grad.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sample_kl_term_is_the_mean_of_the_products(backend):
    """loss = policy_loss + mean_b(kl_coef_b KL_b), bit for bit from the returned fields; the float64
    oracle (flowrl.oracle) agrees."""
    x, v, sig, out, v_ref, adv = _inputs()
    w = torch.tensor([0.0, 0.5, 2.0, 0.0, 1.5, 0.25], device=DEVICE)
    res = _grpo(backend, w, x, v, sig, out, v_ref, adv)
    assert torch.equal(res.loss, res.policy_loss + (w * res.kl).mean())
    ref = oracle.losses.grpo_loss(x, v, out.prev_sample, sig, STEPS.to(DEVICE), old_log_prob=out.log_prob,
                                  advantages=adv, clip_range=0.2,
                                  kl=oracle.losses.KLArgs(kl_coef=w, ref_model_output=v_ref))
    torch.testing.assert_close(_f64(res.loss), _f64(ref.loss), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", ["grpo_loss", "grpo_guard_loss", "flow_dppo_loss"])
def test_a_constant_tensor_is_the_float_form(backend, loss):
    """kl_coef = c for every sample: bit for bit the float c when c is a power of two (c mean(KL) and
    mean(c KL) round alike), within one float32 rounding otherwise; loss and gradient."""
    x, v, sig, out, v_ref, adv = _inputs()
    extra = {} if loss == "grpo_loss" else {"old_prev_sample_mean": out.prev_sample_mean}
    extra.update(kl_threshold=0.05) if loss == "flow_dppo_loss" else extra.update(clip_range=0.2)
    for c, exact in ((0.25, True), (0.04, False)):
        results = []
        for coef in (c, torch.full((B,), c, device=DEVICE)):
            v1 = v.clone().requires_grad_(True)
            res = getattr(L, loss)(x, v1, out.prev_sample, sig, STEPS.to(DEVICE), old_log_prob=out.log_prob,
                                   advantages=adv, kl_coef=coef, ref_model_output=v_ref, backend=backend, **extra)
            res.loss.backward()
            results.append((res, v1.grad))
        (a, ga), (b, gb) = results
        for name in ("policy_loss", "log_prob", "ratio", "kl"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        if exact:
            assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)
        else:
            torch.testing.assert_close(a.loss, b.loss, rtol=2e-7, atol=0)
            torch.testing.assert_close(ga, gb, rtol=2e-7, atol=1e-12)


def test_a_float_kl_coef_is_unchanged():
    """The float form is the scalar path as before: policy_loss + kl_coef * mean(KL), bit for bit."""
    x, v, sig, out, v_ref, adv = _inputs()
    res = _grpo("torch", 0.04, x, v, sig, out, v_ref, adv)
    assert torch.equal(res.loss, res.policy_loss + 0.04 * res.kl.mean())
    res0 = _grpo("torch", 0.0, x, v, sig, out, v_ref, adv)
    assert torch.equal(res0.loss, res0.policy_loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_joint_step_takes_the_per_sample_coefficient(backend):
    """Two streams: the KL term is mean(kl_coef * joint KL); a constant power of two is the float form."""
    x, v, sig, out, v_ref, adv = _inputs()
    xs, vs, prevs, refs = (x, x[:, :1]), (v, v[:, :1]), (out.prev_sample, out.prev_sample[:, :1]), (v_ref, v_ref[:, :1])
    w = torch.tensor([0.0, 0.5, 2.0, 0.0, 1.5, 0.25], device=DEVICE)
    kw = dict(old_log_prob=out.log_prob, advantages=adv, clip_range=0.2, ref_model_output=refs, backend=backend)
    res = L.grpo_loss(xs, vs, prevs, sig, STEPS.to(DEVICE), kl_coef=w, **kw)
    assert torch.equal(res.loss, res.policy_loss + (w * res.kl).mean())
    a = L.grpo_loss(xs, vs, prevs, sig, STEPS.to(DEVICE), kl_coef=0.5, **kw)
    b = L.grpo_loss(xs, vs, prevs, sig, STEPS.to(DEVICE), kl_coef=torch.full((B,), 0.5, device=DEVICE), **kw)
    assert torch.equal(a.loss, b.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_with_a_per_sample_coefficient(backend):
    x, v, sig, out, v_ref, adv = _inputs()
    e = slice(0, 0)
    v1 = v[e].clone().requires_grad_(True)
    res = L.grpo_loss(x[e], v1, out.prev_sample[e], sig, STEPS.to(DEVICE)[e], old_log_prob=out.log_prob[e],
                      advantages=adv[e], clip_range=0.2, kl_coef=torch.zeros(0, device=DEVICE),
                      ref_model_output=v_ref[e], backend=backend)
    res.loss.backward()
    assert res.loss.shape == () and res.loss.item() == 0 and v1.grad.shape == v1.shape
    assert res.kl.shape == (0,)


# ----------------------------------------------------------------------------- the gate, transcribed


def _rewards(n, seed, discrete=False):
    g = torch.Generator().manual_seed(seed)
    main = (torch.randint(0, 5, (n,), generator=g).float() if discrete else torch.rand(n, generator=g))
    return main, torch.rand(n, generator=g), torch.rand(n, generator=g)


@pytest.mark.parametrize("n", [1, 2, 5, 24, 72])
def test_uncertainty_and_gate_are_gardos(n):
    """30 rollouts through the adaptive fraction (the window of 20 fills and slides): the fraction, the
    uncertainty and the gate equal the transcription's (numpy float64) exactly."""
    ours, theirs = GardoGateFraction(), PeerRiskCompensator()
    for it in range(30):
        main, aes, ir = _rewards(n, seed=100 * n + it, discrete=it % 3 == 0)
        want_u = peer_uncertainty(aes, ir, main)
        want_gate = peer_gate(want_u, theirs)
        u = gardo_uncertainty(main, torch.stack([aes, ir], 1))
        assert torch.equal(u, want_u)
        assert torch.equal(u, gardo_uncertainty(main, {"aesthetic": aes, "imagereward": ir}))
        fraction = ours.update(u)
        assert fraction.item() == float(theirs.beta), it
        assert torch.equal(gardo_kl_gate(u, fraction), want_gate), it
        assert bool((u[gardo_kl_gate(u, fraction)] > 0).all())


@pytest.mark.parametrize("fraction", [0.0, 0.02, 0.1, 0.11000000000000001, 0.2, 0.5, 1.0])
def test_gate_percentile_is_numpys(fraction):
    for n in (3, 9, 24, 216):
        main, aes, ir = _rewards(n, seed=n)
        u = gardo_uncertainty(main, torch.stack([aes, ir], 1))
        positive = np.array([p for p in u.numpy() if p >= 0])
        want = u > np.percentile(positive, 100 - fraction * 100)  # GARDO's comparison: a float32 tensor
        assert torch.equal(gardo_kl_gate(u, fraction), want)
        assert torch.equal(gardo_kl_gate(u, fraction), gardo_kl_gate(u.float(), torch.tensor(fraction, dtype=F64)))


def test_gate_is_empty_without_a_non_negative_uncertainty():
    """docs/losses.md: with no u >= 0 no sample is gated (numpy raises); the empty batch is that case."""
    assert not bool(gardo_kl_gate(torch.tensor([-1.0, -0.5, -2.0]), 0.1).any())
    assert gardo_kl_gate(torch.zeros(0), 0.1).shape == (0,)


def test_kl_coef_normalizes_by_the_gated_count():
    gate = torch.tensor([True, False, True, False])
    w = gardo_kl_coef(gate, 0.04)
    kl = torch.tensor([1.0, 5.0, 3.0, 7.0], dtype=F64)
    assert w.dtype == torch.float32
    torch.testing.assert_close((w.to(F64) * kl).mean(), torch.tensor(0.04 * 2.0, dtype=F64), rtol=1e-7, atol=0)
    assert torch.equal(gardo_kl_coef(torch.zeros(3, dtype=torch.bool), 0.04), torch.zeros(3))
    assert gardo_kl_coef(torch.zeros(0, dtype=torch.bool), 0.04).shape == (0,)


def test_the_helpers_trace_with_no_graph_break():
    """No host sync: the whole gate (ranks, percentile, normalization) compiles with fullgraph=True."""
    main, aes, ir = _rewards(24, seed=1)

    def gate(main, aux, fraction):
        g = gardo_kl_gate(gardo_uncertainty(main, aux), fraction)
        return g, gardo_kl_coef(g, 0.04)

    aux, fraction = torch.stack([aes, ir], 1), torch.tensor(0.1, dtype=F64)
    eager = gate(main, aux, fraction)
    compiled = torch.compile(gate, fullgraph=True, backend="eager")(main, aux, fraction)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_the_helpers_read_no_value_on_the_host(monkeypatch):
    """docs/losses.md: every GARDO piece, GardoGateFraction.update included, runs with no host sync:
    each way to read a tensor's value raises during the calls."""
    rollouts = [torch.stack(_rewards(n, seed=n), 1) for n in (8, 24, 5)]

    def refuse(*args, **kwargs):
        raise AssertionError("host sync")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__"):
            m.setattr(torch.Tensor, name, refuse)
        tracker = GardoGateFraction()
        for r in rollouts:
            u = gardo_uncertainty(r[:, 0], {"aes": r[:, 1], "ir": r[:, 2]})
            gardo_kl_coef(gardo_kl_gate(u, tracker.update(u)), 0.04)


# --------------------------------------------------------------------------------- torch.compile


def test_per_sample_kl_coef_compiles_through_the_custom_op_with_eager_bits():
    """fullgraph, aot_eager (the graph and the op's registered backward, no Inductor build): values and
    d loss / d v bit for bit."""
    x, v, sig, out, v_ref, adv = _inputs()
    w = torch.tensor([0.0, 0.5, 2.0, 0.0, 1.5, 0.25], device=DEVICE)

    def step(v, w):
        res = _grpo("torch", w, x, v, sig, out, v_ref, adv)
        return tuple(t for t in res if t is not None)

    counters.clear()
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        v1 = v.clone().requires_grad_(True)
        res = fn(v1, w)
        res[0].backward()
        results.append((res, v1.grad))
    assert sum(counters["graph_break"].values()) == 0
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.slow  # Inductor builds C++ on the CPU (tests/ops/test_torch_compile.py's rule)
def test_per_sample_kl_coef_compiles_with_inductor_with_eager_bits():
    """The default backend (Inductor): the op is opaque to it, so the values and d loss / d v are eager's."""
    x, v, sig, out, v_ref, adv = _inputs()
    w = torch.tensor([0.0, 0.5, 2.0, 0.0, 1.5, 0.25], device=DEVICE)

    def step(v, w):
        res = _grpo("torch", w, x, v, sig, out, v_ref, adv)
        return res.loss, res.kl

    counters.clear()
    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        v1 = v.clone().requires_grad_(True)
        loss, kl = fn(v1, w)
        loss.backward()
        results.append((loss, kl, v1.grad))
    assert sum(counters["graph_break"].values()) == 0
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_custom_op_carries_the_per_sample_coefficient(monkeypatch, backend):
    """Routed through flowrl::grpo_family_loss in eager mode: the direct call's bits, and opcheck
    (schema, fake, autograd registration) with the [B] coefficient in its Tensor?[] list."""
    from flowrl.losses import _custom_ops as loss_ops

    x, v, sig, out, v_ref, adv = _inputs()
    w = torch.tensor([0.0, 0.5, 2.0, 0.0, 1.5, 0.25], device=DEVICE)
    direct = _grpo(backend, w, x, v, sig, out, v_ref, adv)
    calls = []
    real = loss_ops._grpo_op
    monkeypatch.setattr(L, "_traced", lambda: True)
    monkeypatch.setattr(loss_ops, "_grpo_op", lambda *a: calls.append(a) or real(*a))
    routed = _grpo(backend, w, x, v, sig, out, v_ref, adv)
    assert len(calls) == 1 and any(t is w for t in calls[0][1])
    for a, b in zip(direct, routed):
        assert (a is None and b is None) or torch.equal(a, b)
    args = list(calls[0])
    args[0] = args[0].clone().requires_grad_(True)
    torch.library.opcheck(real, tuple(args), test_utils=("test_schema", "test_autograd_registration",
                                                         "test_faketensor"))


# ------------------------------------------------------------------------------------ bad inputs


def test_bad_kl_coef_is_named():
    x, v, sig, out, v_ref, adv = _inputs()
    bad = [(torch.ones(B + 1), ValueError, r"kl_coef must have shape \[B\] = \[6\]"),
           (torch.ones(B, 1), ValueError, r"kl_coef must have shape"),
           (torch.ones(B, dtype=torch.long), TypeError, r"kl_coef must be a float tensor"),
           (torch.ones(B, dtype=torch.bool), TypeError, r"kl_coef must be a float tensor"),
           (torch.ones(B, requires_grad=True), ValueError, r"kl_coef requires grad"),
           (torch.ones(B, device="meta"), ValueError, r"kl_coef is on meta but sample is on"),
           ("0.1", TypeError, r"kl_coef must be a finite real number >= 0 or a float tensor"),
           (float("nan"), TypeError, r"kl_coef must be a finite real number"),
           (-0.1, ValueError, r"kl_coef must be >= 0")]
    for value, error, match in bad:
        with pytest.raises(error, match=match):
            _grpo("torch", value, x, v, sig, out, v_ref, adv)
    with pytest.raises(ValueError, match="kl_coef is a per-sample tensor but ref_model_output is None"):
        _grpo("torch", torch.zeros(B), x, v, sig, out, None, adv)


def test_checked_mode_asserts_the_coefficient_values():
    x, v, sig, out, v_ref, adv = _inputs()
    nan = torch.tensor([0.1, float("nan"), 0.1, 0.1, 0.1, 0.1])
    negative = torch.tensor([0.1, -0.1, 0.1, 0.1, 0.1, 0.1])
    _grpo("torch", nan, x, v, sig, out, v_ref, adv)  # unchecked: no value read
    with flowrl.checks():
        with pytest.raises(RuntimeError, match="kl_coef holds a NaN or an infinity"):
            _grpo("torch", nan, x, v, sig, out, v_ref, adv)
        with pytest.raises(RuntimeError, match="kl_coef holds a negative value"):
            _grpo("torch", negative, x, v, sig, out, v_ref, adv)


def test_bad_helper_inputs_are_named():
    u = torch.tensor([1.0, -1.0, 0.0])
    with pytest.raises(TypeError, match="main_reward must be a float tensor"):
        gardo_uncertainty(torch.ones(3, dtype=torch.long), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"aux_rewards must have shape \[N, K\]"):
        gardo_uncertainty(torch.ones(3), torch.ones(4, 2))
    with pytest.raises(ValueError, match="aux_rewards must hold at least one"):
        gardo_uncertainty(torch.ones(3), {})
    with pytest.raises(ValueError, match=r"fraction must be a number in \[0, 1\]"):
        gardo_kl_gate(u, 1.5)
    with pytest.raises(ValueError, match="fraction must be a float or a 0-d float tensor"):
        gardo_kl_gate(u, torch.ones(2))
    with pytest.raises(TypeError, match="gate must be a bool tensor"):
        gardo_kl_coef(torch.ones(3), 0.1)
    with pytest.raises(ValueError, match="beta must be a finite number >= 0"):
        gardo_kl_coef(torch.ones(3, dtype=torch.bool), -1.0)


# ------------------------------------------------------------------------- sequence parallelism


def _sp_check(rank, world):
    """One rank: the per-sample KL weights are whole [B] (the same on every rank) and multiply the
    gathered per-sample KL, so the loss, the KL and this rank's gradient slice are the single-device
    ones bit for bit (every shard a whole 1024-element chunk per sample)."""
    from flowrl import distributed as fd

    g = torch.Generator().manual_seed(0)
    n, S, C = 4, 32, 64
    x, v = torch.randn(n, S, C, generator=g), torch.randn(n, S, C, generator=g)
    v_ref = v + 0.5 * torch.randn(n, S, C, generator=g)
    sig, step = torch.linspace(1.0, 0.0, 9), torch.tensor([0, 3, 6, 2])
    out = flowrl.sde_step(x, v, sig, step, noise_seed=11, backend="torch")
    adv, w = torch.randn(n, generator=g), torch.tensor([0.0, 0.5, 2.0, 0.25])
    lo, hi = rank * S // world, (rank + 1) * S // world
    cut = lambda t: t[:, lo:hi].contiguous()  # noqa: E731
    kw = dict(old_log_prob=out.log_prob, advantages=adv, clip_range=0.2, kl_coef=w, backend="torch")
    vf = v.clone().requires_grad_(True)
    want = L.grpo_loss(x, vf, out.prev_sample, sig, step, ref_model_output=v_ref, **kw)
    want.loss.backward()
    vs = cut(v).requires_grad_(True)
    got = fd.grpo_loss(cut(x), vs, cut(out.prev_sample), sig, step, ref_model_output=cut(v_ref), **kw)
    got.loss.backward()
    assert torch.equal(got.kl, want.kl) and torch.equal(got.loss, want.loss), rank
    assert torch.equal(vs.grad, cut(vf.grad)), rank


@pytest.mark.slow  # spawns a gloo process group (as tests/losses/test_losses_distributed.py)
def test_per_sample_kl_coef_under_sequence_parallelism():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from gloo_ranks import run_ranks

    run_ranks(_sp_check, 2)
