"""torch.compile sees through flowrl's ops (docs/compile.md): a training step that rolls out
(``sde_step``), recomputes (``step_log_prob``), takes the KL (``step_kl``) and the GRPO loss, then
backpropagates, compiles with ``fullgraph=True`` (0 graph breaks) and gives eager mode's values and
gradients bit for bit on the torch backend; so does a step through the other losses (``nft_loss``,
``awm_loss``, ``awm_log_prob``, ``teacher_kl_loss``) and one through the preference losses (``dpo_loss``,
``dgpo_loss``); every op passes ``torch.library.opcheck`` (schema,
fake implementation, registered autograd). The CUDA variants (Triton backend) run in bench/gpu_check.sh.

The compiled tests use tiny shapes and few compiles: Inductor builds C++ on the CPU."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import flowrl
from flowrl import losses

pytestmark = pytest.mark.slow  # compiles training steps with Inductor (C++ builds) (./run test -m 'not slow' skips it)

SIGMAS = [0.99, 0.75, 0.5, 0.25, 0.0]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh runs it)")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _inputs(device, dtype=torch.float32, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, 8, generator=g).to(device, dtype)
    noise = torch.randn(batch, 4, 8, generator=g).to(device)
    ref = torch.randn(batch, 4, 8, generator=g).to(device, dtype)
    w = torch.randn(8, 8, generator=g).mul_(0.3).to(device)
    old_lp = torch.randn(batch, generator=g).to(device)
    adv = torch.randn(batch, generator=g).to(device)
    sigmas = torch.tensor(SIGMAS, device=device)
    return x, noise, ref, w, old_lp, adv, sigmas


def _training_step(backend):
    def step(x, noise, ref, w, old_lp, adv, sigmas):
        v = (x.float() @ w).to(x.dtype)  # the "model"
        out = flowrl.sde_step(x, v.detach(), sigmas, 1, noise=noise, backend=backend)
        lp = flowrl.step_log_prob(x, v, out.prev_sample, sigmas, 1, backend=backend)
        kl = flowrl.step_kl(x, v, ref, sigmas, 1, backend=backend)
        grpo = losses.grpo_loss(x, v, out.prev_sample, sigmas, 1, old_log_prob=old_lp, advantages=adv,
                                clip_range=(0.2, 0.28), kl_coef=0.1,
                                ref_model_output=ref, backend=backend, rollout_is_weights=adv.abs() + 0.5)
        loss = grpo.loss - lp.mean() + kl.mean()
        return loss, out.prev_sample, out.log_prob, out.prev_sample_mean, lp, kl, grpo.log_prob, grpo.ratio, grpo.kl
    return step


def _losses_step(backend):
    """A training step through the other losses: nft_loss, awm_loss, awm_log_prob, teacher_kl_loss."""
    def step(x, noise, ref, w, old_lp, adv, sigmas):
        v = (x.float() @ w).to(x.dtype)  # the "model"
        nft = losses.nft_loss(x, v, ref, noise, 0.5, advantages=adv, beta=1.0, adv_clip_max=5.0, kl_coef=0.1,
                              ref_model_output=ref, backend=backend)
        awm = losses.awm_loss(v, noise, x, sigmas[1:3], old_log_prob=old_lp, advantages=adv, clip_range=(0.2, 0.28),
                              weighting="ghuber",
                              backend=backend, rollout_is_weights=adv.abs() + 0.5)
        lp = losses.awm_log_prob(v, noise, x, 0.3, weighting="huber", backend=backend)
        teacher, teacher_kl = losses.teacher_kl_loss(x, v, ref, sigmas, 1, backend=backend)
        loss = nft.loss + awm.loss - lp.mean() + teacher
        return (loss, *[t for t in nft if t is not None], *[t for t in awm if t is not None], lp, teacher,
                teacher_kl)
    return step


def _preference_step(backend):
    """A training step through the preference losses: dpo_loss, dgpo_loss clipped against an old policy
    (with the KL, clip_kl), dgpo_loss with the EMA reference (group_size None, no KL)."""
    def step(x, noise, ref, w, old_lp, adv, sigmas):
        v = (x.float() @ w).to(x.dtype)  # the "model"
        groups = torch.arange(x.shape[0], device=x.device) // 2
        old = v.detach() - 0.1 * noise.to(v.dtype)  # the old (EMA) policy
        dpo = losses.dpo_loss(v, ref, noise, x, beta=50.0, backend=backend)
        dgpo = losses.dgpo_loss(v, ref, noise, x, advantages=adv, group_index=groups, beta=10.0, group_size=2,
                                old_model_output=old,
                                clip_range=(0.1, 0.1), clip_kl=True, kl_coef=0.1, backend=backend)
        ema = losses.dgpo_loss(v, None, noise, x, advantages=adv, group_index=groups, beta=10.0, old_model_output=old,
                               ema_reference=True,
                               backend=backend)
        loss = dpo.loss + dgpo.loss + ema.loss
        return (loss, *dpo, *[t for t in dgpo if t is not None], *[t for t in ema if t is not None])
    return step


def _eager_and_compiled(step, args, w_index=3, **compile_kwargs):
    """(eager outputs, eager grad of w, compiled outputs, compiled grad of w); backward outside the step."""
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, **compile_kwargs)):
        w = args[w_index].detach().clone().requires_grad_(True)
        call = list(args)
        call[w_index] = w
        out = fn(*call)
        out[0].backward()
        results += [out, w.grad]
    return results


def _assert_bitwise(eager, compiled):
    for k, (a, b) in enumerate(zip(eager, compiled)):
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert a.requires_grad == b.requires_grad, k  # only what eager mode differentiates is differentiable
        assert torch.equal(a, b), (k, (a.double() - b.double()).abs().max().item())


def test_training_step_compiles_with_no_graph_break_and_eager_bits():
    args = _inputs("cpu")
    out_e, grad_e, out_c, grad_c = _eager_and_compiled(_training_step("torch"), args)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_bitwise(out_e, out_c)
    _assert_bitwise([grad_e], [grad_c])


def test_the_other_losses_compile_with_no_graph_break_and_eager_bits():
    """nft_loss, awm_loss, awm_log_prob and teacher_kl_loss (their own custom ops) under Inductor:
    0 graph breaks, every output and d loss / d w bit for bit."""
    args = _inputs("cpu")
    out_e, grad_e, out_c, grad_c = _eager_and_compiled(_losses_step("torch"), args)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_bitwise(out_e, out_c)
    _assert_bitwise([grad_e], [grad_c])


def test_the_preference_losses_compile_with_no_graph_break_and_eager_bits():
    """dpo_loss and dgpo_loss (their own custom ops; DGPO's group ids are read inside its op) under
    Inductor: 0 graph breaks, every output and d loss / d w bit for bit."""
    args = _inputs("cpu", batch=4)
    out_e, grad_e, out_c, grad_c = _eager_and_compiled(_preference_step("torch"), args)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert out_e[1 + 8 + 7].numel() == 1 and 0 < out_e[1 + 8 + 7].item() < 1  # some samples clipped, not all
    _assert_bitwise(out_e, out_c)
    _assert_bitwise([grad_e], [grad_c])


def test_dpo_pairs_is_host_side():
    """dpo_pairs reads the rewards on the host and its P depends on their values: it is not an op and
    breaks a fullgraph compile (Dynamo refuses its data-dependent host read: a UserError on the rewards'
    finiteness check, or Unsupported); call it before the compiled step (docs/compile.md)."""
    rewards, ids = torch.tensor([0.1, 0.9, 0.5, 0.3]), torch.tensor([0, 0, 1, 1])
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        torch.compile(lambda r, g: losses.dpo_pairs(r, g), fullgraph=True, backend="eager")(rewards, ids)


@pytest.mark.parametrize("make_step, ops", [
    (_training_step, ["sde_step", "step_log_prob", "step_kl", "grpo_family_loss"]),
    (_losses_step, ["nft_loss", "awm_loss", "awm_log_prob", "teacher_kl_loss"]),
    (_preference_step, ["dpo_loss", "dgpo_loss", "dgpo_loss"]),
], ids=["training_step", "losses_step", "preference_step"])
def test_the_traced_graph_calls_the_custom_ops(make_step, ops):
    """Under torch.compile each public call is one opaque flowrl op in Dynamo's graph (teacher_kl_loss:
    one op, its step_kl and batch mean inside it), so Inductor never sees the math."""
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(make_step("torch"), fullgraph=True, backend=record)(*_inputs("cpu"))
    assert [t for t in seen if t.startswith("flowrl.")] == [f"flowrl.{op}.default" for op in ops]


def test_a_gradient_eager_mode_leaves_none_is_zeros_under_compile():
    """step_kl's sample does not reach the KL: eager autograd leaves its grad None; the op's registered
    backward cannot know that from the fake implementation and returns zeros."""
    x, _, ref, w, _, _, sigmas = _inputs("cpu")
    grads = []
    for fn in (lambda x, v: flowrl.step_kl(x, v, ref, sigmas, 1, backend="torch").sum(),):
        for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            xl, vl = x.clone().requires_grad_(True), (x @ w).requires_grad_(True)
            grads.append(torch.autograd.grad(run(xl, vl), [xl, vl], allow_unused=True))
    (eager_x, eager_v), (compiled_x, compiled_v) = grads
    assert eager_x is None and torch.equal(compiled_x, torch.zeros_like(x))
    assert torch.equal(eager_v, compiled_v)


def test_shape_checks_still_run_while_compiling():
    """A check on shapes runs at trace time; under fullgraph=True Dynamo reports its ValueError wrapped
    ("Observed exception"), with the check's message."""
    x, _, ref, _, _, _, _ = _inputs("cpu")

    def f(x, v):
        return losses.awm_log_prob(v, x[:, :2], x, 0.5, backend="torch")

    with pytest.raises(torch._dynamo.exc.Unsupported, match="noise must have the shape of model_output"):
        torch.compile(f, fullgraph=True, backend="eager")(x, ref)


