"""Fused training-loss kernels (launchers and autograd Functions live in flowrl/backends/_triton_losses.py).

Two element passes, each with its backward, on the step kernels' 1-D grid (one program per sample
and group of CHUNK-element chunks, kernels/step.py's ``_block_offsets``) and their fixed-tree
chunk partials (common.chunk_tree_rows), so every per-sample sum is deterministic and
batch-invariant:

- ``grpo_partials_kernel``: one pass over x, v, x' (and v_ref, and mu_old or its Philox replay)
  writes the chunk partials of the log-prob residual r = x' - mu (the same operations as
  step_partials_kernel's OP_LOG_PROB, so the combined log-prob is step_log_prob's bit for bit), of the
  KL residual c v - c v_ref (common.policy_difference; KL_VELOCITY: v - v_ref, Flow-Factory's v-based KL;
  REF_GUIDED: v_ref = uncond + w (cond - uncond) from the reference's two branches), and of the trust-region residual
  mu - mu_old, mu_old given or replayed as x' - std * eps from the rollout's in-kernel noise.
  ``grpo_backward_kernel`` writes d loss / d model_output from the three per-sample incoming grads.
- ``flow_partials_kernel``: the forward-process losses (no SDE log-prob). LOSS_NFT: DiffusionNFT's
  x0 errors e+- = (x_t - t v+-) - x0 with v+ = beta v + (1 - beta) v_old, v- = (1 + beta) v_old - beta v,
  partials of |e+|, e+^2, |e-|, e-^2 (and (v - v_ref)^2); LOSS_AWM: AWM's e = v - (eps - x0), partials
  of e^2. ``flow_backward_kernel``: d loss / d v from the per-sample grads of the squared sums.
  LOSS_DPO / LOSS_DGPO (Diffusion-DPO, DGPO; flowrl/losses/dpo.py): AWM's e = v - (eps - x0), then per
  reference R (v_ref in the xt slot; DGPO's second one, HAS_REF, in the ref slot) (R - (eps - x0))^2 and,
  for DGPO, (v - R)^2; their eps read, or (PHILOX, ``noise_seed``) drawn in registers by step.py's
  ``_philox_eps`` from a Philox row a DPO pair's two samples share. EVEN (samples of whole blocks):
  no masks, no selects before the trees, bfloat16 read as uint32 pairs (same bits).

Every mode's formula is common.mode_coefficients / step_mean; nothing here re-derives it.
"""
import triton
import triton.language as tl

from .common import (
    bf16_words_to_f32, chunk_tree_rows, mode_coefficients, neg, ordinary_count, policy_difference, round_to, step_mean,
    to_f32, total_grad,
)
from .common import KIND_KL
from .step import _block_offsets, _element_terms, _philox_eps, _tile_offsets

# where mu_old (the trust-region variants' rollout mean) comes from: none, a stored float32 tensor,
# or replayed from x' and the rollout's Philox noise (flowrl.losses.TrustSource)
TRUST_NONE = tl.constexpr(0)
TRUST_GIVEN = tl.constexpr(1)
TRUST_REPLAY = tl.constexpr(2)
# which forward-process loss (flowrl.losses.FlowLoss)
LOSS_NFT = tl.constexpr(0)
LOSS_AWM = tl.constexpr(1)
LOSS_DPO = tl.constexpr(2)
LOSS_DGPO = tl.constexpr(3)
# where the GRPO family's KL to the reference is measured (flowrl.contract.KLSpace): the transitions'
# exact KL (c v - c v_ref)^2 / (2 std^2), or the velocity's (v - v_ref)^2
KL_TRANSITION = tl.constexpr(0)
KL_VELOCITY = tl.constexpr(1)


@triton.jit
def _store_partials(t, mask, partials_ptr, row, first, n_chunks, GROUP: tl.constexpr, CHUNK: tl.constexpr,
                    LOG2_CHUNK: tl.constexpr, BARE: tl.constexpr = False):
    """One float32 partial per chunk of ``t`` (masked tail = exact zeros, as the reference's padding;
    BARE: no select, ``t`` is 0 off the mask already or there is no tail)."""
    if not BARE:
        t = tl.where(mask, t, 0.0)
    partial = chunk_tree_rows(t, GROUP, CHUNK, LOG2_CHUNK)
    chunk = first // CHUNK + tl.arange(0, GROUP)
    tl.store(partials_ptr + row * n_chunks + chunk, partial, mask=chunk < n_chunks)


