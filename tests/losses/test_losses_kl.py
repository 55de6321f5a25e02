"""The GRPO family's KL choices (docs/losses.md, KL choices): ``kl_space="velocity"`` and a guided
reference (``ref_model_output=(uncond, cond)``, ``ref_guidance_scale=w``), on both backends (Triton
under the interpreter on CPU).

The peers' definitions, transcribed below operation for operation (not imported):

- Flow-Factory's velocity KL: X-GenGroup/Flow-Factory @ a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c,
  src/flow_factory/trainers/grpo.py lines 296-309 (``kl_type == 'v-based'``: the per-sample mean over
  the non-batch dims of (noise_pred - ref noise_pred)^2, its batch mean, times ``kl_beta``, added to
  the policy loss; hparams/training_args.py line 431: ``kl_type`` in {'v-based', 'x-based'}). The same
  block at 42b715665b38406800bb96037601a60902c52dbe of Jayce-Ping/Flow-Factory-Draft,
  src/flow_factory/trainers/dppo.py, whose reference forward runs at ``kl_guidance_scale``
  (X-GenGroup/Flow-Factory @ c5b89b17d05a41e986ef4c86cbdd6a759daaca71,
  src/flow_factory/hparams/training_args/dppo.py: "CFG scale for the KL-vs-reference forward").
- The CFG combination the reference's guided output is: Flow-Factory @ a0b2bc5,
  src/flow_factory/models/stable_diffusion/sd3_5.py line 433, and yifan123/flow_grpo @
  74db69191de9a0a54869c9c3341ce4b54db7005f, scripts/train_sd3_fast.py ``compute_log_prob``: both
  ``noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)``.
- flow_grpo issue 198 (the maintainer: train without CFG, with a KL "applied directly on the velocity")
  has no code; Flow-Factory's is the definition tested.

flowrl's velocity KL is Flow-Factory's per-sample value, reduced by the contract's chunked order (so
float32 rounding apart from the peer's torch.mean); the guided combination is the peers' line in
float32 in the same operation order, so a guided reference gives the bits of its combination passed
as one tensor.
"""
import os
import sys

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import flowrl
from flowrl.backends import _dispatch
from flowrl import losses as L

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flowrl import oracle  # noqa: E402
from loss_cases import BACKENDS, DEVICE, STEPS, advantages, oracle_grpo, perturbed, rollout  # noqa: E402

F64 = torch.float64
TRITON = pytest.mark.skipif(not (torch.cuda.is_available() or _dispatch.interpreter_enabled()),
                            reason="needs CUDA or TRITON_INTERPRET=1")
EXACT = _dispatch.interpreter_enabled()  # under the interpreter both backends run the same float32 operations


# ------------------------------------------------------------------------- the peers, transcribed


def peer_cfg(noise_pred_uncond, noise_pred_text, guidance_scale):
    """Flow-Factory sd3_5.py line 433 / flow_grpo train_sd3_fast.py compute_log_prob."""
    return noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)


