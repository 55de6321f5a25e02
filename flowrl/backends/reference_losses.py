"""The torch backend's half of ``flowrl.losses``: the per-sample values the losses reduce, in plain
torch with ``flowrl.backends.reference``'s ops and math (the oracle the loss kernels, flowrl.backends._triton_losses,
are tested against). Reached through the backend table (``flowrl.backends._dispatch``), like the step ops;
the per-sample [B] arithmetic after these reductions is flowrl.losses', shared by both backends.
"""
from __future__ import annotations

import dataclasses

import torch

from . import reference
from ..contract import FlowLoss, KLSpace, LogProbKind, Op, Reduction, TrustSource
from ..core._validate import NoiseSeed
from ..core.loss_spec import GRPOInputs, GRPOLossSpec
from ..core.step_spec import StepSpec


def guided_reference(x, v, uncond, cond, scale):
    """The reference's guided output from its two branches, uncond + w (cond - uncond) in the compute
    dtype, in that operation order (kernels/loss.py's ``_guided_reference``; the peers' CFG line)."""
    dtype = reference.compute_dtype(x, v, uncond, cond)
    u = reference._rows(uncond).to(dtype)
    return u + scale * (reference._rows(cond).to(dtype) - u)


def velocity_kl(spec, x, v, ref):
    """The velocity-space KL [B]: (v - v_ref)^2 per element, reduced in the contract's chunked order,
    divided by the element count for ``reduction="mean"`` (no std: a deterministic step has one too)."""
    dtype = reference.compute_dtype(x, v, ref)
    d = reference._rows(v).to(dtype) - reference._rows(ref).to(dtype)
    total = reference.combine_partials(spec.gather(reference._chunk_partials(d * d, consume=True)))
    return total / spec.numel if spec.reduction is Reduction.MEAN else total


def grpo_values(loss: GRPOLossSpec, inputs: GRPOInputs):
    """The torch backend's (log_prob, kl, trust_divergence) [B] of a GRPO-family loss: flowrl.backends.reference's
    ops and math. ``inputs.ref_cond`` given: ``ref_model_output`` is the reference's unconditional branch,
    combined with it at guidance scale ``loss.ref_scale`` (``guided_reference``)."""
    spec, trust, seed, kl_space = loss.step, loss.trust, loss.seed, loss.kl_space
    x, v, prev = inputs.sample, inputs.model_output, inputs.prev_sample
    ref, ref_cond, old_mean = inputs.ref_model_output, inputs.ref_cond, inputs.old_prev_sample_mean
    lp, _ = reference.step_log_prob(spec, x, v, prev)
    zeros = torch.zeros_like(lp)
    if ref is not None and ref_cond is not None:
        ref = guided_reference(x, v, ref, ref_cond, loss.ref_scale).reshape(x.shape)
    if ref is None:
        kl = zeros
    elif kl_space is KLSpace.VELOCITY:
        kl = velocity_kl(spec, x, v, ref)
    else:
        kl = reference.step_kl(dataclasses.replace(spec, kind=LogProbKind.KL), x, v, ref)[0]
    tr = zeros
    if trust is not TrustSource.NONE and spec.elementwise:
        tr = _trust_elementwise(spec, x, v, prev, old_mean, trust, seed)
    elif trust is not TrustSource.NONE:
        dtype = reference.compute_dtype(x, v, prev)
        a, c, std = reference.mode_coefficients(spec.sigmas, spec.step_index, spec.mode, spec.noise_level, dtype)
        mu = reference._mean(x, v, a, c)
        if trust is TrustSource.GIVEN:
            old = reference._rows(old_mean).to(dtype)
        else:  # mu_old = x' - std * eps, eps the rollout's Philox noise
            eps = reference.philox_normal(seed, mu.shape[1]).to(dtype)
            old = reference._rows(prev).to(dtype) - reference._col(std) * eps
        # the spec's numel and shard (sequence parallelism: the full sample's count, partials gathered)
        tr_spec = StepSpec(op=Op.KL, sigmas=spec.sigmas, step_index=spec.step_index, mode=spec.mode,
                           noise_level=spec.noise_level, kind=LogProbKind.KL, reduction=Reduction.MEAN,
                           numel=spec.numel, shard=spec.shard)
        tr, _ = reference._reduce(tr_spec, mu - old, std)
    return lp, kl, tr


