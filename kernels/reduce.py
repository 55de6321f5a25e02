"""The contract's fixed halving-tree reduction, shared by every flowrl kernel (``flowrl.kernels.common``
re-exports every name): a block's rows and a chunk's leaves summed by the same tree of IEEE adds as
the torch reference (``flowrl.backends.reference_reduce``), whatever the layout or the launch.
"""
import triton
import triton.language as tl

from flowrl import contract as _contract


@triton.jit
def halving_tree_rows(t, ROWS: tl.constexpr, WIDTH: tl.constexpr, LOG2_WIDTH: tl.constexpr):
    """The sums [ROWS] of the rows of a 1-D float32 block of ROWS * WIDTH values (row-major, WIDTH =
    2**LOG2_WIDTH), each by the fixed halving tree ``t[:h] + t[h:]`` repeated
    (flowrl.backends.reference._pairwise_sum). Each level sums an axis of length 2, i.e. one IEEE add per
    output, so the bits do not depend on the compiler's register layout, the kernel it is inlined
    in, how many rows a program holds, or the launch settings."""
    t = tl.reshape(t, (ROWS, WIDTH))
    for level in tl.static_range(LOG2_WIDTH):
        t = tl.sum(tl.reshape(t, (ROWS, 2, WIDTH >> (level + 1))), axis=1)
    return tl.sum(t, axis=1)


# The contract's leaves (flowrl.contract.LEAF_SIZE): a chunk's runs of consecutive elements summed first.
LEAF = tl.constexpr(_contract.LEAF_SIZE)
LOG2_LEAF = tl.constexpr(_contract.LOG2_LEAF_SIZE)


@triton.jit
def chunk_tree_rows(t, ROWS: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr):
    """The partials [ROWS] of a 1-D float32 block of ROWS chunks of CHUNK values (row-major), each in
    the contract's chunk order (flowrl.backends.reference._chunk_partials): every leaf of LEAF consecutive
    values by the halving tree, then the chunk's CHUNK / LEAF leaf sums by the same tree. Each level
    sums an axis of length 2 (one IEEE add per output), so the bits do not depend on the layout or
    the launch; a thread's 16-byte load of bfloat16 is one leaf, so the leaves add up in registers
    and the tree crosses lanes with one value per thread (``halving_tree_rows`` over the chunk would
    cross them with eight)."""
    return halving_tree_rows(leaf_sums_rows(t, ROWS, CHUNK), ROWS, CHUNK // LEAF, LOG2_CHUNK - LOG2_LEAF)


@triton.jit
def leaf_sums_rows(t, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """The sums [ROWS, WIDTH / LEAF] of each LEAF consecutive values of a 1-D float32 block of ROWS rows of
    WIDTH values (row-major), each by the halving tree: a chunk tree's first levels
    (``chunk_tree_rows``)."""
    t = tl.reshape(t, (ROWS, WIDTH // LEAF, LEAF))
    for level in tl.static_range(LOG2_LEAF):
        t = tl.sum(tl.reshape(t, (ROWS, WIDTH // LEAF, 2, LEAF >> (level + 1))), axis=2)
    return t


@triton.jit
def carry_part_leaves(even, odd, t, part: tl.constexpr, PART: tl.constexpr):
    """A chunk run in 2 or 4 parts of PART consecutive values (one chunk per program): part ``part``'s
    leaf sums [PART / LEAF] of ``t`` added into the carried (even, odd), so that ``even + odd`` is the
    chunk tree's first levels over the parts' leaves Q0 | Q1 (| Q2 | Q3): Q0 + Q1, or (Q0 + Q2) + (Q1 +
    Q3), element by element (``part_chunk_partial`` finishes the tree)."""
    leaves = tl.reshape(leaf_sums_rows(t, 1, PART), (PART // LEAF,))
    if part == 0:
        even = leaves
    elif part == 1:
        odd = leaves
    elif part % 2 == 0:
        even = even + leaves
    else:
        odd = odd + leaves
    return even, odd


@triton.jit
def part_chunk_partial(even, odd, PARTS: tl.constexpr, PART: tl.constexpr, LOG2_CHUNK: tl.constexpr):
    """The chunk's partial [1] from the leaf sums its PARTS parts carried (``carry_part_leaves``): the
    halving tree within a part after the levels across them, the contract's order
    (``chunk_tree_rows``), the same bits."""
    tl.static_assert(PARTS == 2 or PARTS == 4)
    LOG2_PARTS: tl.constexpr = 1 if PARTS == 2 else 2
    return halving_tree_rows(even + odd, 1, PART // LEAF, LOG2_CHUNK - LOG2_LEAF - LOG2_PARTS)