def peer_flow_factory_grpo(log_prob, old_log_prob, adv, clip_range, noise_pred, ref_noise_pred, kl_beta):
    """Flow-Factory GRPOTrainer.optimize (grpo.py lines 270-309, a0b2bc5), kl_type='v-based'. Its
    clip range is a pair of offsets: ratio clamped to [1 + clip_range[0], 1 + clip_range[1]]."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 + clip_range[0], 1.0 + clip_range[1])
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    loss = policy_loss
    kl_div = torch.mean(((noise_pred - ref_noise_pred) ** 2), dim=tuple(range(1, noise_pred.ndim)), keepdim=True)
    per_sample = kl_div.reshape(-1)
    kl_div = torch.mean(kl_div)
    kl_loss = kl_beta * kl_div
    loss = loss + kl_loss
    return loss, per_sample


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_velocity_kl_is_flow_factorys_v_based_kl(backend, dtype):
    x, v, sig, out = rollout("sde", 0.7, dtype)
    steps, adv, v_ref = STEPS.to(DEVICE), advantages(), perturbed(v, 0.1, seed=5)
    v_new = perturbed(v, 0.02, seed=7)
    res = L.grpo_loss(x, v_new, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                      clip_range=(0.01, 0.02),
                      kl_coef=0.04, ref_model_output=v_ref, kl_space="velocity", backend=backend)
    # the peer on float32 upcasts (flowrl computes in float32 whatever the storage dtype)
    loss, kl = peer_flow_factory_grpo(res.log_prob, out.log_prob, adv, (-0.01, 0.02), v_new.float(), v_ref.float(),
                                      0.04)
    torch.testing.assert_close(res.kl, kl, rtol=2e-6, atol=0)
    torch.testing.assert_close(res.loss, loss, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kl_space", ["transition", "velocity"])
@pytest.mark.parametrize("w", [4.5, 0.3, 1.0, 0.0])
def test_a_guided_reference_is_the_peers_cfg_line_bit_for_bit(backend, kl_space, w):
    """float32 branches: the pair (uncond, cond) at w gives the bits of peer_cfg(uncond, cond, w) given as
    one tensor (every field, and the gradient); w = 0 is uncond's exactly (w = 1 is cond's only up to the
    rounding of uncond + (cond - uncond), as in the peers' line)."""
    x, v, sig, out = rollout("sde", 0.7)
    steps, adv = STEPS.to(DEVICE), advantages()
    uncond, cond, v_new = perturbed(v, 0.1, seed=5), perturbed(v, 0.1, seed=6), perturbed(v, 0.02, seed=7)
    pairs = {"pair": dict(ref_model_output=(uncond, cond), ref_guidance_scale=w),
             "one": dict(ref_model_output=peer_cfg(uncond, cond, torch.tensor(w, dtype=torch.float32)))}
    if w == 0.0:
        pairs["branch"] = dict(ref_model_output=uncond)
    results = {}
    for name, kw in pairs.items():
        vv = v_new.clone().requires_grad_(True)
        res = L.grpo_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv, clip_range=0.2,
                          kl_coef=0.3,
                          kl_space=kl_space, backend=backend, **kw)
        (grad,) = torch.autograd.grad(res.loss, vv)
        results[name] = (res, grad)
    for name in results:
        for field in ("loss", "kl", "log_prob", "ratio"):
            assert torch.equal(getattr(results[name][0], field), getattr(results["pair"][0], field)), (name, field)
        assert torch.equal(results[name][1], results["pair"][1]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_branches_are_combined_in_float32(backend):
    """bf16 branches: combined after the upcast, in float32 (the peers combine in the model's dtype)."""
    x, v, sig, out = rollout("sde", 0.7, torch.bfloat16)
    steps, adv = STEPS.to(DEVICE), advantages()
    uncond, cond = perturbed(v, 0.1, seed=5), perturbed(v, 0.1, seed=6)
    for kl_space in ("transition", "velocity"):
        pair = L.grpo_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv, clip_range=0.2,
                           kl_coef=0.3,
                           ref_model_output=(uncond, cond), ref_guidance_scale=4.5, kl_space=kl_space, backend=backend)
        one = L.grpo_loss(x.float(), v.float(), out.prev_sample.float(), sig, steps, old_log_prob=out.log_prob,
                          advantages=adv,
                          clip_range=0.2, kl_coef=0.3, ref_model_output=peer_cfg(uncond.float(), cond.float(), 4.5),
                          kl_space=kl_space, backend=backend)
        assert torch.equal(pair.kl, one.kl), kl_space


# ----------------------------------------------------------------------------- float64 oracle


def oracle_kl(x, v, v_ref, sig, steps, kl_space, mode="sde", eta=0.7, reduction="mean"):
    if kl_space == "velocity":
        d = (v.to(F64) - v_ref.to(F64)).reshape(v.shape[0], -1)
        return (d * d).mean(1) if reduction == "mean" else (d * d).sum(1)
    return oracle.kl(x, v, v_ref, sig, [int(i) for i in steps], mode, eta, reduction)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["grpo", "guard", "dppo"])
