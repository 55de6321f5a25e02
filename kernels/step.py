"""Fused forward, finalize and backward kernels of flowrl's three ops (launchers and autograd
Functions live in flowrl/backends/_triton_ops.py).

Forward: one program per (sample, group of GROUP consecutive chunks); it reads its elements of x, v
and a third input once and writes one float32 partial per chunk = sum of squared residuals over the
chunk (how many chunks a program holds changes no bit: each chunk's tree is the same). A program's
block runs as TILES static tiles (tl.static_range: no runtime loop), so the per-sample work (the
coefficients, their IEEE division and square-root slow paths, the Philox key, the index math) is
paid once per program while each tile's values stay in registers; EVEN (the sample size a multiple
of the block) compiles without masks or tail selects. The backward takes the same two switches. The switches
(MODE, OP, KIND, NOISE) take flowrl.contract's enum values, compared against the named constants of
kernels/common.py.

- OP_ROLLOUT:  third = noise eps; writes x' = mu + std * eps rounded to out_dtype, the residual is
  r = float32(rounded x') - mu (log-prob of the EMITTED sample), optionally writes mu. With
  NOISE == NOISE_PHILOX, eps is drawn in registers instead (common.philox_normal_block, keyed by the
  sample's seed, its stream and the element's index elem_offset + in-sample index) and no noise
  tensor is read; with NOISE == NOISE_NONE the step is deterministic by its arguments (ode, noise
  level 0): x' = mu and nothing is read for eps. ddim's Philox rollout runs each whole tile in four
  parts behind barriers (step_partials_kernel's PARTS: fewer values in registers at once, the
  same tree).
- OP_LOG_PROB: third = the stored x'; r = x' - mu.
- OP_KL:       third = the reference policy's velocity; r = mu(v) - mu(v_ref) = c v - c v_ref (x
  cancels exactly, so it is not read); ddim with its clip: fma(sqrt(a'), clip(x0) - clip(x0_ref),
  e (v - v_ref)) (common.ddim_clipped_difference; x0 reads x, but for prediction "sample").

Finalize: one program per sample combines its partials (zero-padded to a power of two) by the
halving tree, and turns the total into the log-prob / KL (common.value_from_total; the torch backend's
flowrl.backends.reference.value_from_total).

Backward: same grid as forward; from the per-sample incoming grad it writes the input grads
directly (autograd of the reference, reproduced operation for operation).

Elementwise steps (docs/contract.md, Per-token schedules; Frozen elements and counts): PER_TOKEN reads
each element's (a, c, std, weight) from the pre-pass's per-(sample, token) records (kernels/token.py:
common.token_coefficients on the compact [Bt, G, 2] (sigma, sigma') table, computed once per token)
by index math on the element's in-sample offset (common.compact_index; flowrl.core.step_spec.flat_layout
builds the compact tables), once per run of RUN elements that share a token; when WEIGHTED (every kind
but sq_err) the squared residual is weighted by var_sample / var_token, so the partials stay sums of
squares divided by the sample's variance in finalize (bit for bit the per-sample step's when every
token is at its sample's sigma). HAS_FROZEN reads a compact uint8 mask the same way. Frozen and held elements (and
elements of std 0) add 0 to the partials; frozen and held ones emit x' = x. The scored-element count
and the per-token log term are computed on the host (flowrl.backends.reference.scored_statistics) and read
by finalize (COUNT_GIVEN, HAS_LOG) and backward.

No atomics anywhere: every sum is a fixed tree of IEEE adds (see common.chunk_tree_rows, halving_tree_rows).
"""
import triton
import triton.language as tl