def test_the_default_noise_draw_compiles_with_no_graph_break():
    x, _, ref, _, _, _, sigmas = _inputs("cpu")

    def f(x, v):
        return flowrl.sde_step(x, v, sigmas, 1, backend="torch").prev_sample

    assert torch.compile(f, fullgraph=True, backend="eager")(x, ref).shape == x.shape


def test_sequence_parallel_calls_are_not_routed(monkeypatch):
    """A shard's gather is a collective callable, not a schema value: traced() keeps it off the ops."""
    from types import SimpleNamespace

    from flowrl.ops import _custom_ops

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _custom_ops.traced(SimpleNamespace(shard=None)) and _custom_ops.traced()
    assert not _custom_ops.traced(SimpleNamespace(shard=object()))


def test_value_checks_run_in_eager_mode_and_are_skipped_while_compiling():
    """A schedule that is not decreasing: eager mode reads it and refuses it; under torch.compile its
    values are unknown at trace time, so the check is skipped (docs/compile.md) and the op runs."""
    x, _, ref, _, _, _, _ = _inputs("cpu")
    bad = torch.tensor([0.5, 0.75, 0.5, 0.25, 0.0])

    def f(x, v):
        return flowrl.step_log_prob(x, v, ref, bad, 1, backend="torch")

    with pytest.raises(ValueError, match="strictly decreasing"):
        f(x, ref)
    value = torch.compile(f, fullgraph=True, backend="eager")(x, ref)
    assert value.shape == (2,)