@pytest.mark.parametrize("kl_space", ["transition", "velocity"])
def test_every_variant_matches_the_float64_oracle(backend, variant, kl_space):
    x, v, sig, out = rollout("sde", 0.7)
    steps, adv = STEPS.to(DEVICE), advantages()
    uncond, cond, v_new = perturbed(v, 0.1, seed=5), perturbed(v, 0.1, seed=6), perturbed(v, 0.05, seed=7)
    w = 3.7
    common = dict(kl_coef=0.25, ref_model_output=(uncond, cond), ref_guidance_scale=w, kl_space=kl_space,
                  backend=backend, old_log_prob=out.log_prob, advantages=adv)
    args = (x, v_new, out.prev_sample, sig, steps)
    if variant == "grpo":
        res = L.grpo_loss(*args, clip_range=(0.1, 0.2), **common)
    elif variant == "guard":
        res = L.grpo_guard_loss(*args, clip_range=(0.1, 0.2), old_prev_sample_mean=out.prev_sample_mean, **common)
    else:
        res = L.flow_dppo_loss(*args, kl_threshold=1e-4, old_prev_sample_mean=out.prev_sample_mean, **common)
    c64 = [t.cpu().to(F64) for t in (x, v_new, out.prev_sample, uncond, cond)]
    x64, v64, prev64, u64, k64 = c64
    ref64 = u64 + float(torch.tensor(w, dtype=torch.float32)) * (k64 - u64)
    policy, lp, ratio, _, _ = oracle_grpo(x64, v64, prev64, sig.cpu(), steps.cpu(), out.log_prob.cpu(), adv.cpu(),
                                          "sde", 0.7, (0.1, 0.2), old_mean=out.prev_sample_mean.cpu(),
                                          variant=variant, kl_threshold=1e-4)
    kl = oracle_kl(x64, v64, ref64, sig.cpu(), steps.cpu(), kl_space)
    torch.testing.assert_close(res.kl.cpu().to(F64), kl, rtol=2e-5, atol=1e-9)
    torch.testing.assert_close(res.loss.cpu().to(F64), policy + 0.25 * kl.mean(), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,eta", [("sde", 0.7), ("ode", 0.0), ("sde", 0.0)])
def test_velocity_kl_sum_reduction_and_deterministic_steps(backend, mode, eta):
    """reduction="sum": the sum of squares; on a deterministic step (std 0) the transition KL is 0 by the
    contract's rule, the velocity KL is still mean (v - v_ref)^2 (it reads no std), and its gradient
    is the KL's alone: 2 kl_coef (v - v_ref) / (B N)."""
    x, v, sig, out = rollout("sde", 0.7)
    steps, v_ref = STEPS.to(DEVICE), perturbed(v, 0.1, seed=5)
    zero_adv = torch.zeros(3, device=DEVICE)
    for reduction in ("mean", "sum"):
        vv = v.clone().requires_grad_(True)
        res = L.grpo_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=zero_adv,
                          clip_range=0.2, mode=mode,
                          noise_level=eta, reduction=reduction, kl_coef=0.5, ref_model_output=v_ref,
                          kl_space="velocity", backend=backend)
        (grad,) = torch.autograd.grad(res.loss, vv)
        kl = oracle_kl(x.cpu(), v.cpu(), v_ref.cpu(), sig.cpu(), steps.cpu(), "velocity", reduction=reduction)
        torch.testing.assert_close(res.kl.cpu().to(F64), kl, rtol=2e-6, atol=0)
        n = v[0].numel() if reduction == "mean" else 1
        expect = 2 * 0.5 * (v.to(F64) - v_ref.to(F64)) / (3 * n)
        torch.testing.assert_close(grad.to(F64), expect, rtol=1e-5, atol=1e-12)
        assert torch.isfinite(res.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_velocity_kl_is_the_transition_kl_times_two_std_squared_over_c_squared(backend):
    """docs/losses.md, KL choices: per sample mean (v - v_ref)^2 = (2 std^2 / c^2) x the exact transition
    KL (mu - mu_ref = c (v - v_ref)), with std and c the step's (flowrl.backends.reference.mode_coefficients in
    float64), so the two kl_coef scales differ by that factor per step."""
    from flowrl.backends.reference import mode_coefficients
    from flowrl.contract import Mode

    x, v, sig, out = rollout("sde", 0.7)
    steps, v_ref, adv = STEPS.to(DEVICE), perturbed(v, 0.1, seed=5), advantages()
    kls = {space: L.grpo_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                              clip_range=0.2, kl_coef=0.1,
                              ref_model_output=v_ref, kl_space=space, backend=backend).kl.to(F64)
           for space in ("transition", "velocity")}
    _, c, std = mode_coefficients(sig.cpu(), steps.cpu(), Mode.parse("mode", "sde"), 0.7, F64)
    torch.testing.assert_close(kls["velocity"].cpu(), kls["transition"].cpu() * 2 * std ** 2 / c ** 2,
                               rtol=2e-5, atol=0)
    assert float((2 * std ** 2 / c ** 2).max() / (2 * std ** 2 / c ** 2).min()) > 2  # not one factor for all steps


