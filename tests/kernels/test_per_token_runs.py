"""The elementwise steps' pre-pass and token runs (issue 21; kernels/token.py, kernels/step.py's
``_element_terms``), on the Triton backend through the interpreter:

- the pre-pass's division multipliers (the host's, stored in its header) give ``n // d`` for every
  numerator below 2**31 the kernels can meet (checked at the edges: multiples of d and their
  neighbours, the largest numerators);
- its records are ``flowrl.backends.reference.token_coefficients``' bits (a, c, std; held tokens (1, 0, 0)),
  with the sample's weight ``var_sample_d / var_token_d`` and -1 for a held token;
- one lookup per run of RUN elements gives the bits of one lookup per element (RUN forced to 1) for
  every op and every output: samples, log-probs, means, counts, KL, gradients, the GRPO loss terms.
"""
import pytest
import torch

import flowrl
from flowrl.backends import _triton_ops, reference
from flowrl.contract import LogProbKind, Mode, Op, Reduction
from flowrl.core.step_spec import StepSpec, elementwise_inputs, flat_layout

triton = pytest.importorskip("triton")

from test_per_token import SIGMAS  # noqa: E402

DIVISORS = [1, 2, 3, 5, 7, 8, 35, 64, 1000, 4095, 6241, 65537, (1 << 20) + 1, 1 << 30, (1 << 31) - 1]


def _header(inners):
    """The pre-pass's header words (uint32) for the four divisors ``inners``: the host's multipliers
    (_triton_ops.division_magic) as the pre-pass stores them."""
    from flowrl.kernels.token import token_table_kernel

    table = torch.zeros(8, dtype=torch.float32)
    dummy = torch.zeros(2, dtype=torch.float32)
    token_table_kernel[(1,)](dummy, table, dummy, torch.zeros(1, dtype=torch.int64), 1, 0, 1, 0.0, 0.0, 0.0, 1,
                             *(w for d in inners for w in _triton_ops.division_magic(d)), MODE=int(Mode.SDE),
                             PER_TOKEN=False, BLOCK=16)
    return [int(w) & 0xFFFFFFFF for w in table.view(torch.int32).tolist()]