def test_teacher_kl_loss_skips_the_schedule_check_while_compiling():
    """teacher_kl_loss's op runs step_kl's eager code: it must not read the schedule's values either."""
    x, _, ref, _, _, _, _ = _inputs("cpu")
    bad = torch.tensor([0.5, 0.75, 0.5, 0.25, 0.0])

    def f(x, v):
        return losses.teacher_kl_loss(x, v, ref, bad, 1, backend="torch")

    with pytest.raises(ValueError, match="strictly decreasing"):
        f(x, ref)
    loss, kl = torch.compile(f, fullgraph=True, backend="eager")(x, ref)
    assert loss.shape == () and kl.shape == (2,)


def test_a_generator_breaks_the_graph_and_noise_seed_does_not():
    x, _, ref, _, _, _, sigmas = _inputs("cpu")
    g = torch.Generator().manual_seed(0)

    def drawn(x, v):
        return flowrl.sde_step(x, v, sigmas, 1, generator=g, backend="torch").prev_sample

    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(drawn, fullgraph=True, backend="eager")(x, ref)
    torch._dynamo.reset()

    def seeded(x, v):
        out = flowrl.sde_step(x, v, sigmas, 1, noise_seed=7, backend="torch")
        return out.prev_sample, out.log_prob

    _assert_bitwise(seeded(x, ref), torch.compile(seeded, fullgraph=True, backend="aot_eager")(x, ref))


