"""flowrl.losses under sequence parallelism: 2 and 4 gloo processes on CPU, [B, S, C] samples sharded on S.

Each spawned rank builds the same full inputs, computes every loss on one device itself, then calls
``flowrl.distributed.<loss>`` (``group=``) on its shards, and checks: every per-sample [B] value
(log-prob, KL, trust divergence, ratio, AWM / DPO / DGPO errors ...), the loss and the batch statistics
equal the single-device ones, and the gradient of its shard of ``model_output`` equals its slice of the
single-device gradient. Bit for bit when every shard but the last is a whole number of chunks
(``ShardLayout.bit_exact``); to float32 rounding when a chunk straddles two ranks (summed as two
partials). The torch backend on 2 and 4 ranks, the Triton backend (the interpreter on CPU) on 2. The GRPO
family and the teacher KL also run with per-token sigmas and a frozen mask (cut on S like the latents; the
scored count and the per-token log term summed over the ranks).
"""
import os

import pytest
import torch
import torch.distributed as dist

import flowrl
from flowrl import distributed as fd
from flowrl import losses as L
from flowrl.contract import CHUNK_SIZE
from gloo_ranks import run_ranks

pytestmark = pytest.mark.slow  # spawns gloo process groups (./run test -m 'not slow' skips it)

B, C = 4, 64  # 16 rows of 64 = one 1024-element chunk
assert CHUNK_SIZE == 1024, "the splits below are sized for 1024-element chunks"

# (S, rows per rank, bit exact?)
SPLITS = {
    2: [(80, [48, 32], True), (83, [16, 67], True), (80, [37, 43], False)],
    4: [(80, [32, 16, 16, 16], True), (80, [20, 20, 20, 20], False)],
}


def _inputs(S, dtype, device="cpu"):
    g = torch.Generator().manual_seed(4321 + S)
    x = torch.randn(B, S, C, generator=g).to(dtype)
    v = torch.randn(B, S, C, generator=g).to(dtype)
    near = lambda t, s: (t.float() + s * torch.randn(B, S, C, generator=g)).to(dtype)  # noqa: E731
    sigmas = torch.linspace(1.0, 0.0, 9, dtype=torch.float32)
    step = torch.tensor([0, 3, 6, 2])  # per-sample steps; step 0 exercises sde's sigma = 1 rule
    d = dict(x=x, v=v, v_ref=near(v, 0.1), v_old=near(v, 0.05), x0=torch.randn(B, S, C, generator=g).to(dtype),
             eps=torch.randn(B, S, C, generator=g).to(dtype), sigmas=sigmas, step=step,
             adv=torch.randn(B, generator=g), w=torch.rand(B, generator=g) + 0.5,
             t=torch.rand(B, generator=g) * 0.8 + 0.1, seed=torch.tensor([11, 12, 13, 14]),
             groups=torch.tensor([0, 0, 1, 1]))
    return {k: u.to(device) for k, u in d.items()}


# the [B] values that are a per-sample reduction (or a ratio of two): off chunk boundaries they agree to
# float32 rounding, as the step ops' log-probs do (rtol 2e-6; measured <= 2.5e-7 relative)
REDUCED = {"log_prob", "kl", "trust_divergence", "[1]", "value", "model_error", "ref_error", "dsm", "ref_dsm",
           "positive_loss", "negative_loss", "per_sample_loss"}


