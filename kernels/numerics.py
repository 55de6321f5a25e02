"""Float32 numerics shared by every flowrl kernel (``flowrl.kernels.common`` re-exports every name):
whether the kernels run interpreted, exact negation, and the 16-bit storage conversions (the loads'
widening to float32, the stores' round-to-nearest-even), each compiled to the fewest instructions
with the same bits as Triton's own conversions.
"""
import os

import triton
import triton.language as tl

# Whether @triton.jit makes interpreted functions in this process (TRITON_INTERPRET, read at import
# like triton.jit itself): round_to's integer bfloat16 rounding is needed only there.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def neg(x):
    """-x exactly (IEEE negation, -0.0 for +0.0). Triton 3.6 lowers unary minus to 0 - x: an FADD the
    consumer cannot absorb (and +0.0 for +0.0), where a multiply by -1.0 becomes LLVM's fneg, which an
    FFMA or FMUL takes as an operand modifier, free."""
    return x * -1.0


@triton.jit
def bf16_words_to_f32(words):
    """bfloat16 pairs read as uint32 words, as float32 in element order: each half one integer op
    (low << 16, high & 0xffff0000) where a bfloat16 load's conversion takes 1.5 per value; the same
    bits. Little-endian: element 2i is word i's low half."""
    low = (words << 16).to(tl.float32, bitcast=True)
    high = (words & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.interleave(low, high)


@triton.jit
def to_f32(x):
    """``x`` as float32. Compiled bfloat16 (two values per 32-bit register as loaded): one integer op
    per value, ``bf16_words_to_f32``'s (low << 16, high & 0xffff0000) by inline PTX on each register,
    where Triton's conversion takes 1.5; the same bits (bfloat16 is float32's upper half).
    Interpreted, and for the other dtypes, the cast."""
    if INTERPRETED or x.dtype != tl.bfloat16:
        return x.to(tl.float32)
    else:
        return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to the storage dtype DTYPE, to nearest even (torch's ``.to``).

    Compiled, the conversion is the hardware's round-to-nearest-even (cvt.rn.bf16.f32 / cvt.rn.f16.f32,
    one per value; ``round_pairs`` converts a pair at once). Triton's interpreter truncates float32 ->
    bfloat16, so there (INTERPRETED) bfloat16 is rounded with integer ops first: the same bits for
    finite values (an overflow carries into the exponent and gives inf, as the hardware does); the
    integer form costs 3-4 instructions per value, which the compiled kernels do not pay."""
    if DTYPE == tl.bfloat16:
        if INTERPRETED:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def round_pairs(x, DTYPE: tl.constexpr):
    """float32 ``x`` (1-D, even length) rounded to 16-bit DTYPE (bfloat16 / float16) to nearest even,
    as ``round_to``, two values per uint32 word as memory holds them (element 2i in word i's low
    half). Compiled, one cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 per word (the PTX ISA's packed
    conversion: its first source goes to the upper half), where Triton converts each value apart and
    then packs the halves; interpreted, ``round_to`` on each value."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0] // 2, 2)))
    if INTERPRETED:
        low = round_to(even, DTYPE).to(tl.uint16, bitcast=True).to(tl.uint32)
        high = round_to(odd, DTYPE).to(tl.uint16, bitcast=True).to(tl.uint32)
        return low | (high << 16)
    elif DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd], dtype=tl.uint32,
                                         is_pure=True, pack=1)


@triton.jit
def words_to_f32(words, DTYPE: tl.constexpr):
    """16-bit DTYPE pairs held as uint32 words (``round_pairs``' layout), as float32 in element order."""
    if DTYPE == tl.bfloat16:
        return bf16_words_to_f32(words)
    low = (words & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (words >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.interleave(low, high)