@pytest.mark.parametrize("variant", ["grpo_guard_replay", "flow_dppo_given_mean"])
def test_trust_region_losses_compile_with_eager_bits(variant):
    """The other GRPO-family losses go through the same op: values and d loss / d w bit for bit
    (aot_eager: the graph and the registered backward, without Inductor's C++ build)."""
    x, _, ref, w, old_lp, adv, sigmas = _inputs("cpu")

    def step(x, w):
        v = x @ w
        out = flowrl.sde_step(x, v.detach(), sigmas, 2, noise_seed=11, backend="torch")
        if variant == "grpo_guard_replay":
            res = losses.grpo_guard_loss(x, v, out.prev_sample, sigmas, 2, old_log_prob=old_lp, advantages=adv,
                                         clip_range=0.2, noise_seed=11,
                                         backend="torch")
        else:
            res = losses.flow_dppo_loss(x, v, out.prev_sample, sigmas, 2, old_log_prob=old_lp, advantages=adv,
                                        kl_threshold=0.01,
                                        old_prev_sample_mean=out.prev_sample_mean, kl_coef=0.5,
                                        ref_model_output=ref, backend="torch")
        return tuple(t for t in res if t is not None)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        wl = w.clone().requires_grad_(True)
        out = fn(x, wl)
        out[0].backward()
        results.append((out, wl.grad))
    assert sum(counters["graph_break"].values()) == 0
    _assert_bitwise(results[0][0], results[1][0])
    _assert_bitwise([results[0][1]], [results[1][1]])


# ---------------------------------------------------- the custom ops in eager mode, and opcheck


def _through_the_ops(monkeypatch, route=True):
    """Route eager calls through the custom ops (as under torch.compile; ``route``) and record each op call."""
    from flowrl.ops import _custom_ops
    from flowrl.losses import _custom_ops as loss_ops

    calls = []
    if route:
        monkeypatch.setattr(_custom_ops, "traced", lambda spec=None: spec is None or spec.shard is None)
        monkeypatch.setattr(losses, "_traced", lambda: True)
        monkeypatch.setattr(losses.dpo, "_traced", lambda: True)
    for module, name in ((_custom_ops, "_sde_step_op"), (_custom_ops, "_step_log_prob_op"),
                         (_custom_ops, "_step_kl_op"), (loss_ops, "_grpo_op"), (loss_ops, "_nft_op"),
                         (loss_ops, "_awm_lp_op"), (loss_ops, "_awm_op"), (loss_ops, "_teacher_op"),
                         (loss_ops, "_dpo_op"), (loss_ops, "_dgpo_op")):
        real = getattr(module, name)

        def spy(*args, _real=real):
            calls.append((_real, args))
            return _real(*args)

        monkeypatch.setattr(module, name, spy)
    return calls