def _trust_elementwise(spec, x, v, prev, old_mean, trust, seed):
    """D_s [B] of an elementwise step (per-token sigmas, a frozen mask): step_kl's per-element terms
    (``reference.ElementTerms``: each token's mean and std, weighted squares of the scored elements, the
    scored count) with mu_old in place of the reference's mean, always a mean; a replayed mu_old is
    x' - std_token * eps (a held token's std is 0: mu_old = x')."""
    dtype = reference.compute_dtype(x, v, prev)
    tr_spec = dataclasses.replace(spec, op=Op.KL, kind=LogProbKind.KL, reduction=Reduction.MEAN)
    t = reference.ElementTerms(tr_spec, x, dtype)
    mu = t.a * x + t.c * v
    if trust is TrustSource.GIVEN:
        old = old_mean.to(dtype)
    else:
        eps = reference.philox_normal(seed, mu[0].numel()).to(dtype).reshape(x.shape)
        old = prev.to(dtype) - t.std * eps
    return t.reduce(tr_spec, mu - old)[0]


def flow_noise(noise_seed, batch, numel):
    """float32 [B, numel] eps of a seeded forward-process loss (flow_sums' ``noise_seed``: (seeds [R],
    stream_stride, elem_offset, noise_div, noise_mod)): Philox row r is ``reference.philox_normal`` of
    seeds[r] on stream r * stream_stride; sample b takes row (b // noise_div) % noise_mod (a DPO pair's
    two samples one row). The kernels draw the same values in registers."""
    seeds, stride, offset, div, mod = noise_seed
    rows = reference.philox_normal(NoiseSeed(seeds.to(torch.int64), int(stride), int(offset)), numel)
    return rows[(torch.arange(batch, device=seeds.device) // div) % mod]


def flow_sums(kind, count, xt, v, other, x0, ref, t, coefs, shard=None, noise_seed=None):
    """The torch backend's [K, B] sums (kernels/loss.py's flow_partials_kernel, same operations);
    ``count`` (K) is implied by ``kind`` and ``ref`` here. ``shard`` (a ``ShardContext``, sequence
    parallelism): the [K * B, P_local] chunk partials are gathered across the ranks before the tree,
    as the step ops' are, so every rank gets the full samples' sums. ``noise_seed`` (DPO / DGPO, with
    ``other`` None): eps drawn from Philox (``flow_noise``)."""
    if noise_seed is not None:
        other = flow_noise(noise_seed, v.shape[0], v.numel() // v.shape[0])
    dtype = reference.compute_dtype(xt, v, other, x0, ref)
    rows = [reference._rows(u).to(dtype) if u is not None else None for u in (xt, v, other, x0, ref)]
    xt, v, other, x0, ref = rows
    if kind is FlowLoss.NFT:
        beta, one_minus, one_plus = coefs
        tc = reference._col(t.to(dtype))
        e_pos = (xt - tc * (beta * v + one_minus * other)) - x0
        e_neg = (xt - tc * (one_plus * other - beta * v)) - x0
        terms = [e_pos.abs(), e_pos * e_pos, e_neg.abs(), e_neg * e_neg]
        if ref is not None:
            d = v - ref
            terms.append(d * d)
    elif kind in (FlowLoss.DPO, FlowLoss.DGPO):  # xt's slot holds v_ref, ref's DGPO's second reference
        u = other - x0
        e, e_ref = v - u, xt - u
        terms = [e * e, e_ref * e_ref]
        if kind is FlowLoss.DGPO:
            d = v - xt
            terms.append(d * d)
            if ref is not None:
                e_two, d_two = ref - u, v - ref
                terms += [e_two * e_two, d_two * d_two]
    else:
        e = v - (other - x0)
        terms = [e * e]
    stacked = torch.stack(terms)  # [K, B, N]
    k, b, n = stacked.shape
    partials = reference.chunk_partials(stacked.reshape(k * b, n))
    if shard is not None:
        partials = shard.gather(partials)
    return reference.combine_partials(partials).reshape(k, b)


__all__ = ["grpo_values", "flow_sums"]
