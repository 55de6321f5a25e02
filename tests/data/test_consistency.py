"""flowrl.consistency (issue 23, item 2): the mismatch statistics, verl's rollout-correction weights and
rejection mask against a transcription of verl's definitions, ``rollout_is_weights=`` in the GRPO-family
losses as verl-omni applies them (both backends), the clip-range guard, argument errors, and the
docs/consistency.md snippet.

Transcribed (written out here from the source, for the dense mask diffusion uses) from:
- verl-project/verl commit 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/rollout_corr_helper.py:
  ``compute_rollout_correction_weights``, ``compute_rollout_rejection_mask``, ``_parse_rollout_is_threshold``,
  ``_parse_rollout_rs_thresholds``; verl/utils/torch_functional.py ``masked_sum`` / ``masked_mean``.
- verl-project/verl-omni commit a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
  verl_omni/trainer/diffusion/rollout_correction.py ``apply_rollout_correction_to_diffusion_batch`` (IS weights
  times the RS keep-mask) and verl_omni/trainer/diffusion/diffusion_algos.py ``FlowGRPOLoss.compute_loss``
  (``per_elem_loss * rollout_is_weights.detach()`` then ``torch.mean``).
"""
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.backends import _dispatch
from flowrl import consistency, losses as L


ROOT = Path(__file__).resolve().parents[2]
VERL_COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"
VERL_OMNI_COMMIT = "a1139bafffb5b9711f0a6b6edff8ecaa60bfff30"
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() or _dispatch.interpreter_enabled()), reason="needs CUDA or TRITON_INTERPRET=1")),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------- verl's definitions, transcribed


def _masked_sum(values, mask, axis=None):
    valid = values * mask
    return valid.sum() if axis is None else valid.sum(dim=axis)


def _masked_mean(values, mask, axis=None):
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return _masked_sum(values, mask, axis) / (count + 1e-8)