def _run_ops(backend, device, dtype):
    x, noise, ref, w, old_lp, adv, sigmas = _inputs(device, dtype)
    w = w.requires_grad_(True)
    v = (x.float() @ w).to(dtype)
    out = flowrl.sde_step(x, v, sigmas, 1, noise=noise, backend=backend)
    lp = flowrl.step_log_prob(x, v, out.prev_sample.detach(), sigmas, 1, backend=backend)
    kl = flowrl.step_kl(x, v, ref, sigmas, 1, backend=backend)
    grpo = losses.grpo_loss(x, v, out.prev_sample.detach(), sigmas, 1, old_log_prob=old_lp, advantages=adv,
                            clip_range=0.2, kl_coef=0.1,
                            ref_model_output=ref, backend=backend)
    others = _losses_step(backend)(x, noise, ref, w, old_lp, adv, sigmas)  # recomputes v from w
    x4, noise4, ref4, _, old_lp4, adv4, sigmas4 = _inputs(device, dtype, batch=4, seed=1)
    preference = _preference_step(backend)(x4, noise4, ref4, w, old_lp4, adv4, sigmas4)
    total = (out.prev_sample.float().sum() + out.log_prob.sum() + lp.sum() + kl.sum() + grpo.loss + others[0]
             + preference[0])
    (grad,) = torch.autograd.grad(total, w)
    return [out.prev_sample, out.log_prob, out.prev_sample_mean, out.std_dev, out.count, lp, kl,
            *[t for t in grpo if t is not None], *others, *preference, grad]


def _backends():
    params = [pytest.param("torch", "cpu", torch.float32, id="torch-fp32"),
              pytest.param("torch", "cpu", torch.float64, id="torch-fp64")]
    try:
        from flowrl.backends import _dispatch

        if _dispatch.triton_available() and _dispatch.interpreter_enabled():
            params.append(pytest.param("triton", "cpu", torch.float32, id="triton-interpreter"))
    except Exception:  # pragma: no cover
        pass
    return params


@pytest.mark.parametrize("backend, device, dtype", _backends())
def test_the_ops_in_eager_mode_give_the_backends_bits(monkeypatch, backend, device, dtype):
    """Through the custom ops (forward and the registered backward) the values and the gradient are
    the backend's direct call's, bit for bit; the ops pass opcheck (schema, fake, autograd)."""
    direct = _run_ops(backend, device, dtype)
    calls = _through_the_ops(monkeypatch)
    routed = _run_ops(backend, device, dtype)
    assert {real._qualname for real, _ in calls} >= {"flowrl::sde_step", "flowrl::step_log_prob", "flowrl::step_kl",
                                                     "flowrl::grpo_family_loss", "flowrl::nft_loss",
                                                     "flowrl::awm_log_prob", "flowrl::awm_loss",
                                                     "flowrl::teacher_kl_loss", "flowrl::dpo_loss",
                                                     "flowrl::dgpo_loss"}
    _assert_bitwise(direct, routed)
    for real, args in list(calls):  # a snapshot: opcheck's runs of teacher_kl_loss call flowrl::step_kl again
        # the default tests less test_aot_dispatch_dynamic (it recompiles; the compile tests above cover it)
        torch.library.opcheck(real, args, test_utils=("test_schema", "test_autograd_registration",
                                                      "test_faketensor"))