@TRITON
def test_the_triton_backend_combines_the_branches_in_its_pass(monkeypatch):
    """docs/losses.md, KL choices: on the Triton backend the pair is read by the loss kernels (REF_GUIDED),
    not combined into a [B, N] v_ref first: with the torch combination disabled the forward and backward
    still run, and give the bits of the combination passed as one tensor."""
    from flowrl.backends import reference_losses

    x, v, sig, out = rollout("sde", 0.7)
    steps, adv = STEPS.to(DEVICE), advantages()
    uncond, cond = perturbed(v, 0.1, seed=5), perturbed(v, 0.1, seed=6)
    one = peer_cfg(uncond, cond, torch.tensor(4.5, dtype=torch.float32))

    def call(**kw):
        vv = v.clone().requires_grad_(True)
        res = L.grpo_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv, clip_range=0.2,
                          kl_coef=0.3,
                          backend="triton", **kw)
        return res, torch.autograd.grad(res.loss, vv)[0]

    want, want_grad = call(ref_model_output=one)

    def refuse(*args, **kwargs):
        raise AssertionError("the guided reference was combined in torch")

    monkeypatch.setattr(reference_losses, "guided_reference", refuse)
    got, grad = call(ref_model_output=(uncond, cond), ref_guidance_scale=4.5)
    if EXACT:
        assert torch.equal(got.kl, want.kl) and torch.equal(grad, want_grad)
    else:
        torch.testing.assert_close(got.kl, want.kl, rtol=2e-5, atol=2e-6)
    with pytest.raises(AssertionError, match="combined in torch"):  # the torch backend does combine there
        L.grpo_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv, clip_range=0.2,
                    kl_coef=0.3,
                    ref_model_output=(uncond, cond), ref_guidance_scale=4.5, backend="torch")


# ------------------------------------------------------------- Triton vs torch, gradients, batches