def verl_is_weights(log_ratio, mask, rollout_is, threshold_spec, batch_normalize=False):
    """compute_rollout_correction_weights (single process)."""
    if isinstance(threshold_spec, str) and "_" in threshold_spec:
        lo, up = threshold_spec.split("_", 1)
        lower, upper = float(lo), float(up)
    else:
        lower, upper = None, float(threshold_spec)
    if rollout_is == "token":
        raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:
        s = _masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(s, min=-20.0, max=20.0)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        keep = (raw >= lower) & (raw <= upper)
        w = torch.where(keep, raw, torch.zeros_like(raw))
    w = w.detach()
    if batch_normalize:
        if rollout_is == "token":
            mean = _masked_mean(w, mask)
        else:
            seq = _masked_mean(w, mask, axis=-1)
            seq_mask = (mask.sum(dim=-1) > 0).to(dtype=w.dtype)
            mean = (seq * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
    return w


def verl_rs_mask(log_ratio, mask, rollout_rs, threshold_spec):
    """compute_rollout_rejection_mask's modified_response_mask (thresholds as _parse_rollout_rs_thresholds)."""
    options = []
    for o in (o.strip() for o in rollout_rs.split(",") if o.strip()):
        if o not in options:
            options.append(o)
    specs = [threshold_spec] if not isinstance(threshold_spec, str) else [p.strip() for p in threshold_spec.split(",")]
    specs = [str(s) for s in specs]
    if len(specs) == 1:
        specs = specs * len(options)
    lr = torch.clamp(log_ratio, min=-20.0, max=20.0)
    k = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    combined = torch.ones_like(mask, dtype=log_ratio.dtype)
    for opt, spec in zip(options, specs):
        est = opt[-2:]
        if est == "k1":
            if "_" in spec:
                lo, up = spec.split("_", 1)
            else:
                up, lo = spec, str(1.0 / float(spec))
            lower_log, upper_log = math.log(float(lo)), math.log(float(up))
        else:
            upper = float(spec)
        stat = k[est]
        if opt.startswith("token"):
            keep = (stat >= lower_log) & (stat <= upper_log) if est == "k1" else stat <= upper
        else:
            if opt.startswith("seq_sum"):
                seq = _masked_sum(stat, mask, axis=-1)
            elif opt.startswith("seq_mean"):
                seq = _masked_mean(stat, mask, axis=-1)
            else:
                seq = stat.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
            seq_keep = (seq >= lower_log) & (seq <= upper_log) if est == "k1" else seq <= upper
            keep = seq_keep.unsqueeze(-1).expand_as(mask.bool())
        combined = combined * keep.to(dtype=log_ratio.dtype)
    return (mask * combined).to(dtype=mask.dtype)


def log_prob_pairs(batch=16, steps=6, seed=0):
    """(rollout, recomputed) float32 [B, T] pairs over mismatch scales from engine noise to far off-policy,
    with a few entries past verl's +-20 clamp."""
    g = torch.Generator().manual_seed(seed)
    for scale in (3e-5, 1e-3, 0.3, 1.5):
        rollout = torch.randn(batch, steps, generator=g) * 3 - 1
        recomputed = rollout + torch.randn(batch, steps, generator=g) * scale
        yield rollout, recomputed
    rollout = torch.randn(batch, steps, generator=g)
    recomputed = rollout.clone()
    recomputed[0, 0] += 25.0
    recomputed[1, :] -= 30.0
    yield rollout, recomputed


# ------------------------------------------------------------------------------------- IS and RS


@pytest.mark.parametrize("level, verl_level", [("step", "token"), ("token", "token"), ("trajectory", "sequence"),
                                               ("sequence", "sequence")])
@pytest.mark.parametrize("threshold, verl_spec", [(2.0, 2.0), (1.0001, 1.0001), ("0.5_5.0", "0.5_5.0"),
                                                  ((0.9, 1.1), "0.9_1.1")])
@pytest.mark.parametrize("normalize", [False, True])
def test_importance_weights_equal_verls(level, verl_level, threshold, verl_spec, normalize):
    for rollout, recomputed in log_prob_pairs():
        mask = torch.ones_like(rollout)
        want = verl_is_weights(recomputed - rollout, mask, verl_level, verl_spec, normalize)
        got = consistency.importance_weights(rollout, recomputed, level=level, threshold=threshold, batch_normalize=normalize)
        assert got.dtype == torch.float32 and got.shape == rollout.shape
        assert torch.equal(got, want)
    # a single step ([B]) is one column
    r, c = next(log_prob_pairs())
    assert torch.equal(consistency.importance_weights(r[:, 2], c[:, 2]), consistency.importance_weights(r[:, 2:3], c[:, 2:3]))


@pytest.mark.parametrize("criterion, threshold, verl_spec", [
    ("token_k1", (0.5, 2.0), "0.5_2.0"), ("token_k1", 1.001, 1.001), ("token_k2", 1e-4, 1e-4), ("token_k3", 0.01, 0.01),
    ("seq_sum_k1", "0.5_2.0", "0.5_2.0"), ("seq_sum_k2", 0.05, 0.05), ("seq_sum_k3", 0.05, 0.05),
    ("seq_mean_k1", (0.999, 1.001), "0.999_1.001"), ("seq_mean_k2", 1e-3, 1e-3), ("seq_mean_k3", 1e-3, 1e-3),
    ("seq_max_k2", 1e-2, 1e-2), ("seq_max_k3", 1e-2, 1e-2),
    ("token_k1,seq_max_k3", "0.5_2.0,0.01", "0.5_2.0,0.01"), ("seq_mean_k3,token_k2", 0.02, 0.02),
])
def test_rejection_mask_equals_verls(criterion, threshold, verl_spec):
    kept_any = rejected_any = False
    for rollout, recomputed in log_prob_pairs():
        mask = torch.ones_like(rollout)
        want = verl_rs_mask(recomputed - rollout, mask, criterion, verl_spec)
        got = consistency.rejection_mask(rollout, recomputed, criterion=criterion, threshold=threshold)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        kept_any, rejected_any = kept_any or bool(got.any()), rejected_any or not bool(got.all())
    assert kept_any and rejected_any  # the thresholds bite


def test_correction_weights_fold_is_and_rs_as_verl_omni():
    """verl-omni's apply_rollout_correction_to_diffusion_batch: IS weights times the RS keep-mask; the
    verl presets Token-TIS, Seq-TIS and Seq-MIS (decoupled_seq_is_rs: sequence IS at 2.0, seq_sum_k1 at 0.5_2.0)."""
    for rollout, recomputed in log_prob_pairs():
        mask = torch.ones_like(rollout)
        lr = recomputed - rollout
        seq_mis = consistency.correction_weights(rollout, recomputed, rollout_is="sequence", rollout_is_threshold=2.0,
                                       rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
        want = verl_is_weights(lr, mask, "sequence", 2.0) * verl_rs_mask(lr, mask, "seq_sum_k1", "0.5_2.0")
        assert torch.equal(seq_mis, want)
        assert torch.equal(consistency.correction_weights(rollout, recomputed, rollout_is="token"),
                           verl_is_weights(lr, mask, "token", 2.0))
        assert torch.equal(consistency.correction_weights(rollout, recomputed, rollout_rs="token_k2", rollout_rs_threshold=1e-3),
                           verl_rs_mask(lr, mask, "token_k2", 1e-3))
    # a trajectory weight is the same in every column
    w = consistency.importance_weights(rollout, recomputed, level="trajectory")
    assert torch.equal(w, w[:, :1].expand_as(w))


def test_arguments_are_checked_naming_them():
    r, c = next(log_prob_pairs())
    cases = [
        (TypeError, "rollout_log_probs must be a float tensor", lambda: consistency.mismatch(r.tolist(), c)),
        (TypeError, "recomputed_log_probs must be a float tensor", lambda: consistency.mismatch(r, c.long())),
        (ValueError, "must have the same shape", lambda: consistency.mismatch(r, c[:, :3])),
        (TypeError, "same dtype", lambda: consistency.mismatch(r, c.double())),
        (ValueError, r"recomputed_log_probs is nan at index \(1, 2\)",
         lambda: consistency.mismatch(r, c.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor([float("nan")])))),
        (ValueError, "steps must name one loop step per column", lambda: consistency.mismatch(r, c, steps=[0, 1])),
        (ValueError, "clip_range", lambda: consistency.mismatch(r, c, clip_range=-0.1)),
        (ValueError, "level must be one of", lambda: consistency.importance_weights(r, c, level="tok")),
        (ValueError, "threshold must be > 0", lambda: consistency.importance_weights(r, c, threshold=0.0)),
        (ValueError, "threshold: lower 3.0 must be <= upper 2.0", lambda: consistency.importance_weights(r, c, threshold=(3.0, 2.0))),
        (ValueError, "threshold must be a number", lambda: consistency.importance_weights(r, c, threshold="a_b")),
        (TypeError, "batch_normalize must be a bool", lambda: consistency.importance_weights(r, c, batch_normalize=1)),
        (ValueError, "criterion: 'seq_max_k1' is not one of", lambda: consistency.rejection_mask(r, c, criterion="seq_max_k1",
                                                                                       threshold=2.0)),
        (ValueError, "threshold for token_k2 must be a single upper bound",
         lambda: consistency.rejection_mask(r, c, criterion="token_k2", threshold="0.1_2")),
        (ValueError, "one for all 2 criteria or one each",
         lambda: consistency.rejection_mask(r, c, criterion="token_k2,token_k3", threshold="1,2,3")),
        (ValueError, "pass rollout_is", lambda: consistency.correction_weights(r, c)),
        (ValueError, "rollout_rs_threshold must be given", lambda: consistency.correction_weights(r, c, rollout_rs="token_k1")),
        (TypeError, "measured must be", lambda: consistency.guard_clip_range(0.2, {"x": 1})),
        (ValueError, "floor must be one of", lambda: consistency.guard_clip_range(0.2, consistency.mismatch(r, c), floor="p50")),
    ]
    for exc, pattern, call in cases:
        with pytest.raises(exc, match=pattern):
            call()


# --------------------------------------------------------------------------------- mismatch, guard


def test_mismatch_statistics_per_step_and_overall():
    rollout, recomputed = list(log_prob_pairs())[1]
    m = consistency.mismatch(rollout, recomputed, clip_range=(1e-3, 2e-3), steps=[1, 3, 5, 7, 9, 11], warn=False)
    d = (recomputed.double() - rollout.double())
    for stats, cols in [(m.overall, d)] + [(m.per_step[j], d[:, j]) for j in range(d.shape[1])]:
        a, r = cols.abs().flatten(), torch.expm1(cols).abs().flatten()
        assert stats.count == a.numel()
        assert stats.dlogp_abs_mean == float(a.mean()) and stats.dlogp_abs_max == float(a.max())
        assert stats.ratio_dev_mean == float(r.mean()) and stats.ratio_dev_max == float(r.max())
        assert stats.dlogp_abs_p99 == float(torch.quantile(a, 0.99))
        assert stats.ratio_dev_p99 == float(torch.quantile(r, 0.99))
        assert stats.dlogp_abs_mean <= stats.dlogp_abs_p99 <= stats.dlogp_abs_max
        assert isinstance(stats.clip_fraction, float) and 0 < stats.clip_fraction < 1
    logged = m.to_dict()
    assert all(type(v) is float for v in logged.values())
    assert logged["rollout_corr/ratio_dev_max"] == m.overall.ratio_dev_max
    assert logged["rollout_corr/step_5/clip_fraction"] == m.per_step[2].clip_fraction
    assert "rollout_corr/clip_fraction" not in consistency.mismatch(rollout, recomputed).to_dict()


@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_fraction_is_the_first_updates_clip_fraction_of_grpo_loss(backend):
    """mismatch(...).clip_fraction of a step is grpo_loss's clip_fraction at the first update, when the old
    log-probs are the engine's: the same ratio exp(recomputed - rollout) in float32."""
    x, v, prev, sig = _step(batch=64)
    lp = flowrl.step_log_prob(x, v, prev, sig, 3, backend=backend)
    g = torch.Generator().manual_seed(5)
    engine = lp + torch.randn(lp.shape, generator=g).to(lp.device) * 3e-4  # another engine's rounding
    for clip in (1e-4, (2e-4, 5e-4), 0.2):
        out = L.grpo_loss(x, v, prev, sig, 3, old_log_prob=engine, advantages=torch.ones_like(lp), clip_range=clip,
                          backend=backend)
        m = consistency.mismatch(engine, out.log_prob, clip_range=clip, warn=False)
        assert m.overall.clip_fraction == float(out.clip_fraction)
    assert m.overall.clip_fraction == 0.0 and float(consistency.mismatch(engine, lp, clip_range=1e-4, warn=False)
                                                   .overall.clip_fraction) > 0.3


def test_guard_warns_once_naming_the_clip_range_and_the_floor():
    rollout, recomputed = list(log_prob_pairs())[0]  # engine noise ~3e-5
    consistency._reset_warning()
    try:
        floor = consistency.mismatch(rollout, recomputed, warn=False).overall.ratio_dev_mean
        assert 1e-5 < floor < 1e-4
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert consistency.guard_clip_range(1e-4, consistency.mismatch(rollout, recomputed, clip_range=1e-4))  # above: silent
        with pytest.warns(consistency.ClipBelowMismatchWarning) as caught:
            consistency.mismatch(rollout, recomputed, clip_range=(1e-5, 1e-3))
        text = str(caught[0].message)
        assert re.search(r"clip range \(eps_low=1e-05, eps_high=0\.001: the smaller, 1e-05", text)
        assert f"mismatch floor (|ratio - 1| mean = {floor:.3g}" in text
        assert re.search(r"\d+\.\d% of them would clip at this range", text)
        with warnings.catch_warnings():  # once per process
            warnings.simplefilter("error")
            assert not consistency.guard_clip_range(1e-6, consistency.mismatch(rollout, recomputed, warn=False))
            consistency.mismatch(rollout, recomputed, clip_range=1e-6)
        # the floor statistic is selectable: a clip range between the mean and the max passes at "mean" only
        m = consistency.mismatch(rollout, recomputed, warn=False)
        between = (m.overall.ratio_dev_mean + m.overall.ratio_dev_max) / 2
        assert consistency.guard_clip_range(between, m) and not consistency.guard_clip_range(between, m, floor="max")
    finally:
        consistency._reset_warning()


# ------------------------------------------------------------------------- rollout_is_weights= in losses


def _step(batch=4, shape=(2, 300), seed=0, steps=10):
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    sig = (3 * t / (1 + 2 * t)).float().to(DEVICE)
    x = torch.randn(batch, *shape, generator=g).to(DEVICE)
    v = torch.randn(batch, *shape, generator=g).to(DEVICE)
    out = flowrl.sde_step(x, v, sig, 3, noise_level=0.7, noise_seed=7, backend="torch")
    return x, v, out.prev_sample, sig


LOSSES = ["grpo", "grpo_guard", "flow_dppo", "awm"]


def _loss(name, backend, v_new, weights, x, prev, sig, old, adv):
    if name == "awm":
        g = torch.Generator().manual_seed(9)
        noise, clean = torch.randn(x.shape, generator=g).to(DEVICE), torch.randn(x.shape, generator=g).to(DEVICE)
        return L.awm_loss(v_new, noise, clean, 0.6, old_log_prob=old - 0.4, advantages=adv, clip_range=0.2,
                          backend=backend,
                          rollout_is_weights=weights)
    common = dict(backend=backend, rollout_is_weights=weights)
    if name == "grpo":
        return L.grpo_loss(x, v_new, prev, sig, 3, old_log_prob=old, advantages=adv, clip_range=(0.02, 0.03), **common)
    if name == "grpo_guard":
        return L.grpo_guard_loss(x, v_new, prev, sig, 3, old_log_prob=old, advantages=adv, clip_range=0.02,
                                 noise_seed=7, **common)
    return L.flow_dppo_loss(x, v_new, prev, sig, 3, old_log_prob=old, advantages=adv, kl_threshold=1e-4,
                            noise_seed=7, **common)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_is_weights_multiply_each_samples_surrogate_before_the_mean(name, backend):
    """The per-sample policy loss s_i times w_i, then the batch mean (verl-omni's FlowGRPOLoss /
    FlowDPPOLoss / GRPOGuardLoss): s_i is recovered exactly from one-hot weights (B = 4, a power of two),
    and the weighted loss is mean(s * w) bit for bit; gradients scale with the weights exactly (w = 2)
    and vanish for a rejected sample (w = 0). One formula for both backends: the weight multiplies the
    per-sample surrogate after the fused kernels, and its grad flows into their backward."""
    x, v, prev, sig = _step()
    old = flowrl.step_log_prob(x, v, prev, sig, 3, backend="torch")
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], device=DEVICE)
    v_new = (v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE))
    B = x.shape[0]
    plain = _loss(name, backend, v_new, None, x, prev, sig, old, adv)
    per_sample = torch.stack([
        _loss(name, backend, v_new, torch.eye(B, device=DEVICE)[k], x, prev, sig, old, adv).policy_loss * B
        for k in range(B)])
    assert torch.allclose(per_sample.mean(), plain.policy_loss, rtol=1e-6, atol=0)
    w = torch.tensor([0.5, 1.75, 0.0, 1.25], device=DEVICE)
    weighted = _loss(name, backend, v_new, w, x, prev, sig, old, adv)
    assert torch.equal(weighted.policy_loss, (per_sample * w).mean())
    assert torch.equal(weighted.ratio, plain.ratio) and torch.equal(weighted.log_prob, plain.log_prob)

    def grad(weights):
        vv = v_new.clone().requires_grad_(True)
        _loss(name, backend, vv, weights, x, prev, sig, old, adv).loss.backward()
        return vv.grad

    g1 = grad(None)
    assert torch.equal(grad(torch.full((B,), 2.0, device=DEVICE)), 2 * g1)
    g0 = grad(torch.tensor([1.0, 1.0, 0.0, 1.0], device=DEVICE))
    assert not bool(g0[2].any()) and torch.equal(g0[[0, 1, 3]], g1[[0, 1, 3]])