from .common import (
    LEAF,
    MODE_DDIM, PRED_SAMPLE, NOISE_NONE, NOISE_PHILOX, NOISE_TENSOR, OP_KL, OP_LOG_PROB, OP_ROLLOUT, bf16_words_to_f32,
    carry_part_leaves, chunk_tree_rows, compact_index, ddim_clipped_difference, ddim_clipped_kl_coefficients,
    ddim_clipped_kl_grads, ddim_coefficients, ddim_mean, ddim_mean_grads, ddim_velocity_coefficient,
    dpm_sde_coefficients, halving_tree_rows, magic_quotient, mode_coefficients, neg, ordinary_count,
    part_chunk_partial, philox_key, philox_normal_block, policy_difference, round_pairs, round_to, run_heads,
    run_spread, step_mean, total_grad, value_from_total, words_to_f32,
)
from .token import FROZEN_MAGIC, RECORD, TABLE_HEADER


@triton.jit
def _block_offsets(n_per_sample, n_blocks, blocks_magic, blocks_shift, BLOCK: tl.constexpr):
    """This program's sample, its block's first in-sample element, the block's int64 element offsets
    and mask. The grid is 1-D, one program per (sample, block of BLOCK elements), sample-major: any
    batch size fits (a 2-D grid's second axis stops at 65535), and offsets are int64 (batches of video
    latents exceed 2**31 elements); in-sample offsets fit in 32 bits (_triton_ops.MAX_SAMPLE_ELEMENTS),
    the mask is computed in them. The sample is pid // n_blocks by the host's ``(blocks_magic,
    blocks_shift)`` (``magic_quotient``: a multiply-high and a shift where an integer division took
    about 30 SASS per program)."""
    pid = tl.program_id(0)
    row = magic_quotient(pid.to(tl.uint32), blocks_magic.to(tl.uint32), blocks_shift).to(tl.int64)
    first = (pid - row * n_blocks) * BLOCK
    return (row, first) + _tile_offsets(row, first, n_per_sample, BLOCK)


@triton.jit
def _element_terms(a, c, std, row, in_row, mask, tok_ptr, tok_groups, tok_stride, frozen_ptr, frozen_groups,
                   frozen_stride, PER_TOKEN: tl.constexpr, HAS_FROZEN: tl.constexpr, WEIGHTED: tl.constexpr,
                   RUN: tl.constexpr):
    """Per-element (a, c, std, keep, scored, weight) of an elementwise step from the sample's own
    (a, c, std): per-token coefficients (PER_TOKEN), the frozen mask (HAS_FROZEN). keep: x' = x
    (frozen or held); scored: std > 0 and not frozen; weight var_sample_d / var_token_d (WEIGHTED).

    ``tok_ptr`` is the pre-pass's table (kernels/token.py: the index math's multipliers, then each
    (sample, token)'s (a, c, std, w) with w < 0 for a held token), row ``row`` at ``tok_stride``
    records. Every RUN consecutive elements (RUN divides both tables' ``inner``, so a run never
    straddles two tokens) share one lookup: the index math and the loads run once per run
    (``run_heads``) and the values are repeated over its elements (``run_spread``). The in-sample
    offset goes to uint32: the launcher keeps samples below 2**31 elements (the tables' ``inner``
    arrive as the header's multipliers, from the pre-pass)."""
    heads = run_heads(in_row, RUN).to(tl.uint32)
    head_mask = run_heads(mask, RUN)
    keep = heads < 0  # all False
    weight = 1.0
    if PER_TOKEN:
        # the row's records from one 64-bit base, each head's offset 32-bit (_triton_ops.MAX_TABLE_TOKENS);
        # a masked head (past the sample) reads zeros: std 0, not scored
        tok = compact_index(heads, tok_ptr, tok_groups)
        if RUN > 1:  # one 16-byte load per head (per element, RUN 1, the block spilled: fp32, sm_80)
            record = tok_ptr + TABLE_HEADER + RECORD * row * tok_stride + RECORD * tok
            fields = tl.load(record[:, None] + tl.arange(0, RECORD)[None, :], mask=head_mask[:, None], other=0.0)
            a_std, c_w = tl.split(tl.reshape(fields, (fields.shape[0], 2, 2)))  # fields 0, 2 and 1, 3
            a, std = tl.split(a_std)
            c, w = tl.split(c_w)
        else:
            record = tok_ptr + TABLE_HEADER + RECORD * (row * tok_stride + tok.to(tl.int64))
            a = tl.load(record, mask=head_mask, other=0.0)
            c = tl.load(record + 1, mask=head_mask, other=0.0)
            std = tl.load(record + 2, mask=head_mask, other=0.0)
            w = tl.load(record + 3, mask=head_mask, other=0.0)
        a = run_spread(a, RUN)
        c = run_spread(c, RUN)
        keep = keep | (w < 0.0)  # held
        scored = std > 0.0
        std = run_spread(std, RUN)
        if WEIGHTED:
            weight = run_spread(w, RUN)
    else:
        scored = tl.where(std > 0.0, head_mask, False)
    if HAS_FROZEN:
        fidx = compact_index(heads, tok_ptr + FROZEN_MAGIC, frozen_groups)
        frozen = tl.load(frozen_ptr + row * frozen_stride + fidx, mask=head_mask, other=1) != 0
        keep = keep | frozen
        scored = scored & ~frozen
    return a, c, std, run_spread(keep, RUN), run_spread(scored, RUN) & mask, weight