def _same(name, got, want, exact, reduced=True):
    """Bit for bit when ``exact``. Otherwise a per-sample reduction to float32 rounding; what is computed
    from them (ratios, the loss, DPO's logits, the gradients) inherits that rounding times its
    sensitivity (DPO's logits are beta / 2 times a difference of errors; a bf16 gradient element may
    round to the neighbouring bf16 value): within 1e-3 (float32) or 1e-2 (bf16) of the largest
    magnitude (measured: <= 7.6e-5 of it in float32, DPO's logits; <= 3.6e-3 for a bf16 gradient)."""
    if want is None:
        assert got is None, name
        return
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if exact:
        assert torch.equal(got, want), f"{name}: not bit-identical (max diff {(got.float() - want.float()).abs().max()})"
    elif reduced:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    else:
        scale = (1e-2 if got.dtype == torch.bfloat16 else 1e-3) * max(want.double().abs().max().item(), 1e-6)
        diff = (got.double() - want.double()).abs().max().item()
        assert diff <= scale, f"{name}: max diff {diff:.3g} > {scale:.3g}"


def _cases(d, backend):
    """(name, dtype, single-device call, its fd form) for every loss: each call takes (model_output, cut,
    full) where ``cut`` maps a full [B, S, C] tensor to the tensor the call gets (identity on one device)."""
    x, sig, step, adv, w = d["x"], d["sigmas"], d["step"], d["adv"], d["w"]
    kw = dict(mode="sde", noise_level=0.7, backend=backend)
    seed = d["seed"]
    # the rollout's sample, drawn from in-kernel Philox noise so that mu_old replays from (x', seed)
    roll = flowrl.sde_step(x, d["v_old"], sig, step, noise_seed=seed, return_prev_sample_mean=True, **kw)
    prev, mean_old = roll.prev_sample, roll.prev_sample_mean
    old_lp = roll.log_prob
    # per-token sigmas (the first third of the tokens a step behind, two of sample 1's held at sigma 0) and a
    # frozen mask (the last 5 tokens), with a rollout of their own
    S = x.shape[1]
    tok = sig[step].reshape(B, 1, 1).expand(B, S, 1).clone()
    tok[:, : S // 3] = sig[step + 1].reshape(B, 1, 1)
    tok[1, S // 2: S // 2 + 2] = 0.0
    fr = torch.zeros(1, S, 1, dtype=torch.bool, device=x.device)
    fr[:, -5:] = True
    roll_t = flowrl.sde_step(x, d["v_old"], sig, step, noise_seed=seed, token_sigmas=tok, frozen=fr, **kw)
    prev_t, mean_t, old_t = roll_t.prev_sample, roll_t.prev_sample_mean, roll_t.log_prob
    cases = [
        ("grpo_loss", lambda f, v, c: f(c(x), v, c(prev), sig, step, old_log_prob=old_lp, advantages=adv,
                                        clip_range=(0.2, 0.28),
                                        kl_coef=0.04, ref_model_output=c(d["v_ref"]), rollout_is_weights=w, **kw)),
        ("grpo_loss velocity kl guided", lambda f, v, c: f(c(x), v, c(prev), sig, step, old_log_prob=old_lp,
                                                           advantages=adv, clip_range=0.2,
                                                           kl_coef=0.04, kl_space="velocity",
                                                           ref_model_output=(c(d["v_ref"]), c(d["v_old"])),
                                                           ref_guidance_scale=4.5, **kw)),
        ("grpo_loss sq_err sum", lambda f, v, c: f(c(x), v, c(prev), sig, step, old_log_prob=old_lp, advantages=adv,
                                                   clip_range=1e-3,
                                                   log_prob_kind="sq_err", reduction="sum", **kw)),
        ("grpo_guard_loss given mean", lambda f, v, c: f(c(x), v, c(prev), sig, step, old_log_prob=old_lp,
                                                         advantages=adv, clip_range=0.2,
                                                         old_prev_sample_mean=c(mean_old), **kw)),
        ("grpo_guard_loss replayed", lambda f, v, c: f(c(x), v, c(prev), sig, step, old_log_prob=old_lp, advantages=adv,
                                                       clip_range=0.2,
                                                       noise_seed=seed, kl_coef=0.1, ref_model_output=c(d["v_ref"]),
                                                       **kw)),
        ("flow_dppo_loss replayed", lambda f, v, c: f(c(x), v, c(prev), sig, step, old_log_prob=old_lp, advantages=adv,
                                                      kl_threshold=1e-4,
                                                      noise_seed=seed, **kw)),
        ("teacher_kl_loss", lambda f, v, c: f(c(x), v, c(d["v_ref"]), sig, step, **kw)),
        ("grpo_loss per-token frozen", lambda f, v, c: f(c(x), v, c(prev_t), sig, step, old_log_prob=old_t,
                                                         advantages=adv, clip_range=0.2,
                                                         kl_coef=0.04, ref_model_output=c(d["v_ref"]),
                                                         token_sigmas=c(tok), frozen=c(fr), **kw)),
        ("flow_dppo_loss per-token frozen replayed", lambda f, v, c: f(c(x), v, c(prev_t), sig, step,
                                                                       old_log_prob=old_t, advantages=adv,
                                                                       kl_threshold=1e-4, noise_seed=seed,
                                                                       token_sigmas=c(tok), frozen=c(fr), **kw)),
        ("grpo_guard_loss frozen given mean", lambda f, v, c: f(c(x), v, c(prev_t), sig, step, old_log_prob=old_t,
                                                                advantages=adv,
                                                                clip_range=0.2, old_prev_sample_mean=c(mean_t),
                                                                frozen=c(fr), **kw)),
        ("teacher_kl_loss per-token frozen", lambda f, v, c: f(c(x), v, c(d["v_ref"]), sig, step, token_sigmas=c(tok),
                                                               frozen=c(fr), **kw)),
        ("nft_loss", lambda f, v, c: f(c(x), v, c(d["v_old"]), c(d["x0"]), d["t"], advantages=adv, beta=0.1,
                                       adv_clip_max=5.0,
                                       kl_coef=0.01, ref_model_output=c(d["v_ref"]), backend=backend)),
        ("awm_log_prob", lambda f, v, c: f(v, c(d["eps"]), c(d["x0"]), d["t"], weighting="ghuber", backend=backend)),
        ("awm_loss", lambda f, v, c: f(v, c(d["eps"]), c(d["x0"]), d["t"], old_log_prob=-adv.abs(), advantages=adv,
                                       clip_range=0.2,
                                       weighting="t", backend=backend, rollout_is_weights=w)),
        ("dpo_loss", lambda f, v, c: f(v, c(d["v_ref"]), c(d["eps"]), c(d["x0"]), beta=500.0, backend=backend)),
        ("dgpo_loss", lambda f, v, c: f(v, c(d["v_ref"]), c(d["eps"]), c(d["x0"]), advantages=adv,
                                        group_index=d["groups"],
                                        beta=50.0, old_model_output=c(d["v_old"]), clip_range=0.01, kl_coef=0.1,
                                        backend=backend)),
    ]
    return cases


def _fields(out):
    if isinstance(out, torch.Tensor):
        return {"value": out}
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return dict(zip(out._fields, out))
    return {f"[{i}]": t for i, t in enumerate(out)}  # teacher_kl_loss: (loss, kl)


def _check_split(rank, S, rows, exact, backend, dtype, only=None, device="cpu"):
    d = _inputs(S, dtype, device)
    lo, hi = sum(rows[:rank]), sum(rows[: rank + 1])
    cut = lambda t: t[:, lo:hi].contiguous()  # noqa: E731
    whole = lambda t: t  # noqa: E731
    numels = [r * C for r in rows]
    for k, (name, call) in enumerate(_cases(d, backend)):
        if only is not None and name not in only:
            continue
        tag = f"{backend} {dtype} S={S} rows={rows} rank={rank} {name}"
        loss_name = name.split()[0]
        vf = d["v"].clone().requires_grad_()
        want = call(getattr(L, loss_name), vf, whole)
        vs = cut(d["v"]).requires_grad_()
        # every other case passes the shard sizes (no size exchange), the rest exchange them
        sharded = getattr(fd, loss_name)
        got = call(lambda *a, **kw: sharded(*a, shard_numels=numels if k % 2 else None, **kw), vs, cut)
        want_f, got_f = _fields(want), _fields(got)
        assert want_f.keys() == got_f.keys(), tag
        for field in want_f:
            _same(f"{tag} {field}", got_f[field], want_f[field], exact, field in REDUCED)
        scalar = want_f.get("loss", want_f.get("[0]", want_f.get("value")))
        scalar_got = got_f.get("loss", got_f.get("[0]", got_f.get("value")))
        if scalar.dim():  # awm_log_prob: a [B] value, weighed into a scalar
            scalar, scalar_got = (scalar * d["w"]).sum(), (scalar_got * d["w"]).sum()
        scalar.backward()
        scalar_got.backward()
        _same(f"{tag} grad model_output", vs.grad, vf.grad[:, lo:hi], exact, reduced=False)
    assert fd.shard_layout(cut(d["x"])).bit_exact == exact


def _check_errors(rank, world):
    d = _inputs(64, torch.float32)
    x, v = d["x"][:, :16], d["v"][:, :16]
    with pytest.raises(TypeError, match="do not pass shard"):
        fd.awm_log_prob(v, x, x, 0.5, shard=None)
    with pytest.raises(ValueError, match=r"shard_numels\[\d\]"):
        fd.nft_loss(x, v, v, x, 0.5, advantages=d["adv"], beta=0.1, adv_clip_max=5.0, shard_numels=[7 * C] * world)
    with pytest.raises(TypeError, match="shard must be"):
        L.dpo_loss(v, v, x, x, beta=1.0, shard="rank 0")
    with pytest.raises(TypeError, match="shard must be"):
        L.grpo_loss(x, v, x, d["sigmas"], 1, old_log_prob=d["adv"], advantages=d["adv"], clip_range=0.2, shard=object())
    # keyword first argument: the layout is read from it
    out = fd.awm_log_prob(model_output=v, noise=x, clean_sample=x, sigma=0.5, backend="torch")
    assert out.shape == (B,)


def _interpreter_runs_here():
    """The Triton backend on CPU tensors (the gloo ranks' tensors): triton under TRITON_INTERPRET=1."""
    return "triton" in flowrl.available_backends() and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_rank(rank, world):
    for k, (S, rows, exact) in enumerate(SPLITS[world]):
        _check_split(rank, S, rows, exact, "torch", torch.float32)
        if k == 0 or not exact:  # bf16 latents on the first split and off the chunk boundaries
            _check_split(rank, S, rows, exact, "torch", torch.bfloat16)
    _check_errors(rank, world)


# the interpreter is slow: smaller samples, one split on a chunk boundary (16 rows of 64), every loss,
# and one off it, the losses that cover both gathers (grpo_values' three partials, flow_sums' K rows)
TRITON_SPLITS = [(40, [16, 24], True), (40, [21, 19], False)]
TRITON_OFF_BOUNDARY = ("grpo_loss", "grpo_guard_loss replayed", "nft_loss", "dgpo_loss",
                       "flow_dppo_loss per-token frozen replayed")


def _check_triton(rank, world):
    for S, rows, exact in TRITON_SPLITS:
        _check_split(rank, S, rows, exact, "triton", torch.float32, only=None if exact else TRITON_OFF_BOUNDARY)


@pytest.mark.parametrize("world", [2, 4])
def test_losses_under_sequence_parallelism_match_single_device(world):
    run_ranks(_check_rank, world)


@pytest.mark.skipif(not _interpreter_runs_here(), reason="needs triton under TRITON_INTERPRET=1 (CPU tensors)")
def test_triton_losses_under_sequence_parallelism_match_single_device():
    # a hang guard, not a timing: the interpreted ranks share CI's two cores with the background AOT
    # compile (tests/aot_runs.py) and took over 180 s there once
    run_ranks(_check_triton, 2, deadline_s=900)


# ------------------------------------------------------------------------------- NCCL (the GPU check)
# NCCL needs one GPU per rank: world 1 on a one-GPU machine (the NCCL exchange of the sizes and of the
# partials, with CUDA tensors, on both backends: the values must equal the plain losses' bit for bit),
# world 2 where two GPUs are (a split on chunk boundaries, bitwise, and one off them).
NCCL_SPLITS = {1: [(80, [80], True)], 2: [(80, [48, 32], True), (80, [37, 43], False)]}


def _check_nccl(rank, world):
    device = f"cuda:{rank}"
    for S, rows, exact in NCCL_SPLITS[world]:
        for backend in ("torch", "triton"):
            _check_split(rank, S, rows, exact, backend, torch.float32, device=device)
        _check_split(rank, S, rows, exact, "torch", torch.bfloat16, device=device)


def _nccl_ranks(world):
    if not torch.cuda.is_available():
        return "needs CUDA"
    if not dist.is_nccl_available():
        return "needs torch built with NCCL"
    if torch.cuda.device_count() < world:
        return f"needs {world} GPUs (NCCL takes one GPU per rank); {torch.cuda.device_count()} here"
    if "triton" not in flowrl.available_backends():
        return "needs triton"
    return None


@pytest.mark.parametrize("world", [1, 2])
def test_losses_under_sequence_parallelism_on_nccl(world):
    why = _nccl_ranks(world)
    if why:
        pytest.skip(why)
    run_ranks(_check_nccl, world, deadline_s=300, backend="nccl")


def test_loss_forms_need_an_initialized_group():
    assert not dist.is_initialized()
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.awm_log_prob(x, x, x, 0.5)


def test_every_loss_has_its_group_form():
    """flowrl.distributed has a form of every loss of flowrl.losses: the loss's signature less ``shard``,
    plus ``group`` and ``shard_numels``."""
    import inspect

    assert set(fd.LOSSES) == {"grpo_loss", "grpo_guard_loss", "flow_dppo_loss", "teacher_kl_loss", "nft_loss",
                              "awm_log_prob", "awm_loss", "dpo_loss", "dgpo_loss"}
    for name in fd.LOSSES:
        params = inspect.signature(getattr(L, name)).parameters
        assert "shard" in params, name
        wrapped = inspect.signature(getattr(fd, name)).parameters
        assert list(wrapped) == [p for p in params if p != "shard"] + ["group", "shard_numels"], name


def test_a_one_rank_shard_is_the_plain_call_and_is_not_routed_to_the_custom_ops(monkeypatch):
    """No process group: a ``ShardContext`` of one rank (the whole sample, the identity gather) gives
    every loss's plain result bit for bit; while torch.compile traces, a sharded call runs eagerly (the
    gather is a collective, not a schema value) and never reaches the losses' custom ops."""
    from flowrl.core.step_spec import ShardContext
    from flowrl.losses import _custom_ops

    d = _inputs(40, torch.float32)
    ctx = ShardContext(numel=40 * C, offset=0, gather=lambda partials: partials)
    plain = [(name, call(getattr(L, name.split()[0]), d["v"], lambda t: t)) for name, call in _cases(d, "torch")]

    def refuse(*args, **kwargs):
        raise AssertionError("a sharded call reached a custom op")

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(L, "grpo_family_loss", refuse)
    for op in ("nft_loss", "awm_log_prob", "awm_loss", "teacher_kl_loss"):
        monkeypatch.setattr(_custom_ops, op, refuse)
    for (name, call), (_, want) in zip(_cases(d, "torch"), plain):
        loss = getattr(L, name.split()[0])
        got = call(lambda *a, **kw: loss(*a, shard=ctx, **kw), d["v"], lambda t: t)
        for field, value in _fields(want).items():
            _same(f"{name} {field}", _fields(got)[field], value, True)