@TRITON
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["grpo", "guard_replay", "dppo_given"])
@pytest.mark.parametrize("kl_space,guided", [("velocity", False), ("velocity", True), ("transition", True)])
def test_triton_matches_torch(dtype, variant, kl_space, guided, monkeypatch):
    """Under the interpreter the same float32 operations: the KL, the loss and d loss / d model_output
    bit for bit in float32 (the reference run with numpy's float32 log, the interpreter's: the Gaussian
    constant's log(std) is the platform's, and numpy's and torch's differ by an ulp at std = 0.7, this
    rollout's first step); on a GPU within the contract's Triton-vs-torch tolerances."""
    x, v, sig, out = rollout("sde", 0.7, dtype)
    steps, adv = STEPS.to(DEVICE), advantages()
    uncond, cond, v_new = perturbed(v, 0.1, seed=5), perturbed(v, 0.1, seed=6), perturbed(v, 0.3)
    ref = dict(ref_model_output=(uncond, cond), ref_guidance_scale=4.5) if guided else dict(ref_model_output=uncond)

    def run(be):
        vv = v_new.clone().requires_grad_(True)
        args = (x, vv, out.prev_sample, sig, steps)
        kw = dict(kl_coef=0.3, kl_space=kl_space, backend=be, old_log_prob=out.log_prob, advantages=adv, **ref)
        if variant == "grpo":
            res = L.grpo_loss(*args, clip_range=(0.05, 0.3), **kw)
        elif variant == "guard_replay":
            res = L.grpo_guard_loss(*args, clip_range=0.2, noise_seed=11, **kw)
        else:
            res = L.flow_dppo_loss(*args, kl_threshold=1e-3, old_prev_sample_mean=out.prev_sample_mean, **kw)
        (grad,) = torch.autograd.grad(res.loss, vv)
        return res, grad

    if EXACT:
        torch_log = torch.log

        def numpy_log(t):  # a float32 tensor off the autograd graph: numpy's log, as the interpreter's tl.log
            if t.dtype != torch.float32 or t.requires_grad:
                return torch_log(t)
            return torch.from_numpy(np.log(t.detach().cpu().numpy())).to(t.device)

        with monkeypatch.context() as patch:
            patch.setattr(torch, "log", numpy_log)
            res_t, grad_t = run("torch")
        assert not torch.equal(*(fn(torch.tensor([0.7])) for fn in (torch_log, numpy_log)))  # why it is patched
    else:
        res_t, grad_t = run("torch")
    res_k, grad_k = run("triton")
    assert grad_k.dtype == dtype
    if EXACT and dtype == torch.float32:
        assert torch.equal(res_k.kl, res_t.kl) and torch.equal(res_k.loss, res_t.loss)
        if variant != "guard_replay":  # the replayed mu_old's gradient path is within rounding (test_losses.py)
            assert torch.equal(grad_k, grad_t)
    if not (EXACT and dtype == torch.float32 and variant != "guard_replay"):
        # bf16: the torch backend rounds each autograd path's gradient to bf16 before summing them, the
        # kernel sums in float32 and rounds once (tests/losses/test_losses.py's tolerance)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(res_k.kl, res_t.kl, **tol)
        torch.testing.assert_close(res_k.loss, res_t.loss, **tol)
        scale = grad_t.float().abs().max()
        torch.testing.assert_close(grad_k.float() / scale, grad_t.float() / scale, **tol)
    if EXACT:  # the velocity KL reads no step coefficient: bit for bit in bf16 too
        if kl_space == "velocity":
            assert torch.equal(res_k.kl, res_t.kl)


@pytest.mark.parametrize("kl_space", ["transition", "velocity"])
def test_gradcheck_on_the_torch_backend(kl_space):
    x, v, sig, out = rollout("sde", 0.7, torch.float64, shape=(2, 3, 5), steps=STEPS[:2])
    steps = STEPS[:2].to(DEVICE)
    uncond, cond = perturbed(v, 0.2, seed=5), perturbed(v, 0.2, seed=6)
    adv = advantages(2)

    def f(vv):
        return L.grpo_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                           clip_range=0.2, kl_coef=0.7,
                           ref_model_output=(uncond, cond), ref_guidance_scale=2.5, kl_space=kl_space,
                           backend="torch").loss

    assert torch.autograd.gradcheck(f, (perturbed(v, 0.05, seed=8).requires_grad_(True),))


