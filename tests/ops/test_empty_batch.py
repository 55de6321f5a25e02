"""An empty batch (B = 0) through every public op and loss, on both backends (docs/guide.md, An empty batch).

A data-parallel rank whose filter leaves no sample still calls the ops and the loss. After the usual
argument checks (a mismatched batch is still refused, naming the argument), nothing is launched: the ops
return empty outputs of the nonempty call's dtypes, the losses a 0-d zero on model_output's graph (so
``backward()`` gives every parameter behind it a zero gradient, as DDP needs) with every per-sample field
[0] and every batch statistic 0 (no NaN: no mean over zero samples). Each case is compared with the same
call at B = 2: the same fields present, the same dtypes, the per-sample shapes with 0 rows.
"""
import pytest
import torch

import flowrl
from flowrl import distributed as fd
from flowrl import losses as L
from flowrl.backends import _dispatch
from gloo_ranks import run_ranks

BACKENDS = flowrl.available_backends()  # "torch" always; "triton" under the interpreter on CPU
SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
S, C = 3, 4  # the samples are [B, S, C]


@pytest.fixture
def nothing_launched(monkeypatch):
    """The backends' ops (every kernel, every reference pass) refuse to run while the test runs."""

    def refuse(*args, **kwargs):
        raise AssertionError("an empty batch reached a backend op")

    for name in ("torch", "triton"):
        monkeypatch.setitem(_dispatch.BACKEND_TABLE, name,
                            lambda name=name: _dispatch.Backend(name, refuse, refuse, refuse, refuse, refuse))
    _dispatch.backend.cache_clear()
    yield
    monkeypatch.undo()
    _dispatch.backend.cache_clear()