@triton.jit
def _philox_eps(seeds_ptr, row, first, stream_stride, elem_offset, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """This block's float32 noise: elements elem_offset + first + arange(BLOCK) of the sample's Philox
    stream (elem_offset: where a sequence-parallel shard starts)."""
    k0, k1, stream = _philox_stream(seeds_ptr, row, stream_stride)
    return philox_normal_block(k0, k1, stream, elem_offset + first, BLOCK, ALIGNED)


@triton.jit
def _philox_stream(seeds_ptr, row, stream_stride):
    """The sample's Philox key (k0, k1) and stream (read once per program)."""
    k0, k1 = philox_key(tl.load(seeds_ptr + row))
    return k0, k1, (row * stream_stride).to(tl.uint32)


@triton.jit
def _tile_offsets(row, first, n_per_sample, TILE: tl.constexpr, EVEN: tl.constexpr = False):
    """The in-sample offsets, int64 element offsets and mask of the TILE elements of sample ``row`` from
    in-sample ``first`` (a block, a tile or a part of one). The mask is computed in 32 bits (in-sample
    offsets fit: _triton_ops.MAX_SAMPLE_ELEMENTS); EVEN: the sample size is a multiple of the program's
    block, so every tile is whole and the mask is all True (the compiler drops it)."""
    in_row = first + tl.arange(0, TILE)
    if EVEN:
        mask = tl.full((TILE,), 1, tl.int1)
    else:
        mask = tl.arange(0, TILE) < (n_per_sample - first).to(tl.int32)
    return in_row, row * n_per_sample + in_row, mask


@triton.jit
def _load_tile(ptr, offs, mask, row_start, TILE: tl.constexpr, EVEN: tl.constexpr, WORDS: tl.constexpr = True):
    """A tile of the tensor at ``ptr`` as float32 (``row_start``: the tile's first element, int64).
    EVEN bfloat16 (whole tiles of 4-byte aligned rows: _triton_ops.step_switches) is read as uint32
    words (unless WORDS is off; ``bf16_words_to_f32``): the same bits."""
    if EVEN and WORDS and ptr.dtype.element_ty == tl.bfloat16:
        return bf16_words_to_f32(tl.load((ptr + row_start).to(tl.pointer_type(tl.uint32)) + tl.arange(0, TILE // 2)))
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rounded(ptr, offs, mask, row_start, x, TILE: tl.constexpr, WORDS: tl.constexpr):
    """Store float32 ``x`` rounded to ``ptr``'s dtype (``round_to``) and return the stored values as
    float32. WORDS (a whole tile, 4-byte aligned: the kernels' EVEN) over 16-bit storage: written as
    uint32 words of rounded pairs (``round_pairs``: one conversion per pair) and the float32 values
    read off the words (one integer op each for bfloat16), where a per-value conversion, the packing
    and the unpacking took 2.5 instructions per value."""
    DTYPE: tl.constexpr = ptr.dtype.element_ty
    if WORDS and (DTYPE == tl.bfloat16 or DTYPE == tl.float16):
        words = round_pairs(x, DTYPE)
        tl.store((ptr + row_start).to(tl.pointer_type(tl.uint32)) + tl.arange(0, TILE // 2), words)
        return words_to_f32(words, DTYPE)
    rounded = round_to(x, DTYPE)
    tl.store(ptr + offs, rounded, mask=mask)
    return rounded.to(tl.float32)


@triton.jit
def step_partials_kernel(
    x_ptr, v_ptr, third_ptr, prev_out_ptr, mean_out_ptr, partials_ptr, sigmas_ptr, step_ptr,
    seeds_ptr, stream_stride, elem_offset,
    n_per_sample, n_chunks, n_blocks, sigma_one_tol, eta, sin_half_pi_eta,
    tok_ptr, tok_inner, tok_groups, tok_stride, frozen_ptr, frozen_inner, frozen_groups, frozen_stride,
    MODE: tl.constexpr, OP: tl.constexpr, WRITE_MEAN: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
    GROUP: tl.constexpr, NOISE: tl.constexpr, PHILOX_ALIGNED: tl.constexpr,
    PER_TOKEN: tl.constexpr, HAS_FROZEN: tl.constexpr, WEIGHTED: tl.constexpr,
    clip_range, PRED: tl.constexpr, CLIP: tl.constexpr,
    prev_x0_ptr, last_index, HAS_PREV: tl.constexpr, TILES: tl.constexpr, EVEN: tl.constexpr,
    RUN: tl.constexpr = 1,
):
    """Chunk partials [B, n_chunks] of r * r (weighted per token when WEIGHTED); each program covers
    GROUP consecutive chunks, in TILES static steps of GROUP // TILES chunks (the per-sample work,
    coefficients and address setup, is done once per program and spread over its GROUP chunks; each
    tile's values stay in registers). ddim (MODE_DDIM) reads its alpha-bar table from sigmas_ptr and its
    mean's switches PRED, CLIP (flowrl refuses per-token sigmas and frozen masks with ddim and with
    dpm_sde's second order, so ELEMENTWISE never meets MODE_DDIM or HAS_PREV)."""
    ELEMENTWISE: tl.constexpr = PER_TOKEN or HAS_FROZEN
    TILE_CHUNKS: tl.constexpr = GROUP // TILES
    TILE: tl.constexpr = TILE_CHUNKS * CHUNK
    # a tile of one chunk in PARTS parts, each behind a barrier, carrying its leaf sums (one value per
    # thread; the chunk's tree finished after the last part): ddim's Philox rollout
    # on whole 4-tile blocks, which as one part per tile spilled under the cap (8-216 bytes, sm_90a)
    PARTS: tl.constexpr = 4 if (MODE == MODE_DDIM and NOISE == NOISE_PHILOX and TILES > 1 and EVEN
                                and TILE_CHUNKS == 1) else 1
    PART: tl.constexpr = TILE // PARTS
    # ddim's one-part Philox rollouts keep tl.div_rn and bfloat16 element loads: as words its v_prediction
    # rollout took 133 registers, with div_rn_by_scalar up to 168 (or spills)
    FAST_DDIM: tl.constexpr = NOISE != NOISE_PHILOX or PARTS > 1
    WORDS: tl.constexpr = MODE != MODE_DDIM or FAST_DDIM
    # x' stored as words of rounded pairs on whole blocks; ddim's per value at one part (its 4-tile
    # rollout with the mean spilled 72 bytes as words, triton 3.6)
    WORD_STORE: tl.constexpr = EVEN and (MODE != MODE_DDIM or PARTS > 1)
    # ddim's mean per element, but for its KL: c v - c v_ref as every mode's, or with the clip the
    # clipped x0s' difference (CLIPPED_KL)
    DDIM_MEAN: tl.constexpr = MODE == MODE_DDIM and OP != OP_KL
    CLIPPED_KL: tl.constexpr = MODE == MODE_DDIM and OP == OP_KL and CLIP
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_blocks
    block_first = (pid - row * n_blocks) * (GROUP * CHUNK)
    step = tl.load(step_ptr + row)
    if MODE == MODE_DDIM:
        sqrt_a, sqrt_b, sqrt_a_prev, k, std = ddim_coefficients(sigmas_ptr, step, eta)
        if CLIPPED_KL:
            e, inv_sqrt_a = ddim_clipped_kl_coefficients(sqrt_a, sqrt_b, k, PRED)
        elif not DDIM_MEAN:
            c = ddim_velocity_coefficient(sqrt_a, sqrt_b, sqrt_a_prev, k, PRED)
    else:
        a0, c0, std0 = mode_coefficients(sigmas_ptr, step, sigma_one_tol, eta, sin_half_pi_eta, MODE, last_index)
        if HAS_PREV:  # dpm_sde's second order: mu gains p * x0_prev
            a0, c0, p, std0 = dpm_sde_coefficients(sigmas_ptr, step, True)
    if NOISE == NOISE_PHILOX:
        k0, k1, stream = _philox_stream(seeds_ptr, row, stream_stride)
    even = tl.zeros((PART // LEAF,), tl.float32)  # the parts' leaf sums (PARTS > 1), carried across them
    odd = even
    block_start = row * n_per_sample + block_first
    for span in tl.static_range(TILES * PARTS):
        part = span % PARTS
        first = block_first + span * PART
        if PARTS > 1 and span > 0:
            tl.debug_barrier()  # this part's noise after the last one's stores
        in_row, offs, mask = _tile_offsets(row, first, n_per_sample, PART, EVEN)
        row_start = block_start + span * PART
        if MODE != MODE_DDIM:
            a, c, std = a0, c0, std0
            if ELEMENTWISE:
                a, c, std, keep, scored, weight = _element_terms(
                    a, c, std, row, in_row, mask, tok_ptr, tok_groups, tok_stride, frozen_ptr, frozen_groups,
                    frozen_stride, PER_TOKEN, HAS_FROZEN, WEIGHTED, RUN)
        if NOISE == NOISE_PHILOX:  # rollout only: the noise never touches memory
            third = philox_normal_block(k0, k1, stream, elem_offset + first, PART, PHILOX_ALIGNED)
            # the latents load after the noise (registers: ptxas would hoist them above its ~30 SASS
            # per element, and the next tile's too, and spill under the cap)
            tl.debug_barrier()
        v = _load_tile(v_ptr, offs, mask, row_start, PART, EVEN, WORDS)
        if NOISE == NOISE_TENSOR:
            third = _load_tile(third_ptr, offs, mask, row_start, PART, EVEN, WORDS)
        if DDIM_MEAN:
            x = _load_tile(x_ptr, offs, mask, row_start, PART, EVEN, WORDS)
            mu = ddim_mean(x, v, sqrt_a, sqrt_b, sqrt_a_prev, k, clip_range, PRED, CLIP, FAST_DDIM)
        elif CLIPPED_KL:  # nonlinear in v (the clip): x0 reads x, but for sample (x0 = v)
            if PRED == PRED_SAMPLE:
                x = v
            else:
                x = _load_tile(x_ptr, offs, mask, row_start, PART, EVEN, WORDS)
        elif OP != OP_KL:  # the KL's mu - mu_ref = c v - c v_ref does not read x
            x = _load_tile(x_ptr, offs, mask, row_start, PART, EVEN, WORDS)
            mu = step_mean(a, c, x, v)
            if HAS_PREV:
                mu = mu + p * _load_tile(prev_x0_ptr, offs, mask, row_start, PART, EVEN, WORDS)
        if OP == OP_ROLLOUT:
            if NOISE == NOISE_NONE:  # deterministic: std is 0, and mu + 0 * eps is mu
                prev = mu
            else:
                prev = mu + std * third
            if ELEMENTWISE:  # frozen and held elements emit x' = x, their mean is x
                prev = tl.where(keep, x, prev)
                mu = tl.where(keep, x, mu)
            r = _store_rounded(prev_out_ptr, offs, mask, row_start, prev, PART, WORD_STORE) - mu
            if WRITE_MEAN:
                tl.store(mean_out_ptr + offs, mu, mask=mask)
        elif OP == OP_LOG_PROB:
            r = third - mu
        elif CLIPPED_KL:
            r = ddim_clipped_difference(x, v, third, sqrt_a, sqrt_b, sqrt_a_prev, inv_sqrt_a, e, clip_range, PRED)
        else:  # OP_KL
            r = policy_difference(c, v, third)
        if ELEMENTWISE:
            sq = r * r
            if WEIGHTED:
                sq = sq * weight
            sq = tl.where(scored, sq, 0.0)  # frozen, held, std-0 elements and the tail add exact zeros
        else:
            if not EVEN:
                r = tl.where(mask, r, 0.0)  # the tail of the last chunk adds exact zeros, as the reference's padding
            sq = r * r
        if PARTS == 1:
            partial = chunk_tree_rows(sq, TILE_CHUNKS, CHUNK, LOG2_CHUNK)  # one partial per chunk
            chunk = first // CHUNK + tl.arange(0, TILE_CHUNKS)
            if EVEN:
                tl.store(partials_ptr + row * n_chunks + chunk, partial)
            else:
                tl.store(partials_ptr + row * n_chunks + chunk, partial, mask=chunk < n_chunks)
        else:  # the chunk's tree across its parts' leaf sums, then within a part: the same bits
            even, odd = carry_part_leaves(even, odd, sq, part, PART)
            if part == PARTS - 1:
                tile_first = block_first + (span - part) * PART
                tl.store(partials_ptr + row * n_chunks + tile_first // CHUNK + tl.arange(0, 1),
                         part_chunk_partial(even, odd, PARTS, PART, LOG2_CHUNK))


@triton.jit
def finalize_kernel(
    partials_ptr, sigmas_ptr, step_ptr, value_ptr, std_ptr, count_ptr, log_ptr,
    n_partials, numel_f, sigma_one_tol, eta, sin_half_pi_eta,
    MODE: tl.constexpr, KIND: tl.constexpr, MEAN: tl.constexpr,
    WIDTH: tl.constexpr, LOG2_WIDTH: tl.constexpr, COUNT_GIVEN: tl.constexpr, HAS_LOG: tl.constexpr,
    clip_range, PRED: tl.constexpr, CLIP: tl.constexpr,
    last_index,
):
    """value[b] from the [B, n_partials] chunk partials; the combine order is the halving tree over
    the partials zero-padded to WIDTH (a power of two), i.e. flowrl.backends.reference.combine_partials. The
    scored count is read from count_ptr (COUNT_GIVEN: an elementwise step's) or written there
    (numel_f, or 0 for a deterministic step: reference.ordinary_count)."""
    row = tl.program_id(0).to(tl.int64)
    step = tl.load(step_ptr + row)
    if MODE == MODE_DDIM:
        sqrt_a, sqrt_b, sqrt_a_prev, k, std = ddim_coefficients(sigmas_ptr, step, eta)
    else:
        a, c, std = mode_coefficients(sigmas_ptr, step, sigma_one_tol, eta, sin_half_pi_eta, MODE, last_index)
    offs = tl.arange(0, WIDTH)
    partials = tl.load(partials_ptr + row * n_partials + offs, mask=offs < n_partials, other=0.0)
    total = tl.sum(halving_tree_rows(partials, 1, WIDTH, LOG2_WIDTH), axis=0)
    if COUNT_GIVEN:
        count = tl.load(count_ptr + row)
    else:
        count = ordinary_count(std, numel_f)
        tl.store(count_ptr + row, count)
    log_term = 0.0
    if HAS_LOG:
        log_term = tl.load(log_ptr + row)
    tl.store(value_ptr + row, value_from_total(total, std, count, log_term, KIND, MEAN, HAS_LOG))
    tl.store(std_ptr + row, std)


@triton.jit
def step_backward_kernel(
    x_ptr, v_ptr, third_ptr, grad_ptr, grad_x_ptr, grad_v_ptr, grad_third_ptr, sigmas_ptr, step_ptr, count_ptr,
    n_per_sample, n_blocks, sigma_one_tol, eta, sin_half_pi_eta,
    tok_ptr, tok_inner, tok_groups, tok_stride, frozen_ptr, frozen_inner, frozen_groups, frozen_stride,
    MODE: tl.constexpr, KIND: tl.constexpr, MEAN: tl.constexpr, IS_KL: tl.constexpr,
    NEED_X: tl.constexpr, NEED_V: tl.constexpr, NEED_THIRD: tl.constexpr, BLOCK: tl.constexpr,
    PER_TOKEN: tl.constexpr, HAS_FROZEN: tl.constexpr, WEIGHTED: tl.constexpr,
    clip_range, PRED: tl.constexpr, CLIP: tl.constexpr,
    prev_x0_ptr, grad_prev_ptr, last_index, HAS_PREV: tl.constexpr, NEED_PREV: tl.constexpr,
    TILES: tl.constexpr, EVEN: tl.constexpr, RUN: tl.constexpr = 1,
):
    """Input grads of step_log_prob (third = x') or step_kl (third = v_ref) from grad [B]; a program's
    BLOCK elements in TILES static steps (the per-sample work once per program).

    Per sample: coef = d value / d total (common.total_grad); per element d value / d r = 2 * coef * r,
    then dmu/dx = a, dmu/dv = c, and r = x' - mu or mu - mu_ref = c v - c v_ref. The KL does not
    depend on x (a * x cancels), so it has no x grad (NEED_X is False for it), except ddim's clipped
    KL where x0_hat reads x: per-element dr/dx, dr/dv, dr/dv_ref (common.ddim_clipped_kl_grads). ddim's
    mean is nonlinear with its clip: the log-prob's per-element dmu/dx, dmu/dv (common.ddim_mean_grads)."""
    ELEMENTWISE: tl.constexpr = PER_TOKEN or HAS_FROZEN
    DDIM_MEAN: tl.constexpr = MODE == MODE_DDIM and not IS_KL  # as step_partials_kernel's
    CLIPPED_KL: tl.constexpr = MODE == MODE_DDIM and IS_KL and CLIP
    # ddim's per-element grads (its mean's, its clipped KL's) in four parts per tile (ddim's backward
    # runs one warp: parts of 8 values per thread), each behind a barrier (no tree to keep: the parts
    # are independent): 51-64 registers where one part per tile took up to 168 and 4 tiles spilled
    # 56-672 bytes under the cap (sm_90a); bfloat16 read and the grads stored as words on whole blocks
    # (EVEN), ddim's too since its parts
    PARTS: tl.constexpr = 4 if DDIM_MEAN or CLIPPED_KL else 1
    TILE: tl.constexpr = BLOCK // (TILES * PARTS)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_blocks
    block_first = (pid - row * n_blocks) * BLOCK
    step = tl.load(step_ptr + row)
    if MODE == MODE_DDIM:
        sqrt_a, sqrt_b, sqrt_a_prev, k, std0 = ddim_coefficients(sigmas_ptr, step, eta)
        if CLIPPED_KL:
            e, inv_sqrt_a = ddim_clipped_kl_coefficients(sqrt_a, sqrt_b, k, PRED)
        elif not DDIM_MEAN:
            c = ddim_velocity_coefficient(sqrt_a, sqrt_b, sqrt_a_prev, k, PRED)
    else:
        a0, c0, std0 = mode_coefficients(sigmas_ptr, step, sigma_one_tol, eta, sin_half_pi_eta, MODE, last_index)
        if HAS_PREV:  # dpm_sde's second order: mu gains p * x0_prev
            a0, c0, p, std0 = dpm_sde_coefficients(sigmas_ptr, step, True)
    coef0 = total_grad(tl.load(grad_ptr + row), std0, tl.load(count_ptr + row), KIND, MEAN)
    for tile in tl.static_range(TILES * PARTS):
        first = block_first + tile * TILE
        if PARTS > 1 and tile > 0:
            tl.debug_barrier()
        in_row, offs, mask = _tile_offsets(row, first, n_per_sample, TILE, EVEN)
        row_start = row * n_per_sample + first
        coef = coef0
        if MODE != MODE_DDIM:
            a, c, std = a0, c0, std0
        if ELEMENTWISE:
            a, c, std, keep, scored, weight = _element_terms(
                a, c, std, row, in_row, mask, tok_ptr, tok_groups, tok_stride, frozen_ptr, frozen_groups,
                frozen_stride, PER_TOKEN, HAS_FROZEN, WEIGHTED, RUN)
            if WEIGHTED:
                coef = coef * weight
            coef = tl.where(scored, coef, 0.0)
        v = _load_tile(v_ptr, offs, mask, row_start, TILE, EVEN)
        third = _load_tile(third_ptr, offs, mask, row_start, TILE, EVEN)
        if DDIM_MEAN:
            x = _load_tile(x_ptr, offs, mask, row_start, TILE, EVEN)
            # div_rn_by_scalar (True): ddim[epsilon clip]'s gaussian backward then launches under the
            # 128-register cap (register_cap; unbounded, ptxas took 152-160); the others are over 128 with
            # div.rn too
            mu = ddim_mean(x, v, sqrt_a, sqrt_b, sqrt_a_prev, k, clip_range, PRED, CLIP, True)
            a, c = ddim_mean_grads(x, v, sqrt_a, sqrt_b, sqrt_a_prev, k, clip_range, PRED, CLIP)  # dmu/dx, dmu/dv
            r = third - mu
        elif CLIPPED_KL:  # dr/dx, dr/dv, -dr/dv_ref per element; sample's x0 = v reads no x
            if PRED == PRED_SAMPLE:
                x = v
            else:
                x = _load_tile(x_ptr, offs, mask, row_start, TILE, EVEN)
            r = ddim_clipped_difference(x, v, third, sqrt_a, sqrt_b, sqrt_a_prev, inv_sqrt_a, e, clip_range, PRED)
            a, c, c_ref = ddim_clipped_kl_grads(x, v, third, sqrt_a, sqrt_b, sqrt_a_prev, inv_sqrt_a, e, clip_range, PRED)
        elif IS_KL:
            r = policy_difference(c, v, third)
        else:
            x = _load_tile(x_ptr, offs, mask, row_start, TILE, EVEN)
            mu = step_mean(a, c, x, v)
            if HAS_PREV:
                mu = mu + p * _load_tile(prev_x0_ptr, offs, mask, row_start, TILE, EVEN)
            r = third - mu
        cr = coef * r
        grad_r = cr + cr  # d(r * r) = 2 r dr, as autograd of r * r sums two equal terms
        if IS_KL:
            grad_mu = grad_r
            if CLIPPED_KL:
                grad_third = neg(grad_r) * c_ref
            else:
                grad_third = neg(grad_r) * c
        else:
            grad_mu = neg(grad_r)
            grad_third = grad_r
        if NEED_X:
            _store_rounded(grad_x_ptr, offs, mask, row_start, grad_mu * a, TILE, EVEN)
        if NEED_V:
            _store_rounded(grad_v_ptr, offs, mask, row_start, grad_mu * c, TILE, EVEN)
        if NEED_THIRD:
            _store_rounded(grad_third_ptr, offs, mask, row_start, grad_third, TILE, EVEN)
        if NEED_PREV:  # dmu/dx0_prev = p
            _store_rounded(grad_prev_ptr, offs, mask, row_start, grad_mu * p, TILE, EVEN)
