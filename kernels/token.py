"""The elementwise steps' pre-pass (issue 21, the roofline): one small launch before the element
kernels that turns the compact per-token (sigma, sigma') table into per-(sample, token) records and
writes the index math's division multipliers, so the element kernels only load.

Table layout (float32 words, ``TABLE_HEADER`` header words, then the records):

- header: ``(m, l)`` of the per-token table's ``inner`` and ``groups`` and of the frozen mask's
  (flowrl.backends._triton_ops.division_magic, computed on the host and passed as arguments; uint32
  bit patterns stored in float32 words, read back with a bitcast);
- records [B, G, 4] (PER_TOKEN only): ``(a, c, std, w)`` of token g of sample b, the bits
  ``common.token_coefficients`` gives (held tokens: ``(1, 0, 0)``), and ``w`` the weight
  ``var_sample_d / var_token_d`` of the sample's own step (the same ``density_std`` and ``div_rn``
  as before), or -1 for a held token: a held token is never scored, so its weight is never read,
  and its sign carries the held flag without a fifth word. The records are per sample (not per
  table row) because the weight depends on the sample's step.

The element kernels then compute ``(e // inner) % groups`` with two multiply-highs and shifts
(``common.compact_index``) and load four words per token run instead of two table words, the
mode's divisions and square roots, and a 64-bit division and modulo per element.
"""
import triton
import triton.language as tl

from .common import density_std, mode_coefficients, token_coefficients

TABLE_HEADER = tl.constexpr(8)  # words before the records: 4 for the table's index math, 4 for the mask's
FROZEN_MAGIC = tl.constexpr(4)  # where the mask's multipliers start in the header
RECORD = tl.constexpr(4)  # words per (sample, token) record: a, c, std, w


@triton.jit
def _store_word(ptr, value):
    """Store an integer scalar in [0, 2**32) as its uint32 bit pattern in a float32 word (``value``
    may be the JIT's constexpr 1)."""
    tl.store(ptr, (value + tl.zeros((), tl.int64)).to(tl.uint32).to(tl.float32, bitcast=True))


@triton.jit
def token_table_kernel(pairs_ptr, table_ptr, sigmas_ptr, step_ptr, n_tokens, pairs_stride, n_blocks,
                       sigma_one_tol, eta, sin_half_pi_eta, last_index,
                       tok_inner_m, tok_inner_l, tok_groups_m, tok_groups_l,
                       frozen_inner_m, frozen_inner_l, frozen_groups_m, frozen_groups_l,
                       MODE: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK: tl.constexpr):
    """The header (program 0: the host's ``(m, l)`` of each divisor, _triton_ops.division_magic) and,
    when PER_TOKEN, the records of BLOCK tokens of one sample per program (grid: samples x n_blocks).
    ``pairs_ptr``: the compact [Bt, G, 2] float32 (sigma, sigma') table, row b at ``b * pairs_stride``
    (0 when Bt is 1)."""
    pid = tl.program_id(0).to(tl.int64)
    if pid == 0:
        _store_word(table_ptr, tok_inner_m)
        _store_word(table_ptr + 1, tok_inner_l)
        _store_word(table_ptr + 2, tok_groups_m)
        _store_word(table_ptr + 3, tok_groups_l)
        _store_word(table_ptr + FROZEN_MAGIC, frozen_inner_m)
        _store_word(table_ptr + FROZEN_MAGIC + 1, frozen_inner_l)
        _store_word(table_ptr + FROZEN_MAGIC + 2, frozen_groups_m)
        _store_word(table_ptr + FROZEN_MAGIC + 3, frozen_groups_l)
    if PER_TOKEN:
        row = pid // n_blocks
        tok = (pid - row * n_blocks) * BLOCK + tl.arange(0, BLOCK)
        mask = tok < n_tokens
        a, c, std_ref = mode_coefficients(sigmas_ptr, tl.load(step_ptr + row), sigma_one_tol, eta, sin_half_pi_eta,
                                          MODE, last_index)
        a, c, std, held = token_coefficients(pairs_ptr, row * pairs_stride + tok, mask, sigmas_ptr, sigma_one_tol,
                                             eta, sin_half_pi_eta, MODE, last_index)
        _, ref_d = density_std(std_ref)
        _, tok_d = density_std(std)
        weight = tl.where(held, -1.0, tl.div_rn(ref_d * ref_d, tok_d * tok_d))
        out = table_ptr + TABLE_HEADER + RECORD * (row * n_tokens + tok)
        tl.store(out, a, mask=mask)
        tl.store(out + 1, c, mask=mask)
        tl.store(out + 2, std, mask=mask)
        tl.store(out + 3, weight, mask=mask)