def test_grpo_loss_with_weights_equals_verl_omnis_flow_grpo_loss():
    """verl-omni FlowGRPOLoss.compute_loss, transcribed: ratio = exp(log_prob - old), max(-A ratio,
    -A clamp(ratio, 1 - eps, 1 + eps)) * w.detach(), torch.mean; flowrl's log_prob in, bit for bit."""
    x, v, prev, sig = _step()
    old = flowrl.step_log_prob(x, v, prev, sig, 3, backend="torch")
    rollout = old + torch.tensor([-3e-4, 2e-4, -5e-1, 1e-5], device=DEVICE)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], device=DEVICE)
    w = consistency.correction_weights(rollout[:, None], old[:, None], rollout_is="token", rollout_is_threshold=1.2)[:, 0]
    v_new = v + 0.01
    out = L.grpo_loss(x, v_new, prev, sig, 3, old_log_prob=old, advantages=adv, clip_range=0.02, backend="torch",
                      rollout_is_weights=w)
    ratio = torch.exp(out.log_prob - old)
    per = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - 0.02, 1.0 + 0.02)) * w.detach()
    assert torch.equal(out.policy_loss, torch.mean(per))
    assert float(w[2]) == float(torch.tensor(1.2)) and float(w[1]) < 1 < float(w[0])  # the truncation bites