@triton.jit
def _replayed_noise(seeds_ptr, row, first, stream_stride, elem_offset, TRUST: tl.constexpr, BLOCK: tl.constexpr,
                    PHILOX_ALIGNED: tl.constexpr):
    """TRUST_REPLAY: the rollout's Philox eps of this block, drawn before the latents load (a barrier
    after it keeps ptxas from hoisting the loads above the noise's ~30 SASS per element: registers;
    triton 3.6 spilled the partials under its own 128 otherwise; the kernels use eps first, as ptxas
    sinks its angle to the use); 0.0 (unused) for the other TRUSTs."""
    eps = 0.0
    if TRUST == TRUST_REPLAY:
        eps = _philox_eps(seeds_ptr, row, first, stream_stride, elem_offset, BLOCK, PHILOX_ALIGNED)
        tl.debug_barrier()
    return eps


@triton.jit
def _old_mean(old_mean_ptr, prev, std, eps, offs, mask, TRUST: tl.constexpr):
    """mu_old: loaded (TRUST_GIVEN), or x' - std * eps with the rollout's Philox eps (TRUST_REPLAY,
    ``_replayed_noise``)."""
    if TRUST == TRUST_GIVEN:
        old = tl.load(old_mean_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        old = prev - std * eps
    return old


@triton.jit
def _guided_reference(v_ref, ref_cond_ptr, offs, mask, ref_scale):
    """The reference's guided output from its branches (``v_ref`` the loaded unconditional one, the
    conditional one at ``ref_cond_ptr``): uncond + w (cond - uncond) in float32, in that order
    (flowrl.backends.reference_losses.guided_reference; the peers' CFG line)."""
    cond = tl.load(ref_cond_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return v_ref + ref_scale * (cond - v_ref)


@triton.jit
def _element_square(r, scored, weight, ELEMENTWISE: tl.constexpr, WEIGHTED: tl.constexpr):
    """r * r of an element; in an elementwise step (per-token sigmas, a frozen mask) weighted per token
    (WEIGHTED) and 0 off the scored elements: step_partials_kernel's operations, in its order."""
    sq = r * r
    if ELEMENTWISE:
        if WEIGHTED:
            sq = sq * weight
        sq = tl.where(scored, sq, 0.0)
    return sq


@triton.jit
def _element_coef(coef, scored, weight, ELEMENTWISE: tl.constexpr, WEIGHTED: tl.constexpr):
    """A sample's d value / d total as an element's: weighted per token (WEIGHTED) and 0 off the scored
    elements of an elementwise step (step_backward_kernel's operations, in its order)."""
    if ELEMENTWISE:
        if WEIGHTED:
            coef = coef * weight
        coef = tl.where(scored, coef, 0.0)
    return coef


@triton.jit
def _loss_element_terms(a, c, std, row, in_row, mask, tok_ptr, tok_groups, tok_stride, frozen_ptr, frozen_groups,
                        frozen_stride, PER_TOKEN: tl.constexpr, HAS_FROZEN: tl.constexpr, RUN: tl.constexpr):
    """(a, c, std, scored, weight) of a block's elements: the sample's own (a, c, std), scored where in
    the sample, weight 1; in an elementwise step each element's (kernels/step.py's ``_element_terms``,
    weighted per token when PER_TOKEN: the KL and D_s always are, the log-prob's square by WEIGHTED)."""
    scored, weight = mask, 1.0
    if PER_TOKEN or HAS_FROZEN:
        a, c, std, _, scored, weight = _element_terms(a, c, std, row, in_row, mask, tok_ptr, tok_groups, tok_stride,
                                                      frozen_ptr, frozen_groups, frozen_stride, PER_TOKEN,
                                                      HAS_FROZEN, PER_TOKEN, RUN)
    return a, c, std, scored, weight


@triton.jit
def grpo_partials_kernel(
    x_ptr, v_ptr, prev_ptr, ref_ptr, old_mean_ptr, lp_partials_ptr, kl_partials_ptr, tr_partials_ptr,
    sigmas_ptr, step_ptr, seeds_ptr, stream_stride, elem_offset,
    n_per_sample, n_chunks, n_blocks, blocks_magic, blocks_shift, sigma_one_tol, eta, sin_half_pi_eta, last_index,
    MODE: tl.constexpr, HAS_REF: tl.constexpr, TRUST: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
    GROUP: tl.constexpr, PHILOX_ALIGNED: tl.constexpr,
    ref_cond_ptr=None, ref_scale=0.0, KL_SPACE: tl.constexpr = 0, REF_GUIDED: tl.constexpr = False,
    tok_ptr=None, tok_inner=1, tok_groups=1, tok_stride=0, frozen_ptr=None, frozen_inner=1, frozen_groups=1,
    frozen_stride=0, PER_TOKEN: tl.constexpr = False, HAS_FROZEN: tl.constexpr = False,
    WEIGHTED: tl.constexpr = False, RUN: tl.constexpr = 1,
):
    """Chunk partials [B, n_chunks] of (x' - mu)^2, (c v - c v_ref)^2 (HAS_REF; KL_VELOCITY: (v - v_ref)^2)
    and (mu - mu_old)^2 (TRUST != TRUST_NONE), from one read of each input. REF_GUIDED: ref_ptr holds the
    reference's unconditional branch, ref_cond_ptr its conditional one, v_ref their guided combination.
    PER_TOKEN / HAS_FROZEN: step_partials_kernel's elementwise step (kernels/step.py's ``_element_terms``):
    each element's (a, c, std), squares weighted per token (WEIGHTED: the log-prob's kind divides by the
    variance; the KL and D_s always are when PER_TOKEN) and 0 off the scored elements."""
    ELEMENTWISE: tl.constexpr = PER_TOKEN or HAS_FROZEN
    row, first, in_row, offs, mask = _block_offsets(n_per_sample, n_blocks, blocks_magic, blocks_shift, GROUP * CHUNK)
    step = tl.load(step_ptr + row)
    a, c, std = mode_coefficients(sigmas_ptr, step, sigma_one_tol, eta, sin_half_pi_eta, MODE, last_index)
    a, c, std, scored, weight = _loss_element_terms(a, c, std, row, in_row, mask, tok_ptr, tok_groups, tok_stride,
                                                    frozen_ptr, frozen_groups, frozen_stride, PER_TOKEN, HAS_FROZEN, RUN)
    eps = _replayed_noise(seeds_ptr, row, first, stream_stride, elem_offset, TRUST, GROUP * CHUNK, PHILOX_ALIGNED)
    # bfloat16 converted by to_f32 (2 SASS per element off); the backward and the step kernels keep the
    # cast: there the packed conversion took registers past 128 (ddim, the backward) and spilled
    v = to_f32(tl.load(v_ptr + offs, mask=mask, other=0.0))
    prev = to_f32(tl.load(prev_ptr + offs, mask=mask, other=0.0))
    x = to_f32(tl.load(x_ptr + offs, mask=mask, other=0.0))
    mu = step_mean(a, c, x, v)
    # D_s first: ptxas computes a replayed eps' angle (its sin / cos polynomials) where eps is used; used
    # last, below the loads and the log-prob's tree, beside every loaded value, it took 168-204 registers
    if TRUST != TRUST_NONE:
        old = _old_mean(old_mean_ptr, prev, std, eps, offs, mask, TRUST)
        rt = mu - old
        _store_partials(_element_square(rt, scored, weight, ELEMENTWISE, PER_TOKEN), mask, tr_partials_ptr, row,
                        first, n_chunks, GROUP, CHUNK, LOG2_CHUNK)
    r = prev - mu  # step_partials_kernel's OP_LOG_PROB residual, the same operations
    _store_partials(_element_square(r, scored, weight, ELEMENTWISE, WEIGHTED), mask, lp_partials_ptr, row, first,
                    n_chunks, GROUP, CHUNK, LOG2_CHUNK)
    if HAS_REF:
        v_ref = to_f32(tl.load(ref_ptr + offs, mask=mask, other=0.0))
        if REF_GUIDED:
            v_ref = _guided_reference(v_ref, ref_cond_ptr, offs, mask, ref_scale)
        if KL_SPACE == KL_VELOCITY:
            rk = v - v_ref
        else:
            rk = policy_difference(c, v, v_ref)
        _store_partials(_element_square(rk, scored, weight, ELEMENTWISE, PER_TOKEN), mask, kl_partials_ptr, row,
                        first, n_chunks, GROUP, CHUNK, LOG2_CHUNK)


@triton.jit
def grpo_backward_kernel(
    x_ptr, v_ptr, prev_ptr, ref_ptr, old_mean_ptr, grad_lp_ptr, grad_kl_ptr, grad_tr_ptr, grad_v_ptr,
    sigmas_ptr, step_ptr, seeds_ptr, stream_stride, elem_offset,
    n_per_sample, n_blocks, blocks_magic, blocks_shift, numel_f, sigma_one_tol, eta, sin_half_pi_eta, last_index,
    MODE: tl.constexpr, KIND: tl.constexpr, MEAN: tl.constexpr, HAS_REF: tl.constexpr, TRUST: tl.constexpr,
    BLOCK: tl.constexpr, PHILOX_ALIGNED: tl.constexpr,
    ref_cond_ptr=None, ref_scale=0.0, KL_SPACE: tl.constexpr = 0, REF_GUIDED: tl.constexpr = False,
    tok_ptr=None, tok_inner=1, tok_groups=1, tok_stride=0, frozen_ptr=None, frozen_inner=1, frozen_groups=1,
    frozen_stride=0, PER_TOKEN: tl.constexpr = False, HAS_FROZEN: tl.constexpr = False,
    WEIGHTED: tl.constexpr = False, count_ptr=None, RUN: tl.constexpr = 1,
):
    """d loss / d v from the per-sample grads of the log-prob, the KL and the trust-region divergence
    (always a mean): per element d value / d r = 2 coef r (common.total_grad), dmu/dv = c. KL_VELOCITY:
    the KL's 2 (v - v_ref) g, g over the element count when MEAN (no std, scored on every step).
    PER_TOKEN / HAS_FROZEN: step_backward_kernel's elementwise step: the scored count from count_ptr,
    each sample coefficient (of its own std) weighted per token and 0 off the scored elements, then
    the element's (a, c, std)."""
    ELEMENTWISE: tl.constexpr = PER_TOKEN or HAS_FROZEN
    row, first, _, _, _ = _block_offsets(n_per_sample, n_blocks, blocks_magic, blocks_shift, BLOCK)
    step = tl.load(step_ptr + row)
    a0, c0, std0 = mode_coefficients(sigmas_ptr, step, sigma_one_tol, eta, sin_half_pi_eta, MODE, last_index)
    std_ref = std0  # the sample's own step: the value's variance (per-token weights are relative to it)
    if ELEMENTWISE:
        count = tl.load(count_ptr + row)
    else:
        count = ordinary_count(std0, numel_f)  # 0 on a deterministic step: no gradient
    # the per-sample d value / d total, once per program
    lp_total = total_grad(tl.load(grad_lp_ptr + row), std_ref, count, KIND, MEAN)
    if TRUST != TRUST_NONE:
        tr_total = total_grad(tl.load(grad_tr_ptr + row), std_ref, count, KIND_KL, True)
    if HAS_REF:
        if KL_SPACE == KL_VELOCITY:
            kl_total = tl.load(grad_kl_ptr + row)
            if MEAN:
                kl_total = tl.div_rn(kl_total, numel_f)
        else:
            kl_total = total_grad(tl.load(grad_kl_ptr + row), std_ref, count, KIND_KL, MEAN)
    # the element offsets after the per-sample totals (computed with them, every GRPO backward took
    # 0.1-1 SASS per element more)
    in_row, offs, mask = _tile_offsets(row, first, n_per_sample, BLOCK)
    a, c, std, scored, weight = _loss_element_terms(a0, c0, std0, row, in_row, mask, tok_ptr, tok_groups,
                                                    tok_stride, frozen_ptr, frozen_groups, frozen_stride,
                                                    PER_TOKEN, HAS_FROZEN, RUN)
    eps = _replayed_noise(seeds_ptr, row, first, stream_stride, elem_offset, TRUST, BLOCK, PHILOX_ALIGNED)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    prev = tl.load(prev_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mu = step_mean(a, c, x, v)
    if TRUST != TRUST_NONE:  # D_s's term first, as in grpo_partials_kernel (registers), added second
        old = _old_mean(old_mean_ptr, prev, std, eps, offs, mask, TRUST)
        coef_tr = _element_coef(tr_total, scored, weight, ELEMENTWISE, PER_TOKEN)
        ct = coef_tr * (mu - old)
    coef_lp = _element_coef(lp_total, scored, weight, ELEMENTWISE, WEIGHTED)
    cr = coef_lp * (prev - mu)
    grad_mu = neg(cr + cr)
    if TRUST != TRUST_NONE:
        grad_mu = grad_mu + (ct + ct)
    grad_v = grad_mu * c
    if HAS_REF:
        v_ref = tl.load(ref_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if REF_GUIDED:
            v_ref = _guided_reference(v_ref, ref_cond_ptr, offs, mask, ref_scale)
        if KL_SPACE == KL_VELOCITY:
            ck = kl_total * (v - v_ref)
            grad_v = grad_v + (ck + ck)
        else:
            coef_kl = _element_coef(kl_total, scored, weight, ELEMENTWISE, PER_TOKEN)
            ck = coef_kl * policy_difference(c, v, v_ref)
            grad_v = grad_v + (ck + ck) * c
    tl.store(grad_v_ptr + offs, round_to(grad_v, grad_v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nft_errors(xt, v, v_old, x0, t, beta, one_minus_beta, one_plus_beta):
    """DiffusionNFT's x0 errors (x_t - t v+) - x0 and (x_t - t v-) - x0, in its operation order."""
    v_pos = beta * v + one_minus_beta * v_old
    v_neg = one_plus_beta * v_old - beta * v
    return (xt - t * v_pos) - x0, (xt - t * v_neg) - x0


@triton.jit
def _flow_load(ptr, base, first, in_row, offs, mask, EVEN: tl.constexpr, PAIRED: tl.constexpr = False,
               n_per_sample=0):
    """A block of one sample's row as float32: the tensor at ``ptr``, the row starting at ``base``.
    EVEN: a whole block, unmasked (no predicates, no zero fill), addressed from the row's start (int64,
    once per program) plus int32 in-row offsets; otherwise at the int64 ``offs`` under ``mask``.
    bfloat16 with EVEN or PAIRED (an even ``n_per_sample``, 4-byte aligned rows: the launcher checks):
    uint32 pairs from the row's start, a tail's words masked whole."""
    if (EVEN or PAIRED) and ptr.dtype.element_ty == tl.bfloat16:
        # bfloat16 pairs as uint32 words (the launcher checks the row starts are 4-byte aligned)
        BLOCK: tl.constexpr = in_row.shape[0]
        word = first // 2 + tl.arange(0, BLOCK // 2)
        wptr = (ptr + base).to(tl.pointer_type(tl.uint32)) + word
        if EVEN:
            words = tl.load(wptr)
        else:  # n_per_sample even: a word is whole or out
            words = tl.load(wptr, mask=tl.arange(0, BLOCK // 2) < ((n_per_sample - first) // 2).to(tl.int32),
                            other=0)
        u = bf16_words_to_f32(words)
    elif EVEN:
        u = tl.load(ptr + base + in_row).to(tl.float32)
    else:
        u = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return u


@triton.jit
def _flow_noise(other_ptr, base, in_row, offs, mask, row, first, seeds_ptr, stream_stride, elem_offset, noise_div,
                noise_mod, BLOCK: tl.constexpr, EVEN: tl.constexpr, PHILOX: tl.constexpr, PHILOX_ALIGNED: tl.constexpr,
                PAIRED: tl.constexpr, n_per_sample, NOISE_DIV: tl.constexpr):
    """The block's eps: loaded from ``other_ptr`` (``_flow_load``), or (PHILOX) drawn in the kernel from
    Philox row (row // noise_div) % noise_mod of ``seeds_ptr`` (its seed; its stream that row times
    stream_stride): a Diffusion-DPO pair's two samples, a row each, draw their pair's row
    (flowrl.losses.dpo: the noise seed's layout). NOISE_DIV 1 or 2: noise_div, with row // noise_div <
    2 noise_mod (every layout flowrl.losses makes; the launcher checks), so the modulo is one wrap and
    the two integer divisions (about 50 SASS per program) are a shift and a select; 0: any. Drawn eps
    is not 0 past a tail's end (the partials select it there; the backward's masked store drops it)."""
    if PHILOX:
        if NOISE_DIV == 0:
            noise_row = (row // noise_div) % noise_mod
        else:  # row >= 0
            noise_row = row >> (NOISE_DIV // 2)
            noise_row = tl.where(noise_row >= noise_mod, noise_row - noise_mod, noise_row)
        eps = _philox_eps(seeds_ptr, noise_row, first, stream_stride, elem_offset, BLOCK, PHILOX_ALIGNED)
    else:
        eps = _flow_load(other_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
    return eps


@triton.jit
def flow_partials_kernel(
    xt_ptr, v_ptr, other_ptr, x0_ptr, ref_ptr, t_ptr, partials_ptr,
    n_per_sample, n_chunks, n_blocks, blocks_magic, blocks_shift, n_rows, beta, one_minus_beta, one_plus_beta,
    LOSS: tl.constexpr, HAS_REF: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, GROUP: tl.constexpr,
    seeds_ptr=None, stream_stride=0, elem_offset=0, noise_div=1, noise_mod=1, EVEN: tl.constexpr = False,
    PHILOX: tl.constexpr = False, PHILOX_ALIGNED: tl.constexpr = False, PAIRED: tl.constexpr = False,
    NOISE_DIV: tl.constexpr = 0,
):
    """Chunk partials [K, B, n_chunks] (K stacked sums, each [B, n_chunks]). LOSS_NFT (other = v_old):
    |e+|, e+^2, |e-|, e-^2 and, with HAS_REF, (v - v_ref)^2. LOSS_AWM (other = eps; xt unused): e^2.
    LOSS_DPO / LOSS_DGPO: eps from other, or (PHILOX) drawn here (``_flow_noise``, NOISE_DIV). EVEN: n_per_sample
    is a multiple of the block (every block whole: no masks); PAIRED (implied by EVEN): bfloat16 read
    as uint32 pairs (``_flow_load``)."""
    BLOCK: tl.constexpr = GROUP * CHUNK
    # a tail's masked-off elements load as 0 and give exact zeros in every row but NFT's (t * 0 is NaN for
    # an infinite t): only NFT's rows select before the trees (Philox eps is zeroed there, _flow_noise)
    BARE: tl.constexpr = EVEN or LOSS != LOSS_NFT
    row, first, in_row, offs, mask = _block_offsets(n_per_sample, n_blocks, blocks_magic, blocks_shift, BLOCK)
    base = row * n_per_sample
    stride = n_rows * n_chunks
    v = _flow_load(v_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
    x0 = _flow_load(x0_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
    if LOSS == LOSS_NFT:
        if HAS_REF:  # first: v_ref is dead before the errors' four trees (registers)
            d = v - _flow_load(ref_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
            _store_partials(d * d, mask, partials_ptr + 4 * stride, row, first, n_chunks, GROUP, CHUNK, LOG2_CHUNK,
                           BARE)
        other = _flow_load(other_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
        xt = _flow_load(xt_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
        t = tl.load(t_ptr + row)
        e_pos, e_neg = _nft_errors(xt, v, other, x0, t, beta, one_minus_beta, one_plus_beta)
        _store_partials(tl.abs(e_pos), mask, partials_ptr, row, first, n_chunks, GROUP, CHUNK, LOG2_CHUNK, BARE)
        _store_partials(e_pos * e_pos, mask, partials_ptr + stride, row, first, n_chunks, GROUP, CHUNK, LOG2_CHUNK,
                       BARE)
        _store_partials(tl.abs(e_neg), mask, partials_ptr + 2 * stride, row, first, n_chunks, GROUP, CHUNK,
                       LOG2_CHUNK, BARE)
        _store_partials(e_neg * e_neg, mask, partials_ptr + 3 * stride, row, first, n_chunks, GROUP, CHUNK,
                       LOG2_CHUNK, BARE)
    else:  # LOSS_AWM: v - (eps - x0), the target formed first as AWM does
        eps = _flow_noise(other_ptr, base, in_row, offs, mask, row, first, seeds_ptr, stream_stride, elem_offset,
                          noise_div, noise_mod, BLOCK, EVEN, PHILOX, PHILOX_ALIGNED, PAIRED, n_per_sample,
                          NOISE_DIV)
        if PHILOX and not EVEN:  # a tail's masked-off elements: eps 0, as loaded (the rows need no select)
            eps = tl.where(mask, eps, 0.0)
        u = eps - x0
        e = v - u
        _store_partials(e * e, mask, partials_ptr, row, first, n_chunks, GROUP, CHUNK, LOG2_CHUNK, BARE)
        if LOSS != LOSS_AWM:  # LOSS_DPO / LOSS_DGPO: v_ref (xt slot), rows 1 (and 2: (v - v_ref)^2)
            v_ref = _flow_load(xt_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
            e_ref = v_ref - u
            _store_partials(e_ref * e_ref, mask, partials_ptr + stride, row, first, n_chunks, GROUP, CHUNK,
                           LOG2_CHUNK, BARE)
            if LOSS == LOSS_DGPO:
                d = v - v_ref
                _store_partials(d * d, mask, partials_ptr + 2 * stride, row, first, n_chunks, GROUP, CHUNK,
                               LOG2_CHUNK, BARE)
                if HAS_REF:  # DGPO's second reference (ref slot): rows 3, 4
                    v_two = _flow_load(ref_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
                    e_two = v_two - u
                    _store_partials(e_two * e_two, mask, partials_ptr + 3 * stride, row, first, n_chunks, GROUP,
                                   CHUNK, LOG2_CHUNK, BARE)
                    d_two = v - v_two
                    _store_partials(d_two * d_two, mask, partials_ptr + 4 * stride, row, first, n_chunks, GROUP,
                                   CHUNK, LOG2_CHUNK, BARE)


@triton.jit
def flow_backward_kernel(
    xt_ptr, v_ptr, other_ptr, x0_ptr, ref_ptr, t_ptr, grad_ptr, grad_v_ptr,
    n_per_sample, n_blocks, blocks_magic, blocks_shift, n_rows, beta, one_minus_beta, one_plus_beta,
    LOSS: tl.constexpr, HAS_REF: tl.constexpr, BLOCK: tl.constexpr,
    seeds_ptr=None, stream_stride=0, elem_offset=0, noise_div=1, noise_mod=1, EVEN: tl.constexpr = False,
    PHILOX: tl.constexpr = False, PHILOX_ALIGNED: tl.constexpr = False, PAIRED: tl.constexpr = False,
    NOISE_DIV: tl.constexpr = 0,
):
    """d loss / d v from grad [K, B], the per-sample grads of the squared sums (NFT: rows 1 and 3 for
    e+^2 and e-^2, row 4 for (v - v_ref)^2; AWM: row 0). d(e^2) = 2 e de; de+/dv = -t beta,
    de-/dv = t beta, de/dv = 1 (AWM). EVEN, PAIRED, PHILOX: flow_partials_kernel's."""
    row, first, in_row, offs, mask = _block_offsets(n_per_sample, n_blocks, blocks_magic, blocks_shift, BLOCK)
    base = row * n_per_sample
    v = _flow_load(v_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
    x0 = _flow_load(x0_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
    if LOSS == LOSS_NFT:
        other = _flow_load(other_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
        xt = _flow_load(xt_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
        t = tl.load(t_ptr + row)
        e_pos, e_neg = _nft_errors(xt, v, other, x0, t, beta, one_minus_beta, one_plus_beta)
        g_pos = tl.load(grad_ptr + n_rows + row)
        g_neg = tl.load(grad_ptr + 3 * n_rows + row)
        tb = t * beta
        grad_v = (g_pos * (e_pos + e_pos)) * (-tb) + (g_neg * (e_neg + e_neg)) * tb
        if HAS_REF:
            d = v - _flow_load(ref_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
            g_ref = tl.load(grad_ptr + 4 * n_rows + row)
            grad_v = grad_v + g_ref * (d + d)
    else:  # AWM, DPO: row 0 alone; DGPO adds rows 2 (and 4): (v - R)^2
        eps = _flow_noise(other_ptr, base, in_row, offs, mask, row, first, seeds_ptr, stream_stride, elem_offset,
                          noise_div, noise_mod, BLOCK, EVEN, PHILOX, PHILOX_ALIGNED, PAIRED, n_per_sample,
                          NOISE_DIV)
        e = v - (eps - x0)
        grad_v = tl.load(grad_ptr + row) * (e + e)
        if LOSS == LOSS_DGPO:
            d = v - _flow_load(xt_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
            grad_v = grad_v + tl.load(grad_ptr + 2 * n_rows + row) * (d + d)
            if HAS_REF:
                d_two = v - _flow_load(ref_ptr, base, first, in_row, offs, mask, EVEN, PAIRED, n_per_sample)
                grad_v = grad_v + tl.load(grad_ptr + 4 * n_rows + row) * (d_two + d_two)
    out = round_to(grad_v, grad_v_ptr.dtype.element_ty)
    if EVEN:
        tl.store(grad_v_ptr + base + in_row, out)
    else:
        tl.store(grad_v_ptr + offs, out, mask=mask)
