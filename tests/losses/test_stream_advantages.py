"""nft_loss with per-stream advantages on a joint step (docs/losses.md, Joint steps, Per-stream advantages):
OmniNFT's loss (verl-project/verl-omni commit dc5e74928099d526f318096a3f93b3a44d45b5e8,
verl_omni/trainer/diffusion/diffusion_algos.py, ``OmniNFTLoss``), transcribed below in float64 from its
definition: per modality the DiffusionNFT loss over that modality's own elements with that modality's own
advantage, then (w_v (P_v + c K_v) + w_a (P_a + c K_a)) / (w_v + w_a)."""
import pytest
import torch

import flowrl
from flowrl import losses as L

F64 = torch.float64
BACKENDS = ("torch", "triton")


def _streams(seed, dtype=F64, batch=3):
    """Per stream (x_t, v, v_old, x0, v_ref) of a video [B, 4, 5, 6] and an audio [B, 7, 8] latent, and t [B]."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.3, 0.9, batch, dtype=F64) if batch else torch.zeros(0, dtype=F64)
    out = []
    for shape in ((batch, 4, 5, 6), (batch, 7, 8)):
        x0, eps = torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)
        v_old = (eps - x0) + 0.3 * torch.randn(shape, generator=g, dtype=F64)
        v = v_old + 0.05 * torch.randn(shape, generator=g, dtype=F64)
        v_ref = v_old + 0.05 * torch.randn(shape, generator=g, dtype=F64)
        tt = t.view(-1, *[1] * (len(shape) - 1))
        out.append([u.to(dtype) for u in ((1 - tt) * x0 + tt * eps, v, v_old, x0, v_ref)])
    return out, t.to(dtype)


def _reward_prob(adv, amax):
    """OmniNFTLoss._advantage_to_reward_prob, adv_mode "continuous": clip(A) mapped to [0, 1]."""
    adv = torch.clamp(adv, -amax, amax)
    return torch.clamp((adv / amax) / 2.0 + 0.5, 0, 1)


def _modality_loss(xt, v, v_old, x0, v_ref, t, reward_prob, beta, amax, weight_min=1e-5):
    """OmniNFTLoss._compute_modality_loss in float64: (policy loss, reference MSE)."""
    dims = tuple(range(1, x0.ndim))
    t = t.view(-1, *[1] * (x0.ndim - 1))
    pos_x0 = xt - t * (beta * v + (1.0 - beta) * v_old)
    neg_x0 = xt - t * ((1.0 + beta) * v_old - beta * v)
    with torch.no_grad():
        pos_w = (pos_x0 - x0).abs().mean(dim=dims, keepdim=True).clamp_min(weight_min)
        neg_w = (neg_x0 - x0).abs().mean(dim=dims, keepdim=True).clamp_min(weight_min)
    pos = ((pos_x0 - x0).square() / pos_w).mean(dim=dims)
    neg = ((neg_x0 - x0).square() / neg_w).mean(dim=dims)
    per_sample = reward_prob * pos / beta + (1.0 - reward_prob) * neg / beta
    return (per_sample * amax).mean(), (v - v_ref).square().mean(), per_sample


def _omninft(streams, t, advs, beta, amax, kl_coef, loss_weights):
    """OmniNFTLoss.compute_loss in float64 with video_ref_kl_coef = audio_ref_kl_coef = kl_coef."""
    terms = [_modality_loss(*s, t, _reward_prob(a, amax), beta, amax) for s, a in zip(streams, advs)]
    total = sum(w * (p + kl_coef * k) for w, (p, k, _) in zip(loss_weights, terms)) / max(sum(loss_weights), 1e-8)
    return total, terms


def _call(streams, t, advs, backend, ref=True, **kw):
    v = tuple(s[1].clone().requires_grad_() for s in streams)
    out = L.nft_loss(tuple(s[0] for s in streams), v, tuple(s[2] for s in streams), tuple(s[3] for s in streams), t,
                     advantages=advs, beta=kw.pop("beta", 0.5), adv_clip_max=kw.pop("adv_clip_max", 2.0),
                     ref_model_output=tuple(s[4] for s in streams) if ref else None, backend=backend, **kw)
    out.loss.backward()
    return out, [u.grad for u in v]


def _plain(stream, t, adv, backend, **kw):
    """nft_loss on one stream given as tensors (not a tuple)."""
    v = stream[1].clone().requires_grad_()
    out = L.nft_loss(stream[0], v, stream[2], stream[3], t, advantages=adv, beta=0.5, adv_clip_max=2.0,
                     ref_model_output=stream[4], backend=backend, **kw)
    out.loss.backward()
    return out, [v.grad]


ADVS = (torch.tensor([1.5, -0.4, 3.0], dtype=F64), torch.tensor([-2.5, 0.7, 0.0], dtype=F64))


@pytest.mark.parametrize("loss_weights", [(1.0, 1.0), (2.0, 0.5)])
def test_per_stream_advantages_match_a_float64_omninft(loss_weights):
    """float64, torch backend: the loss (policy + KL), its gradients per stream and the per-sample loss
    against the float64 transcription of OmniNFTLoss; the peer's (w_v, w_a) are stream_weights w / sum(w),
    its default (1, 1) is stream_weights=None."""
    streams, t = _streams(1)
    norm = tuple(w / sum(loss_weights) for w in loss_weights)
    weights = None if loss_weights == (1.0, 1.0) else norm
    out, grads = _call(streams, t, ADVS, "torch", kl_coef=0.3, stream_weights=weights)
    v2 = [s[1].clone().requires_grad_() for s in streams]
    want, terms = _omninft([[s[0], v2[k], *s[2:]] for k, s in enumerate(streams)], t, ADVS, 0.5, 2.0, 0.3,
                           loss_weights)
    want.backward()
    torch.testing.assert_close(out.loss, want.detach(), rtol=1e-13, atol=0)
    policy = sum(w * p for w, (p, _, _) in zip(norm, terms))
    torch.testing.assert_close(out.policy_loss, policy.detach(), rtol=1e-13, atol=0)
    per_sample = sum(w * s for w, (_, _, s) in zip(norm, terms))
    torch.testing.assert_close(out.per_sample_loss, per_sample.detach(), rtol=1e-13, atol=0)
    for got, ref in zip(grads, (u.grad for u in v2)):
        assert ref.abs().sum() > 0
        torch.testing.assert_close(got, ref, rtol=1e-11, atol=1e-15 * float(ref.abs().max()))


def test_per_stream_advantages_triton_matches_torch_bits_and_the_float64_omninft():
    """float32: the Triton backend (interpreter) gives the torch backend's loss and per-sample values bit
    for bit (the per-stream sums are bit for bit, kernels/loss.py's contract) and its gradients within float32
    rounding; both within float32 rounding of the float64 OmniNFT."""
    streams, t = _streams(2, torch.float32)
    advs = tuple(a.float() for a in ADVS)
    got = {b: _call(streams, t, advs, b, kl_coef=0.1, stream_weights=(0.7, 0.3)) for b in BACKENDS}
    (ot, gt), (orr, gr) = got["triton"], got["torch"]
    for name in ("loss", "policy_loss", "per_sample_loss", "positive_loss", "negative_loss", "kl"):
        assert torch.equal(getattr(ot, name), getattr(orr, name)), name
    for a, b in zip(gt, gr):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
    s64 = [[u.double() for u in s] for s in streams]
    want, _ = _omninft(s64, t.double(), ADVS, 0.5, 2.0, 0.1, (0.7, 0.3))
    assert abs(float(ot.loss.detach()) - float(want)) <= 1e-5 * abs(float(want))


def test_each_stream_term_is_nft_loss_on_that_stream_bit_for_bit():
    """A tuple of advantages (the same values for both streams included) is sum_k w_k nft_loss(stream k,
    advantages=A_k), every field bit for bit, on both backends; a one-stream step with a one-tuple is
    nft_loss on that stream bit for bit (values and gradient). This is not the shared-advantage joint step
    (one per-sample mean over every stream's elements): the two agree only for one stream."""
    streams, t = _streams(3, torch.float32)
    same = torch.tensor([0.5, -1.0, 2.5])
    for backend in BACKENDS:
        for advs in ((same, same), (same, -same)):
            joint, _ = _call(streams, t, advs, backend, kl_coef=0.2, stream_weights=(0.25, 0.75))
            single = [_plain(s, t, a, backend, kl_coef=0.2)[0] for s, a in zip(streams, advs)]
            for j, name in enumerate(joint._fields):
                assert torch.equal(joint[j], single[0][j] * 0.25 + single[1][j] * 0.75), (backend, name)
        one, g_one = _call(streams[:1], t, (same,), backend, kl_coef=0.2)
        plain, g_plain = _plain(streams[0], t, same, backend, kl_coef=0.2)
        for a, b in zip(one, plain):
            assert torch.equal(a, b), backend
        assert torch.equal(g_one[0], g_plain[0])
    shared, _ = _call(streams, t, same, "torch")
    per_stream, _ = _call(streams, t, (same, same), "torch", stream_weights=(0.5, 0.5))
    assert not torch.equal(shared.loss, per_stream.loss)  # two definitions (docs/losses.md)


def test_stream_weights_are_taken_as_given_not_normalised():
    """docs/losses.md, Per-stream advantages: w = stream_weights as given (weights summing to 4 scale every
    field by them, not by w / sum(w)), bit for bit the weighted sum of the single-stream calls."""
    streams, t = _streams(3, torch.float32)
    advs = (torch.tensor([0.5, -1.0, 2.5]), torch.tensor([-0.3, 1.2, 0.0]))
    joint, _ = _call(streams, t, advs, "torch", kl_coef=0.2, stream_weights=(1.0, 3.0))
    single = [_plain(s, t, a, "torch", kl_coef=0.2)[0] for s, a in zip(streams, advs)]
    for j, name in enumerate(joint._fields):
        assert torch.equal(joint[j], single[0][j] * 1.0 + single[1][j] * 3.0), name


def test_per_stream_advantages_on_an_empty_batch():
    """B = 0: zeros, the loss on both streams' graphs (zero gradients), no kernel; both backends."""
    streams, t = _streams(4, torch.float32, batch=0)
    for backend in BACKENDS:
        out, grads = _call(streams, t, (torch.zeros(0), torch.zeros(0)), backend, kl_coef=0.1)
        assert out.loss.item() == 0.0 and out.per_sample_loss.shape == (0,) and out.kl.shape == (0,)
        for g, s in zip(grads, streams):
            assert g is not None and torch.equal(g, torch.zeros_like(s[1]))


def test_per_stream_advantages_compile_through_the_custom_op_with_eager_bits():
    """torch.compile (fullgraph, aot_eager): flowrl::nft_loss once per stream, eager mode's loss, fields and
    gradients bit for bit."""
    streams, t = _streams(5, torch.float32)
    advs = tuple(a.float() for a in ADVS)

    def step(v0, v1):
        out = L.nft_loss((streams[0][0], streams[1][0]), (v0, v1), (streams[0][2], streams[1][2]),
                         (streams[0][3], streams[1][3]), t, advantages=advs, beta=0.5, adv_clip_max=2.0, kl_coef=0.1,
                         ref_model_output=(streams[0][4], streams[1][4]), stream_weights=(0.6, 0.4), backend="torch")
        return tuple(out)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        v = [streams[0][1].clone().requires_grad_(), streams[1][1].clone().requires_grad_()]
        out = fn(*v)
        out[0].backward()
        results.append((out, [u.grad for u in v]))
    (oe, ge), (oc, gc) = results
    for a, b in zip(oe + tuple(ge), oc + tuple(gc)):
        assert torch.equal(a, b)
    graphs = []

    def capture(gm, inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch.compile(step, fullgraph=True, backend=capture)(streams[0][1], streams[1][1])
    assert len(graphs) == 1 and graphs[0].count("flowrl.nft_loss") == 2  # one op call (one fused pass) per stream


def test_per_stream_advantages_name_bad_arguments():
    streams, t = _streams(6, torch.float32)
    xt, v, vo, x0 = (tuple(s[j] for s in streams) for j in range(4))
    adv = torch.zeros(3)
    nft = L.nft_loss
    with pytest.raises(ValueError, match=r"advantages must hold one \[B\] tensor per stream \(2\).*got 3 entries"):
        nft(xt, v, vo, x0, t, advantages=(adv, adv, adv), beta=0.5, adv_clip_max=1.0)
    with pytest.raises(ValueError, match=r"advantages must hold one \[B\] tensor per stream \(2\).*got 1 entries"):
        nft(xt, v, vo, x0, t, advantages=(adv,), beta=0.5, adv_clip_max=1.0)
    with pytest.raises(ValueError, match=r"advantages\[1\] must have shape \[B\] = \[3\]; got \(3, 1\)"):
        nft(xt, v, vo, x0, t, advantages=(adv, adv[:, None]), beta=0.5, adv_clip_max=1.0)
    with pytest.raises(ValueError, match=r"advantages\[0\] must have shape \[B\] = \[3\]; got \(2,\)"):
        nft(xt, v, vo, x0, t, advantages=(adv[:2], adv), beta=0.5, adv_clip_max=1.0)
    with pytest.raises(TypeError, match=r"advantages\[1\] must be a float tensor"):
        nft(xt, v, vo, x0, t, advantages=(adv, [0.0, 0.0, 0.0]), beta=0.5, adv_clip_max=1.0)
    with pytest.raises(ValueError, match=r"advantages\[0\] requires grad"):
        nft(xt, v, vo, x0, t, advantages=(adv.clone().requires_grad_(), adv), beta=0.5, adv_clip_max=1.0)
    with pytest.raises(ValueError, match="a tuple of per-stream advantages needs a joint step"):
        nft(xt[0], v[0], vo[0], x0[0], t, advantages=(adv,), beta=0.5, adv_clip_max=1.0)
    with pytest.raises(ValueError, match="shard: a joint step"):
        nft(xt, v, vo, x0, t, advantages=(adv, adv), beta=0.5, adv_clip_max=1.0, shard=object())
    with pytest.raises(ValueError, match="one weight per stream"):
        nft(xt, v, vo, x0, t, advantages=(adv, adv), beta=0.5, adv_clip_max=1.0, stream_weights=(1.0,))
    with pytest.raises(ValueError, match="kl_coef is nonzero but ref_model_output is None"):
        nft(xt, v, vo, x0, t, advantages=(adv, adv), beta=0.5, adv_clip_max=1.0, kl_coef=0.1)
    with pytest.raises(ValueError, match="model_output must be a tuple of 2"):
        nft(xt, v[:1], vo, x0, t, advantages=(adv, adv), beta=0.5, adv_clip_max=1.0)


def test_the_grpo_family_refuses_per_stream_advantages_naming_them():
    """No peer defines per-stream advantages for the GRPO family (docs/losses.md, Per-stream advantages):
    a tuple is refused on a joint step, naming ``advantages``."""
    g = torch.Generator().manual_seed(0)
    xs = (torch.randn(2, 4, 8, generator=g), torch.randn(2, 3, generator=g))
    vs = tuple(torch.randn(x.shape, generator=g) for x in xs)
    sigmas = torch.cat([torch.tensor([0.9]), torch.linspace(0.8, 0.0, 5)])
    prev = tuple(flowrl.sde_step(x, v, sigmas, 1, generator=g).prev_sample for x, v in zip(xs, vs))
    adv = torch.tensor([1.0, -1.0])
    for loss, extra in ((L.grpo_loss, {"clip_range": 0.2}), (L.flow_dppo_loss, {"kl_threshold": 0.1}),
                        (L.grpo_guard_loss, {"clip_range": 0.2, "noise_seed": 3})):
        with pytest.raises(TypeError, match="advantages must be a float tensor of shape"):
            loss(xs, vs, prev, sigmas, 1, old_log_prob=torch.zeros(2), advantages=(adv, adv), **extra)