def test_loss_refuses_bad_rollout_is_weights():
    x, v, prev, sig = _step()
    old, adv = torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    for bad, exc, pattern in ((torch.ones(3), ValueError, r"rollout_is_weights must have shape \[B\] = \[4\]"),
                              (torch.ones(4, dtype=torch.int64), TypeError, "rollout_is_weights must be a float"),
                              ([1.0] * 4, TypeError, "rollout_is_weights must be a float tensor"),
                              (torch.ones(4, requires_grad=True), ValueError, "rollout_is_weights requires grad")):
        bad = bad.to(DEVICE) if isinstance(bad, torch.Tensor) and not bad.requires_grad else bad
        with pytest.raises(exc, match=pattern):
            L.grpo_loss(x, v, prev, sig, 3, old_log_prob=old, advantages=adv, clip_range=0.2, backend="torch",
                        rollout_is_weights=bad)


# ------------------------------------------------------------------------------------------- docs


def test_docs_consistency_snippet_runs():
    text = (ROOT / "docs" / "consistency.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/consistency.md has a python snippet"
    consistency._reset_warning()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", consistency.ClipBelowMismatchWarning)
            scope = {}
            exec(compile(blocks[0], "docs/consistency.md", "exec"), scope)
    finally:
        consistency._reset_warning()
    assert VERL_COMMIT in text and VERL_OMNI_COMMIT in text