@pytest.mark.parametrize("backend", BACKENDS)
def test_velocity_kl_is_deterministic_and_batch_invariant(backend):
    x, v, sig, out = rollout("sde", 0.7)
    steps, adv = STEPS.to(DEVICE), advantages()
    uncond, cond, v_new = perturbed(v, 0.1, seed=5), perturbed(v, 0.1, seed=6), perturbed(v, 0.3)

    def run(rows):
        pick = lambda u: u[rows]  # noqa: E731
        return L.grpo_loss(pick(x), pick(v_new), pick(out.prev_sample), sig, pick(steps),
                           old_log_prob=pick(out.log_prob),
                           advantages=pick(adv), clip_range=0.2, kl_coef=0.2, ref_model_output=(pick(uncond), pick(cond)),
                           ref_guidance_scale=4.5, kl_space="velocity", backend=backend)

    full = run(slice(None))
    assert torch.equal(full.kl, run(slice(None)).kl)
    for i in range(3):
        assert torch.equal(run(slice(i, i + 1)).kl, full.kl[i:i + 1]), i


# ------------------------------------------------------------------------------------- compile


def test_the_new_arguments_compile_with_no_graph_break_and_eager_bits():
    """flowrl::grpo_family_loss carries kl_space, the conditional branch and the scale: values and
    d loss / d w bit for bit (aot_eager), 0 graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    x, uncond, cond = (torch.randn(2, 4, 8, generator=g) for _ in range(3))
    w = torch.randn(8, 8, generator=g).mul_(0.3)
    old_lp, adv = torch.randn(2, generator=g), torch.randn(2, generator=g)
    sigmas = torch.tensor([0.99, 0.75, 0.5, 0.25, 0.0])

    def step(x, w):
        v = x @ w
        out = flowrl.sde_step(x, v.detach(), sigmas, 1, noise_seed=11, backend="torch")
        a = L.grpo_loss(x, v, out.prev_sample, sigmas, 1, old_log_prob=old_lp, advantages=adv, clip_range=0.2,
                        kl_coef=0.3,
                        ref_model_output=(uncond, cond), ref_guidance_scale=4.5, kl_space="velocity",
                        backend="torch")
        b = L.flow_dppo_loss(x, v, out.prev_sample, sigmas, 1, old_log_prob=old_lp, advantages=adv, kl_threshold=0.01,
                             noise_seed=11,
                             kl_coef=0.2, ref_model_output=(uncond, cond), ref_guidance_scale=2.0, backend="torch")
        return (a.loss + b.loss, a.kl, b.kl, a.log_prob)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        wl = w.clone().requires_grad_(True)
        out = fn(x, wl)
        out[0].backward()
        results.append((out, wl.grad))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for a, b in zip(results[0][0] + (results[0][1],), results[1][0] + (results[1][1],)):
        assert torch.equal(a, b)
    torch._dynamo.reset()


def test_the_op_passes_opcheck_with_the_new_arguments(monkeypatch):
    from flowrl.losses import _custom_ops as loss_ops

    calls = []
    real = loss_ops._grpo_op

    def record(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(L, "_traced", lambda: True)
    monkeypatch.setattr(loss_ops, "_grpo_op", record)
    x, v, sig, out = rollout("sde", 0.7, shape=(2, 3, 5), steps=STEPS[:2])
    steps = STEPS[:2].to(DEVICE)
    vv = v.clone().requires_grad_(True)
    res = L.grpo_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=advantages(2),
                      clip_range=0.2, kl_coef=0.3,
                      ref_model_output=(perturbed(v, seed=5), perturbed(v, seed=6)), ref_guidance_scale=4.5,
                      kl_space="velocity", backend="torch")
    monkeypatch.undo()
    eager = L.grpo_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=advantages(2),
                        clip_range=0.2, kl_coef=0.3,
                        ref_model_output=(perturbed(v, seed=5), perturbed(v, seed=6)), ref_guidance_scale=4.5,
                        kl_space="velocity", backend="torch")
    assert len(calls) == 1 and torch.equal(res.loss, eager.loss) and torch.equal(res.kl, eager.kl)
    torch.library.opcheck(real, calls[0], test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ------------------------------------------------------------------------------------- arguments


def test_bad_arguments_name_the_argument():
    x, v, sig, out = rollout()
    steps, adv = STEPS.to(DEVICE), advantages()
    u, c = perturbed(v, seed=5), perturbed(v, seed=6)

    def call(fn=L.grpo_loss, **kw):
        extra = dict(noise_seed=11) if fn is not L.grpo_loss else {}
        if fn is L.flow_dppo_loss:
            extra["kl_threshold"] = 0.1
        else:
            extra["clip_range"] = 0.2
        return fn(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                  backend="torch", **extra, **kw)

    for fn in (L.grpo_loss, L.grpo_guard_loss, L.flow_dppo_loss):
        with pytest.raises(ValueError, match="kl_space must be one of 'transition', 'velocity'"):
            call(fn, kl_space="v-based", ref_model_output=u)
        with pytest.raises(ValueError, match=r"ref_model_output must be a tensor or a pair"):
            call(fn, ref_model_output=(u,), ref_guidance_scale=1.0)
        with pytest.raises(ValueError, match="ref_guidance_scale is None"):
            call(fn, ref_model_output=(u, c))
        with pytest.raises(ValueError, match="ref_guidance_scale is given"):
            call(fn, ref_model_output=u, ref_guidance_scale=4.5)
        with pytest.raises(TypeError, match="ref_guidance_scale must be a finite real"):
            call(fn, ref_model_output=(u, c), ref_guidance_scale=float("nan"))
        with pytest.raises(TypeError, match="ref_guidance_scale must be a finite real"):
            call(fn, ref_model_output=(u, c), ref_guidance_scale=torch.tensor(4.5))
        with pytest.raises(ValueError, match=r"ref_model_output\[1\] \(cond\) must have the shape"):
            call(fn, ref_model_output=(u, c[:2]), ref_guidance_scale=4.5)
        with pytest.raises(TypeError, match=r"ref_model_output\[0\] \(uncond\)"):
            call(fn, ref_model_output=(u.numpy(), c), ref_guidance_scale=4.5)
        with pytest.raises(ValueError, match=r"ref_model_output\[1\] \(cond\) requires grad"):
            call(fn, ref_model_output=(u, c.clone().requires_grad_()), ref_guidance_scale=4.5)
        with pytest.raises(ValueError, match="ref_model_output"):
            call(fn, kl_coef=0.1, kl_space="velocity")


# --------------------------------------------------------------------------------------- AOT list


def test_the_aot_list_compiles_the_kl_switches():
    """flowrl/tools/aot lists the new switches (tests/kernels/test_compile.py compiles every listed specialization;
    tests/kernels/test_roofline.py holds the hot ones to their bound) and counts the conditional branch's bytes."""
    from flowrl.contract import KLSpace
    from flowrl.tools import aot
    from flowrl.tools.aot.loss_specs import _grpo_loss

    for storage in aot.STORAGES:
        specs = [s for s in aot.loss_specializations(storage) if s.kernel.startswith("grpo")]
        seen = {(s.kernel, s.constexprs["KL_SPACE"], s.constexprs["REF_GUIDED"]) for s in specs}
        for kernel in ("grpo_partials_kernel", "grpo_backward_kernel"):
            assert {(kernel, int(KLSpace.TRANSITION), False), (kernel, int(KLSpace.VELOCITY), True),
                    (kernel, int(KLSpace.TRANSITION), True)} <= seen
    g = (1, 1)
    plain = _grpo_loss("bf16", flowrl.contract.Mode.SDE, True, 1, *g, kl=aot.KLReference(KLSpace.VELOCITY))
    guided = _grpo_loss("bf16", flowrl.contract.Mode.SDE, True, 1, *g, kl=aot.KLReference(KLSpace.VELOCITY, guided=True))
    assert aot.bytes_per_element(guided) == aot.bytes_per_element(plain) + 2
