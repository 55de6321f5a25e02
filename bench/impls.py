"""The step suite's implementations (bench/run.py): flowrl-triton, flowrl-torch, eager (the Flow-GRPO-style
baseline, bench/baseline.py) and compile (torch.compile of it), each built as a no-argument callable
returning the op's outputs (``build``)."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

import baseline
from cases import COND_OPS, FLOWRL_BACKEND, NOISE_LEVEL, STEP_INDEX, Case, base_op, noise_level

import flowrl
from flowrl.backends import reference
from flowrl.core import _validate as V


def _check_cond(case: Case, op: str) -> None:
    if op in COND_OPS and case.token_sigmas is None:
        raise ValueError(f"{op} needs a 5-D video shape [B, C, F, H, W]; got {case.shape}")


def _flowrl_cond_fn(case: Case, op: str, backend: str) -> Callable[[], Tuple[torch.Tensor, ...]]:
    common = dict(mode=case.mode, noise_level=noise_level(case.mode), backend=backend, token_sigmas=case.token_sigmas,
                  frozen=case.frozen, log_prob_kind=case.log_prob_kind)
    if op == "rollout_cond":
        def fn():
            out = flowrl.sde_step(case.x, case.v, case.sigmas, STEP_INDEX, noise=case.noise,
                                  return_prev_sample_mean=False, **common)
            return out.prev_sample[:, :, 1:], out.log_prob
    elif op == "recompute_fwd_cond":
        def fn():
            with torch.no_grad():
                return (flowrl.step_log_prob(case.x, case.v, case.prev_cond, case.sigmas, STEP_INDEX, **common),)
    else:
        def fn():
            lp = flowrl.step_log_prob(case.x, case.v_grad, case.prev_cond, case.sigmas, STEP_INDEX, **common)
            (grad,) = torch.autograd.grad(lp, case.v_grad, case.grad_out)
            return lp.detach(), grad
    return fn


def _flowrl_fn(case: Case, op: str, backend: str) -> Callable[[], Tuple[torch.Tensor, ...]]:
    if op in COND_OPS:
        _check_cond(case, op)
        return _flowrl_cond_fn(case, op, backend)
    common = dict(mode=case.mode, noise_level=noise_level(case.mode), backend=backend, prev_x0_pred=case.x0_prev)
    if op == "rollout_tree":
        def fn():
            out = flowrl.sde_step(case.x, case.v, case.sigmas, STEP_INDEX, noise_seed=case.tree_keys,
                                  log_prob_kind=case.log_prob_kind, return_prev_sample_mean=False, **common)
            return out.prev_sample, out.log_prob
    elif op == "rollout":
        def fn():
            out = flowrl.sde_step(
                case.x, case.v, case.sigmas, STEP_INDEX, noise=case.noise, log_prob_kind=case.log_prob_kind,
                return_prev_sample_mean=False, **common,
            )
            return out.prev_sample, out.log_prob
    elif op == "recompute_fwd":
        def fn():
            with torch.no_grad():
                return (flowrl.step_log_prob(
                    case.x, case.v, case.prev, case.sigmas, STEP_INDEX, log_prob_kind=case.log_prob_kind, **common),)
    elif op == "recompute_fwd_bwd":
        def fn():
            lp = flowrl.step_log_prob(
                case.x, case.v_grad, case.prev, case.sigmas, STEP_INDEX, log_prob_kind=case.log_prob_kind, **common)
            (grad,) = torch.autograd.grad(lp, case.v_grad, case.grad_out)
            return lp.detach(), grad
    elif op == "kl_fwd_bwd":
        def fn():
            kl = flowrl.step_kl(case.x, case.v_grad, case.v_ref, case.sigmas, STEP_INDEX, **common)
            (grad,) = torch.autograd.grad(kl, case.v_grad, case.grad_out)
            return kl.detach(), grad
    else:
        raise ValueError(f"unknown op {op!r}")
    return fn


# Module-level so torch.compile keys its cache on a few code objects; mode/out_dtype are constants.
def _baseline_rollout(x, v, noise, sigmas, step_index, sigma_max, mode, x0_prev, out_dtype):
    if mode == "dpm_sde":
        return baseline.mixgrpo_dpm_step(x, v, x0_prev, sigmas, step_index, noise=noise, out_dtype=out_dtype)
    if mode == "ddim":  # sigmas: the alpha-bar table (baseline.ddim_alpha_bar_table)
        return baseline.ddpo_step(x, v, sigmas, step_index, noise_level=NOISE_LEVEL, noise=noise, out_dtype=out_dtype)
    prev, lp, _, _ = baseline.flow_grpo_step(
        x, v, sigmas, step_index, sigma_max, mode=mode, noise_level=NOISE_LEVEL, noise=noise, out_dtype=out_dtype)
    return prev, lp


def _baseline_log_prob(x, v, prev, sigmas, step_index, sigma_max, mode, x0_prev):
    if mode == "dpm_sde":
        return baseline.mixgrpo_dpm_step(x, v, x0_prev, sigmas, step_index, prev_sample=prev)[1]
    if mode == "ddim":
        return baseline.ddpo_step(x, v, sigmas, step_index, noise_level=NOISE_LEVEL, prev_sample=prev)[1]
    return baseline.flow_grpo_step(
        x, v, sigmas, step_index, sigma_max, mode=mode, noise_level=NOISE_LEVEL, prev_sample=prev)[1]


def _baseline_kl(x, v, v_ref, sigmas, step_index, sigma_max, mode, x0_prev):
    if mode == "dpm_sde":
        return baseline.mixgrpo_dpm_kl(x, v, v_ref, x0_prev, sigmas, step_index)
    if mode == "ddim":
        return baseline.ddpo_kl(x, v, v_ref, sigmas, step_index, noise_level=NOISE_LEVEL)
    return baseline.flow_grpo_kl(x, v, v_ref, sigmas, step_index, sigma_max, mode=mode, noise_level=NOISE_LEVEL)


def _set_recompile_limit(limit: int) -> None:
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # renamed across torch versions
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(limit, getattr(torch._dynamo.config, name)))


_COMPILED: Dict[str, Callable] = {}


def _compiled(name: str, fn: Callable) -> Callable:
    if name not in _COMPILED:
        _set_recompile_limit(64)  # one code object serves every mode, dtype and grad mode
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


def _baseline_fn(case: Case, op: str, compiled: bool) -> Callable[[], Tuple[torch.Tensor, ...]]:
    if compiled:
        flat = lambda t: t.reshape(t.shape[0], -1)  # noqa: E731  (a view: inputs are contiguous)
        rollout = _compiled("rollout", _baseline_rollout)
        log_prob = _compiled("log_prob", _baseline_log_prob)
        kl = _compiled("kl", _baseline_kl)
    else:
        flat = lambda t: t  # noqa: E731
        rollout, log_prob, kl = _baseline_rollout, _baseline_log_prob, _baseline_kl
    x0_prev = None if case.x0_prev is None else flat(case.x0_prev)
    scalars = (case.sigmas, case.step_index, case.sigma_max, case.mode, x0_prev)
    if op in COND_OPS:  # the conditioning frame sliced off by hand, as trainers do it today
        _check_cond(case, op)
        cut = lambda t: flat(t[:, :, 1:])  # noqa: E731
        x, v, prev = cut(case.x), cut(case.v), cut(case.prev_cond)
        op = base_op(op)
        if op == "rollout":
            noise = cut(case.noise)

            def fn():
                prev_out, lp = rollout(x, v, noise, *scalars, case.dtype)
                return prev_out.reshape(case.x[:, :, 1:].shape), lp
        elif op == "recompute_fwd":
            def fn():
                with torch.no_grad():
                    return (log_prob(x, v, prev, *scalars),)
        else:
            def fn():
                lp = log_prob(x, cut(case.v_grad), prev, *scalars)
                (grad,) = torch.autograd.grad(lp, case.v_grad, case.grad_out)
                return lp.detach(), grad
        return fn
    noise = case.noise
    if op == "rollout_tree":  # the rows' node noise, materialized once (not timed)
        noise = reference.philox_normal(V.check_noise_seed(case.tree_keys, case.x), case.x[0].numel())
        noise, op = noise.reshape(case.shape), "rollout"
    x, v, v_grad, prev, v_ref, noise = map(flat, (case.x, case.v, case.v_grad, case.prev, case.v_ref, noise))
    if op == "rollout":
        def fn():
            prev_out, lp = rollout(x, v, noise, *scalars, case.dtype)
            return prev_out.reshape(case.shape), lp
    elif op == "recompute_fwd":
        def fn():
            with torch.no_grad():
                return (log_prob(x, v, prev, *scalars),)
    elif op == "recompute_fwd_bwd":
        def fn():
            lp = log_prob(x, v_grad, prev, *scalars)
            (grad,) = torch.autograd.grad(lp, case.v_grad, case.grad_out)
            return lp.detach(), grad
    elif op == "kl_fwd_bwd":
        def fn():
            value = kl(x, v_grad, v_ref, *scalars)
            (grad,) = torch.autograd.grad(value, case.v_grad, case.grad_out)
            return value.detach(), grad
    else:
        raise ValueError(f"unknown op {op!r}")
    return fn


def build(impl: str, case: Case, op: str) -> Callable[[], Tuple[torch.Tensor, ...]]:
    if impl in FLOWRL_BACKEND:
        return _flowrl_fn(case, op, FLOWRL_BACKEND[impl])
    if impl in ("eager", "compile"):
        return _baseline_fn(case, op, compiled=impl == "compile")
    raise ValueError(f"unknown impl {impl!r}")