@pytest.mark.parametrize("start", range(0, len(DIVISORS), 4))
def test_division_multipliers_are_exact_below_2_pow_31(start):
    ds = (DIVISORS[start:start + 4] + [1, 1, 1])[:4]
    words = _header(ds)
    for k, d in enumerate(ds):
        m, shift = words[2 * k], words[2 * k + 1]
        assert m < 1 << 32 and shift <= 31
        top = (1 << 31) - 1
        ns = {0, 1, top, top - 1, top - d, d * ((top // d) - 1)}
        for q in (1, 2, 3, 1000, top // d // 2, top // d):
            ns |= {q * d - 1, q * d, q * d + 1}
        ns = sorted(n for n in ns if 0 <= n <= top)
        # the kernels' common.compact_index: umulhi(2 n, m) >> l
        got = [((2 * n * m) >> 32) >> shift for n in ns]
        assert got == [n // d for n in ns], d


def _spec(x, ts, fz, step, mode, eta, kind=LogProbKind.GAUSSIAN):
    idx = torch.as_tensor(step).expand(x.shape[0]).contiguous()
    return StepSpec(Op.LOG_PROB, SIGMAS, idx, Mode.parse("mode", mode), eta, kind, Reduction.MEAN,
                    x.numel() // x.shape[0], **elementwise_inputs(x, SIGMAS, ts, fz, Mode.parse("mode", mode)))


@pytest.mark.parametrize("mode,eta", [("sde", 0.7), ("cps", 0.5), ("dance", 0.4), ("ode", 0.0), ("flash_sde", 0.6)])
def test_pre_pass_records_are_the_reference_token_coefficients(mode, eta):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 4, 6, dtype=torch.bfloat16)
    ts = SIGMAS[torch.randint(0, 8, (1, 1, 4, 6), generator=g)]  # one row shared by the batch
    ts[0, 0, 0, :2] = 0.0  # held tokens
    spec = _spec(x, ts, None, torch.tensor([0, 3, 6]), mode, eta)
    ks = _triton_ops._KernelScalars(spec, x.shape, storage=x.dtype)
    table, inner, groups, stride = (ks.elementwise[k] for k in ("tok_ptr", "tok_inner", "tok_groups", "tok_stride"))
    assert (inner, groups, stride) == (1, 24, 24)
    records = table[8:].reshape(3, groups, 4)
    a, c, std = (flat_layout(t.expand(1, *t.shape[1:]), x.shape)[0] for t in reference.token_coefficients(spec, torch.float32))
    # a and c: the reference's bits. std: within one float32 ulp, the CPU reference's torch.sqrt being
    # vectorized (not correctly rounded) where the kernels' sqrt_rn is IEEE
    for k in range(3):
        assert torch.equal(records[k, :, 0], a[0]) and torch.equal(records[k, :, 1], c[0])
        torch.testing.assert_close(records[k, :, 2], std[0], rtol=2 ** -23, atol=0)
    held = flat_layout(spec.token_sigmas == spec.token_sigmas_next, x.shape)[0][0]
    assert held.any() and torch.equal(records[:, :, 3] < 0, held.expand(3, -1))
    assert torch.equal(records[:, held, :3], torch.tensor([1.0, 0.0, 0.0]).expand(3, int(held.sum()), 3))
    # the weight: var_sample_d / var_token_d, with the sample's std as the Triton finalize reports it
    std_ref = flowrl.sde_step(x, x, SIGMAS, spec.step_index, noise=torch.zeros(x.shape), mode=mode, noise_level=eta,
                              backend="triton").std_dev.reshape(3, 1)
    _, ref_d = reference.density_std(std_ref)
    _, tok_d = reference.density_std(records[:, :, 2])
    weight = (ref_d * ref_d) / (tok_d * tok_d)
    assert torch.equal(records[:, :, 3][:, ~held], weight[:, ~held])


# (sample shape, per-token sigmas' shape or None, frozen mask's shape or None): RUN 8 (a frame of
# 8 x 8), 4 and 2 (tokens of 4 and 6 channels), 1 (odd inners; per-element sigmas)
LAYOUTS = [((2, 3, 4, 8, 8), (2, 1, 4, 1, 1), (1, 1, 4, 1, 1)),
           ((2, 40, 4), (2, 40, 1), (2, 40, 1)),
           ((2, 40, 6), (1, 40, 1), None),
           ((2, 3, 5, 7), (2, 1, 5, 1), (1, 3, 1, 1)),
           ((2, 16, 66), (2, 16, 66), (1, 16, 1)),
           ((2, 2, 9, 16), None, (1, 2, 9, 1))]


def _outputs(x, v, v_ref, noise, ts, fz, step, mode, eta):
    kw = dict(token_sigmas=ts, frozen=fz, backend="triton", mode=mode, noise_level=eta)
    out = flowrl.sde_step(x, v, SIGMAS, step, noise=noise, **kw)
    seeded = flowrl.sde_step(x, v, SIGMAS, step, noise_seed=torch.tensor([5, 6]), **kw)
    res = [out.prev_sample, out.log_prob, out.prev_sample_mean, out.count, seeded.prev_sample, seeded.log_prob]
    for kind in ("gaussian", "sq_err"):
        xg, vg, pg = (t.clone().requires_grad_() for t in (x, v, out.prev_sample))
        lp = flowrl.step_log_prob(xg, vg, pg, SIGMAS, step, log_prob_kind=kind, **kw)
        lp.sum().backward()
        res += [lp, xg.grad, vg.grad, pg.grad]
    vk = v.clone().requires_grad_()
    kl = flowrl.step_kl(x, vk, v_ref, SIGMAS, step, **kw)
    kl.sum().backward()
    res += [kl, vk.grad]
    # the GRPO-family loss pass (kernels/loss.py): its log-prob, the KL, mu_old given and replayed
    for old in (dict(old_prev_sample_mean=out.prev_sample_mean), dict(noise_seed=torch.tensor([5, 6]))):
        vl = v.clone().requires_grad_()
        prev = out.prev_sample if "old_prev_sample_mean" in old else seeded.prev_sample
        loss = flowrl.losses.flow_dppo_loss(x, vl, prev, SIGMAS, step, old_log_prob=out.log_prob.detach() - 0.01,
                                            advantages=torch.tensor([1.0, -0.5]), kl_threshold=1e9, kl_coef=0.3,
                                            ref_model_output=v_ref, **old, **kw)
        loss.loss.backward()
        res += [loss.loss, loss.log_prob, loss.kl, loss.trust_divergence, vl.grad]
    return res


_SLOW = pytest.mark.slow  # ~10-20 s each through the interpreter: the full suite's (the quick loop's longest was bf16 sde)


@pytest.mark.parametrize("dtype,mode,eta", [pytest.param(torch.bfloat16, "sde", 0.7, marks=_SLOW),
                                            pytest.param(torch.float32, "sde", 0.7, marks=_SLOW),
                                            pytest.param(torch.bfloat16, "cps", 0.5, marks=_SLOW),
                                            pytest.param(torch.float32, "cps", 0.5, marks=_SLOW)])
def test_token_runs_give_the_per_element_lookups_bits(dtype, mode, eta, monkeypatch):
    """Every output of every op (the step ops and the GRPO-family loss pass) with one lookup per RUN
    elements equals, bit for bit, the same call with RUN forced to 1 (one lookup per element)."""
    g = torch.Generator().manual_seed(7)
    step = torch.tensor([1, 5])
    runs = set()
    for shape, tshape, fshape in LAYOUTS:
        x, v, noise = (torch.randn(shape, generator=g) for _ in range(3))
        v_ref = v + 0.1 * torch.randn(shape, generator=g)
        x, v, v_ref = x.to(dtype), v.to(dtype), v_ref.to(dtype)
        ts = None
        if tshape is not None:
            ts = SIGMAS[torch.randint(0, 8, tshape, generator=g)]
            ts.view(-1)[0] = 0.0  # a held token
        fz = None if fshape is None else torch.rand(fshape, generator=g) < 0.3
        natural = _outputs(x, v, v_ref, noise, ts, fz, step, mode, eta)
        spec = _spec(x, ts, fz, step, mode, eta)
        runs.add(_triton_ops._KernelScalars(spec, x.shape, storage=x.dtype).switches["RUN"])
        with monkeypatch.context() as m:
            m.setattr(_triton_ops, "token_run", lambda inners, storage=None: 1)
            per_element = _outputs(x, v, v_ref, noise, ts, fz, step, mode, eta)
        for k, (a, b) in enumerate(zip(natural, per_element)):
            assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) \
                if a.dtype != torch.bool else torch.equal(a, b), (shape, k)
    assert runs == ({8, 4, 2, 1} if dtype == torch.bfloat16 else {4, 2, 1})


def test_samples_of_2_pow_31_elements_are_refused_with_a_mask():
    """The element kernels' index math runs in 32 bits: an elementwise step on a sample of 2**31
    elements is refused (a ValueError naming the limit), not computed with wrapped indices."""
    x = torch.zeros(1, 4)
    spec = _spec(x, None, torch.zeros(1, 1, dtype=torch.bool), 0, "sde", 0.7)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        _triton_ops._KernelScalars(spec, (1, 1 << 31), storage=torch.bfloat16)
    _triton_ops._KernelScalars(spec, (1, (1 << 31) - 1), storage=torch.bfloat16)  # the largest allowed