def _inputs(B, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda: torch.randn(B, S, C, generator=g).to(dtype)  # noqa: E731
    return dict(x=r(), prev=r(), ref=r(), old=r(), x0=r(), eps=r(), mean=r(), h=r(),
                olp=-torch.rand(B, generator=g), adv=torch.randn(B, generator=g), w=torch.rand(B, generator=g) + 0.5,
                t=torch.rand(B, generator=g) * 0.8 + 0.1, step=torch.randint(0, 4, (B,), generator=g),
                groups=torch.arange(B) // 2, tok=SIGMAS[1].expand(B, S, 1).clone(),
                frozen=torch.zeros(B, S, 1, dtype=torch.bool))


def _model(dtype=torch.float32):
    """A tiny trainable model: model_output = Linear(h), so a loss's gradient reaches its parameters."""
    torch.manual_seed(0)
    return torch.nn.Linear(C, C).to(dtype)


def _fields(out):
    if isinstance(out, torch.Tensor):
        return {"value": out}
    if hasattr(out, "_fields"):
        return dict(zip(out._fields, out))
    if isinstance(out, flowrl.SDEStepOutput):
        return {k: getattr(out, k) for k in ("prev_sample", "log_prob", "prev_sample_mean", "std_dev", "count")}
    return {f"[{i}]": t for i, t in enumerate(out)}  # teacher_kl_loss: (loss, kl)


def _like_nonempty(empty, full):
    """``empty`` (B = 0) has ``full``'s (B = 2) fields: None where it is None, 0-d zeros where it is 0-d,
    else ``full``'s shape with 0 rows; the same dtypes and devices; nothing non-finite."""
    got, want = _fields(empty), _fields(full)
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == w.dtype and g.device == w.device, (name, g.dtype, w.dtype)
        if w.dim() == 0:
            assert g.dim() == 0 and g.item() == 0.0, (name, g)
        else:
            assert g.shape == (0,) + tuple(w.shape[1:]), (name, tuple(g.shape))
        assert torch.isfinite(g).all(), name


# ------------------------------------------------------------------------------------------------ ops


def _ops(d, v, backend, B):
    kw = dict(backend=backend)
    x, prev, ref = d["x"], d["prev"], d["ref"]
    return {
        "sde_step": lambda: flowrl.sde_step(x, v, SIGMAS, 1, generator=torch.Generator().manual_seed(1), **kw),
        "sde_step noise no mean": lambda: flowrl.sde_step(x, v, SIGMAS, d["step"], noise=d["eps"],
                                                          return_prev_sample_mean=False, out_dtype=torch.bfloat16,
                                                          **kw),
        "sde_step noise_seed per-token": lambda: flowrl.sde_step(x, v, SIGMAS, 1, noise_seed=7, token_sigmas=d["tok"],
                                                                 frozen=d["frozen"], **kw),
        "sde_step generators": lambda: flowrl.sde_step(x, v, SIGMAS, 1, mode="cps",
                                                       generator=[torch.Generator() for _ in range(B)], **kw),
        "step_log_prob": lambda: flowrl.step_log_prob(x, v, prev, SIGMAS, d["step"], **kw),
        "step_log_prob count frozen": lambda: flowrl.step_log_prob(x, v, prev, SIGMAS, 2, return_count=True,
                                                                   frozen=d["frozen"], reduction="sum", **kw),
        "step_kl": lambda: flowrl.step_kl(x, v, ref, SIGMAS, 1, **kw),
        "step_kl per-token count": lambda: flowrl.step_kl(x, v, ref, SIGMAS, 1, token_sigmas=d["tok"],
                                                          return_count=True, **kw),
        "step_log_prob joint": lambda: flowrl.step_log_prob((x, x[..., :2]), (v, v[..., :2]), (prev, prev[..., :2]),
                                                            SIGMAS, 1, return_count=True, **kw),
        "step_kl joint weighted": lambda: flowrl.step_kl((x, x[..., :2]), (v, v[..., :2]), (ref, ref[..., :2]),
                                                         SIGMAS, 1, stream_weights=(0.5, 0.5), **kw),
        "awm_log_prob": lambda: L.awm_log_prob(v, d["eps"], d["x0"], d["t"], weighting="ghuber", **kw),
        "awm_log_prob joint": lambda: L.awm_log_prob((v, v[..., :2]), (d["eps"], d["eps"][..., :2]),
                                                     (d["x0"], d["x0"][..., :2]), 0.5, **kw),
    }


OP_NAMES = list(_ops(_inputs(1), torch.zeros(1, S, C), "torch", 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OP_NAMES)
def test_an_op_on_an_empty_batch_returns_empty_outputs(op, backend, request):
    full = _ops(_inputs(2), _model()(_inputs(2)["h"]), backend, 2)[op]()
    request.getfixturevalue("nothing_launched")
    d, model = _inputs(0), _model()
    v = model(d["h"])
    v.retain_grad()
    out = _ops(d, v, backend, 0)[op]()
    _like_nonempty(out, full)
    fields = [t for t in _fields(out).values() if t is not None and t.requires_grad]
    assert fields, "the op's value is not on model_output's graph"
    sum(t.sum() for t in fields).backward()
    assert v.grad.shape == (0, S, C)
    assert torch.equal(model.weight.grad, torch.zeros(C, C)) and torch.equal(model.bias.grad, torch.zeros(C))


def test_sde_step_on_an_empty_batch_draws_no_noise():
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    out = flowrl.sde_step(torch.zeros(0, S, C), torch.zeros(0, S, C), SIGMAS, 1, generator=g, backend="torch")
    assert out.prev_sample.shape == (0, S, C) and torch.equal(g.get_state(), state)


def test_combine_streams_of_empty_streams():
    e = torch.zeros(0)
    assert flowrl.combine_streams([e, e], [e, e]).shape == (0,)
    assert flowrl.combine_streams([e, e], [e, e], weights=(0.5, 0.5)).shape == (0,)


def test_the_preference_noise_of_an_empty_batch():
    like = torch.zeros(0, S, C)
    assert L.dpo_noise(3, like).shape == (0, S, C) and L.dgpo_noise(3, like).shape == (0, S, C)


# ---------------------------------------------------------------------------------------------- losses


def _losses(d, v, backend):
    kw = dict(backend=backend)
    x, prev, sig = d["x"], d["prev"], SIGMAS
    olp, adv = d["olp"], d["adv"]
    j = lambda t: (t, t[..., :2])  # noqa: E731  (a joint step: a second stream of 2 channels)
    return {
        "grpo_loss": lambda: L.grpo_loss(x, v, prev, sig, 1, old_log_prob=olp, advantages=adv, clip_range=(0.2, 0.28),
                                         kl_coef=0.04, ref_model_output=d["ref"], rollout_is_weights=d["w"], **kw),
        "grpo_loss velocity guided": lambda: L.grpo_loss(x, v, prev, sig, d["step"], old_log_prob=olp, advantages=adv,
                                                         clip_range=0.2, kl_coef=0.1, kl_space="velocity",
                                                         ref_model_output=(d["ref"], d["old"]), ref_guidance_scale=4.5,
                                                         **kw),
        "grpo_loss per-token frozen": lambda: L.grpo_loss(x, v, prev, sig, 1, old_log_prob=olp, advantages=adv,
                                                          clip_range=0.2, token_sigmas=d["tok"], frozen=d["frozen"],
                                                          **kw),
        "grpo_guard_loss": lambda: L.grpo_guard_loss(x, v, prev, sig, 1, old_log_prob=olp, advantages=adv,
                                                     clip_range=0.2, old_prev_sample_mean=d["mean"], **kw),
        "flow_dppo_loss": lambda: L.flow_dppo_loss(x, v, prev, sig, 1, old_log_prob=olp, advantages=adv,
                                                   kl_threshold=1e-3, noise_seed=5, kl_coef=0.1,
                                                   ref_model_output=d["ref"], **kw),
        "teacher_kl_loss": lambda: L.teacher_kl_loss(x, v, d["ref"], sig, d["step"], **kw),
        "nft_loss": lambda: L.nft_loss(x, v, d["old"], d["x0"], d["t"], advantages=adv, beta=0.1, adv_clip_max=5.0,
                                       kl_coef=0.01, ref_model_output=d["ref"], **kw),
        "awm_loss": lambda: L.awm_loss(v, d["eps"], d["x0"], d["t"], old_log_prob=olp, advantages=adv, clip_range=0.2,
                                       weighting="t", rollout_is_weights=d["w"], **kw),
        "dpo_loss": lambda: L.dpo_loss(v, d["ref"], d["eps"], d["x0"], beta=500.0, **kw),
        "dpo_loss noise_seed": lambda: L.dpo_loss(v, d["ref"], None, d["x0"], beta=500.0, noise_seed=3,
                                                  pair_layout="interleaved", **kw),
        "dgpo_loss": lambda: L.dgpo_loss(v, d["ref"], d["eps"], d["x0"], advantages=adv, group_index=d["groups"],
                                         beta=50.0, old_model_output=d["old"], clip_range=0.01, kl_coef=0.1, **kw),
        "dgpo_loss ema noise_seed": lambda: L.dgpo_loss(v, None, None, d["x0"], advantages=adv,
                                                        group_index=d["groups"], beta=50.0, group_size=2,
                                                        old_model_output=d["old"], ema_reference=True, noise_seed=4,
                                                        **kw),
        "grpo_loss joint": lambda: L.grpo_loss(j(x), j(v), j(prev), sig, 1, old_log_prob=olp, advantages=adv,
                                               clip_range=0.2, kl_coef=0.1, ref_model_output=j(d["ref"]),
                                               stream_weights=(0.5, 0.5), **kw),
        "grpo_guard_loss joint": lambda: L.grpo_guard_loss(j(x), j(v), j(prev), sig, 1, old_log_prob=olp,
                                                           advantages=adv, clip_range=0.2,
                                                           old_prev_sample_mean=j(d["mean"]), **kw),
        "teacher_kl_loss joint": lambda: L.teacher_kl_loss(j(x), j(v), j(d["ref"]), sig, 1, **kw),
        "nft_loss joint": lambda: L.nft_loss(j(x), j(v), j(d["old"]), j(d["x0"]), 0.5, advantages=adv, beta=0.1,
                                             adv_clip_max=5.0, **kw),
        "awm_loss joint": lambda: L.awm_loss(j(v), j(d["eps"]), j(d["x0"]), 0.5, old_log_prob=olp, advantages=adv,
                                             clip_range=0.2, stream_weights=(0.3, 0.7), **kw),
    }


LOSS_NAMES = list(_losses(_inputs(1), torch.zeros(1, S, C), "torch"))


def _check_empty_loss(out, full, v, model):
    _like_nonempty(out, full)
    loss = _fields(out)[next(iter(_fields(out)))]
    assert loss.dim() == 0 and loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert v.grad.shape == (0, S, C)
    for p in model.parameters():  # DDP: every parameter gets its (zero) gradient
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_a_loss_on_an_empty_batch_is_a_zero_on_the_graph(loss, backend, request):
    full = _losses(_inputs(2), _model()(_inputs(2)["h"]), backend)[loss]()
    request.getfixturevalue("nothing_launched")
    d, model = _inputs(0), _model()
    v = model(d["h"])
    v.retain_grad()
    _check_empty_loss(_losses(d, v, backend)[loss](), full, v, model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_an_empty_loss_has_the_nonempty_dtypes(dtype):
    """bf16 latents (float32 loss) and float64 ones (the torch backend computes in float64)."""
    for name in ("grpo_loss", "nft_loss", "dgpo_loss", "teacher_kl_loss"):
        full = _losses(_inputs(2, dtype), _model(dtype)(_inputs(2, dtype)["h"]), "torch")[name]()
        d, model = _inputs(0, dtype), _model(dtype)
        v = model(d["h"])
        v.retain_grad()
        _check_empty_loss(_losses(d, v, "torch")[name](), full, v, model)


def test_the_traced_path_answers_an_empty_batch_too(monkeypatch, nothing_launched):
    """While torch.compile traces, the ops and losses go through their custom ops' wrappers, which answer
    B = 0 the same way (no op is called)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    d, model = _inputs(0), _model()
    v = model(d["h"])
    out = flowrl.step_log_prob(d["x"], v, d["prev"], SIGMAS, 1, backend="torch")
    assert out.shape == (0,) and out.requires_grad
    for name in ("grpo_loss", "teacher_kl_loss", "nft_loss", "awm_loss", "dpo_loss", "dgpo_loss"):
        loss = _fields(_losses(d, v, "torch")[name]())
        loss = loss[next(iter(loss))]
        assert loss.item() == 0.0 and loss.requires_grad, name


@pytest.mark.slow  # compiles (a few seconds)
def test_an_empty_batch_compiles_with_no_graph_break():
    """torch.compile(fullgraph=True) of a step with a loss and an op: B = 0 (a size torch.compile always
    specialises) gives the zero loss and an empty gradient; B = 2 afterwards the eager values."""
    def step(x, v, prev, olp, adv):
        out = L.grpo_loss(x, v, prev, SIGMAS, 1, old_log_prob=olp, advantages=adv, clip_range=0.2, backend="torch")
        lp = flowrl.step_log_prob(x, v, prev, SIGMAS, 1, backend="torch")
        return out.loss + lp.sum()

    compiled = torch.compile(step, fullgraph=True)
    for B in (0, 2):
        d = _inputs(B)
        v = d["h"].clone().requires_grad_()
        loss = compiled(d["x"], v, d["prev"], d["olp"], d["adv"])
        loss.backward()
        assert v.grad.shape == (B, S, C)
        assert torch.equal(loss, step(d["x"], d["h"], d["prev"], d["olp"], d["adv"]))
        if B == 0:
            assert loss.item() == 0.0


def test_checked_mode_and_value_checks_on_empty_tensors(nothing_launched):
    """flowrl.checks() asserts finiteness of empty tensors (vacuously true); the value checks skip an empty
    step-index tensor and empty per-token sigmas, but still read a 0-d step index."""
    d = _inputs(0)
    with flowrl.checks():
        assert flowrl.step_log_prob(d["x"], d["x"], d["prev"], SIGMAS, d["step"], token_sigmas=d["tok"],
                                    backend="torch").shape == (0,)
        out = L.grpo_loss(d["x"], d["x"], d["prev"], SIGMAS, d["step"], old_log_prob=d["olp"], advantages=d["adv"],
                          clip_range=0.2, backend="torch")
        assert out.loss.item() == 0.0
    with pytest.raises(ValueError, match=r"^step_index must be in \[0, 3\].*got values in \[9, 9\]"):
        flowrl.step_log_prob(d["x"], d["x"], d["prev"], SIGMAS, torch.tensor(9), backend="torch")


def test_an_empty_batch_is_still_checked():
    """B = 0 is valid; a batch that disagrees between the arguments is still refused, naming the argument."""
    e, two = _inputs(0), _inputs(2)
    x0, x2 = e["x"], two["x"]
    with pytest.raises(ValueError, match=r"^model_output must have the shape of sample \(0, 3, 4\)"):
        flowrl.sde_step(x0, x2, SIGMAS, 1, backend="torch")
    with pytest.raises(ValueError, match=r"^prev_sample must have the shape of sample"):
        flowrl.step_log_prob(x0, x0, x2, SIGMAS, 1, backend="torch")
    with pytest.raises(ValueError, match=r"^step_index must be an int or a tensor of shape \[B\] = \[0\]"):
        flowrl.step_kl(x0, x0, x0, SIGMAS, two["step"], backend="torch")
    with pytest.raises(ValueError, match=r"^sample must have at least one element per sample"):
        flowrl.sde_step(torch.zeros(0, 0), torch.zeros(0, 0), SIGMAS, 1, backend="torch")
    with pytest.raises(ValueError, match=r"^advantages must have shape \[B\] = \[0\]"):
        L.grpo_loss(x0, x0, x0, SIGMAS, 1, old_log_prob=e["olp"], advantages=two["adv"], clip_range=0.2)
    with pytest.raises(ValueError, match=r"^old_log_prob must have shape \[B\] = \[0\]"):
        L.awm_loss(x0, x0, x0, 0.5, old_log_prob=two["olp"], advantages=e["adv"], clip_range=0.2)
    with pytest.raises(ValueError, match=r"^model_output must have the shape of noised_sample"):
        L.nft_loss(x0, x2, x0, x0, 0.5, advantages=e["adv"], beta=0.1, adv_clip_max=5.0)
    with pytest.raises(ValueError, match=r"^clip_range must be < 1"):
        L.grpo_loss(x0, x0, x0, SIGMAS, 1, old_log_prob=e["olp"], advantages=e["adv"], clip_range=1.5)
    with pytest.raises(ValueError, match="even batch"):
        L.dpo_loss(x2[:1], x2[:1], x2[:1], x2[:1], beta=1.0)
    with pytest.raises(ValueError, match=r"^group_index must have shape \[B\] = \[0\]"):
        L.dgpo_loss(x0, x0, x0, x0, advantages=e["adv"], group_index=two["groups"], beta=1.0)
    with pytest.raises(ValueError, match=r"^teacher_model_output requires grad"):
        L.teacher_kl_loss(x0, x0, x0.clone().requires_grad_(), SIGMAS, 1)
    with pytest.raises(ValueError, match=r"^the streams of a joint step must have one batch size; got \[0, 2\]"):
        L.awm_log_prob((x0, x2), (x0, x2), (x0, x2), 0.5)
    with pytest.raises(ValueError, match=r"^old_log_prob must have shape \[B\] = \[2\]"):
        L.grpo_loss((x0, x2), (x0, x2), (x0, x2), SIGMAS, 1, old_log_prob=e["olp"], advantages=e["adv"],
                    clip_range=0.2)


# ----------------------------------------------------------------------------------------- distributed


def _check_empty_ranks(rank, world):
    """Every rank of the group holds B = 0 (a shard of 2 of the 3 tokens, or 1): empty values, zero losses
    with zero gradients, no collective left waiting; a rank whose batch disagrees is refused on every rank."""
    d, model = _inputs(0), _model()
    cut = slice(0, 2) if rank == 0 else slice(2, 3)
    x, prev = d["x"][:, cut], d["prev"][:, cut]
    for backend, numels in (("torch", None), ("torch", [2 * C, C]), ("triton", None)):
        if backend not in BACKENDS:
            continue
        v = model(d["h"][:, cut])
        kw = dict(backend=backend, shard_numels=numels)
        step = fd.sde_step(x, v, SIGMAS, 1, noise_seed=3, **kw)
        assert step.prev_sample.shape == x.shape and step.log_prob.shape == (0,)
        lp = fd.step_log_prob(x, v, prev, SIGMAS, 1, return_count=True, **kw)
        assert lp.log_prob.shape == (0,) and lp.count.shape == (0,)
        losses = [fd.grpo_loss(x, v, prev, SIGMAS, 1, old_log_prob=d["olp"], advantages=d["adv"], clip_range=0.2,
                               **kw).loss,
                  fd.teacher_kl_loss(x, v, prev, SIGMAS, 1, **kw)[0],
                  fd.nft_loss(x, v, prev, x, 0.5, advantages=d["adv"], beta=0.1, adv_clip_max=5.0, **kw).loss,
                  fd.dgpo_loss(v, prev, x, x, advantages=d["adv"], group_index=d["groups"], beta=1.0, **kw).loss]
        model.zero_grad()
        sum(losses).backward()
        assert all(loss.item() == 0.0 for loss in losses)
        assert torch.equal(model.weight.grad, torch.zeros(C, C))
    mine = torch.zeros(0 if rank == 0 else 2, 2, C)
    with pytest.raises(ValueError, match="every rank must hold the same batch of samples"):
        fd.step_log_prob(mine, mine, mine, SIGMAS, 1, backend="torch")


@pytest.mark.slow  # spawns a gloo process group (./run test -m 'not slow' skips it), about 8 s
def test_an_empty_batch_under_sequence_parallelism():
    run_ranks(_check_empty_ranks, 2, deadline_s=120)