def test_docs_list_the_registered_schemas():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "compile.md").read_text()
    listed = {line.strip() for line in doc.splitlines() if line.strip().startswith("flowrl::")}
    # every registered flowrl:: op but the backward ops (a new op fails this until docs/compile.md lists it)
    ops = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
           if name.startswith("flowrl::") and not name.endswith("_backward")}
    assert ops >= {"sde_step", "step_log_prob", "step_kl", "grpo_family_loss", "nft_loss", "awm_log_prob",
                   "awm_loss", "teacher_kl_loss", "dpo_loss", "dgpo_loss"}
    assert listed == {str(getattr(torch.ops.flowrl, op).default._schema) for op in ops}


def test_eager_mode_calls_the_backend_directly(monkeypatch):
    calls = _through_the_ops(monkeypatch, route=False)
    _run_ops("torch", "cpu", torch.float32)
    assert calls == []


@cuda
def test_training_step_compiles_with_eager_bits_on_cuda_triton():
    args = _inputs("cuda", torch.bfloat16)
    out_e, grad_e, out_c, grad_c = _eager_and_compiled(_training_step("triton"), args)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_bitwise(out_e, out_c)
    _assert_bitwise([grad_e], [grad_c])


@cuda
def test_training_step_compiles_with_eager_bits_on_cuda_torch():
    args = _inputs("cuda")
    out_e, grad_e, out_c, grad_c = _eager_and_compiled(_training_step("torch"), args)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_bitwise(out_e, out_c)
    _assert_bitwise([grad_e], [grad_c])


@cuda
def test_the_other_losses_compile_with_eager_bits_on_cuda_triton():
    args = _inputs("cuda", torch.bfloat16)
    out_e, grad_e, out_c, grad_c = _eager_and_compiled(_losses_step("triton"), args)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_bitwise(out_e, out_c)
    _assert_bitwise([grad_e], [grad_c])


@cuda
def test_the_other_losses_compile_with_eager_bits_on_cuda_torch():
    args = _inputs("cuda")
    out_e, grad_e, out_c, grad_c = _eager_and_compiled(_losses_step("torch"), args)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_bitwise(out_e, out_c)
    _assert_bitwise([grad_e], [grad_c])


@cuda
def test_the_preference_losses_compile_with_eager_bits_on_cuda_triton():
    args = _inputs("cuda", torch.bfloat16, batch=4)
    out_e, grad_e, out_c, grad_c = _eager_and_compiled(_preference_step("triton"), args)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_bitwise(out_e, out_c)
    _assert_bitwise([grad_e], [grad_c])


@cuda
def test_the_preference_losses_compile_with_eager_bits_on_cuda_torch():
    args = _inputs("cuda", batch=4)
    out_e, grad_e, out_c, grad_c = _eager_and_compiled(_preference_step("torch"), args)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_bitwise(out_e, out_c)
    _assert_bitwise([grad_e], [grad_c])


def test_joint_stream_losses_are_traced_not_routed():
    """docs/compile.md, Not routed: a joint (tuple) grpo_loss compiles with fullgraph=True, its streams'
    values traced from the backend's code (no flowrl:: op in the graph), equal to eager within float32
    rounding (no bit-for-bit claim)."""
    g = torch.Generator().manual_seed(0)
    sigmas = torch.tensor(SIGMAS)
    shapes = ((2, 4, 8), (2, 3, 4))
    x, v, prev = ([torch.randn(*s, generator=g) for s in shapes] for _ in range(3))
    old, adv = torch.zeros(2), torch.tensor([1.0, -1.0])

    def step(va, vb):
        return losses.grpo_loss(tuple(x), (va, vb), tuple(prev), sigmas, 1, old_log_prob=old, advantages=adv,
                                clip_range=0.2,
                                stream_weights=(0.5, 0.5), backend="torch").loss

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    eager = step(*v)
    compiled = torch.compile(step, fullgraph=True, backend=record)(*v)
    assert sum(counters["graph_break"].values()) == 0
    assert not any("flowrl" in str(node.target) for gm in graphs for node in gm.graph.nodes)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
