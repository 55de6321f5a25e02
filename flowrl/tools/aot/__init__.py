"""Ahead-of-time compile of flowrl's kernels for NVIDIA targets, on a machine without a GPU.

Triton's interpreter runs the kernels as Python and accepts code that real Triton rejects (a module
global that is not a ``tl.constexpr``, for one), so every kernel specialization the launchers can
request is also compiled to PTX and cubin for real targets through ``triton.compile(ASTSource(...),
target=GPUTarget(...))``; the wheel ships ``ptxas``, ``cuobjdump`` and ``nvdisasm``. Run it in a
process without ``TRITON_INTERPRET`` (under it ``@triton.jit`` makes interpreted functions); it
compiles into a fresh ``TRITON_CACHE_DIR`` (Triton's cache keys miss some settings, and a cached
build once hid a compile error)::

    python -m flowrl.tools.aot [--arch 90 80] [--quick] [--sass] [--json | --markdown] [--jobs N]
    python -m flowrl.tools.aot --update-docs docs/kernels.md     # the table, both triton versions

It fails (exit 1) on any compile error and on any local-memory use (register spills), and reports
per specialization: registers per thread, spill bytes, shared memory, how many of its global loads
and stores are 128-bit (the latents' vectorized accesses), barriers per program, and (``--sass``: disassembling costs ~0.4 s each) SASS
instructions per element. ``--update-docs`` runs the installed triton and triton 3.6.0 (from
``.venv/triton-3.6``, or ``FLOWRL_TRITON36``) and rewrites the table between the markers of the file.

The modules, by topic: launches.py (the Specialization record, the launchers' configurations),
steps.py (the step kernels' specializations and the full list, ``specializations``), loss_specs.py
(flowrl.losses' kernels'), roofline.py (bytes per element, the bound, the hot specializations and
their targets), compile.py (the compile, the cubin's resources and SASS, ``check``), tables.py
(docs/kernels.md's tables, ``--update-docs``) and __main__.py (the command line). The tool sits
above both flowrl.backends (the launch tables it compiles at) and flowrl.kernels (the kernels it
compiles); neither imports it.
"""
from .compile import analyze, check, compile_specialization, cubin_text, disassemble, sass_count, sass_of
from .launches import ARCHS, STORAGES, Specialization
from .loss_specs import KLReference, loss_specializations
from .roofline import (COPY_BANDWIDTH, ELEMENT_TRAFFIC, ISSUE_RATE, bytes_per_element, hot_specializations, is_hot,
                       roofline_bound, roofline_target, sass_fields)
from .steps import (DDIM_DEFAULT_VARIANTS, DDIM_VARIANTS, FEW_SPECIALIZATIONS, MASKED_DDIM_VARIANT, Rollout,
                    mode_label, specializations)
from .tables import (ROOFLINE_END, ROOFLINE_START, TABLE_END, TABLE_START, markdown, markdown_rows, roofline_markdown,
                     summarize, triton36_path, update_docs)

__all__ = [
    "ARCHS", "COPY_BANDWIDTH", "DDIM_DEFAULT_VARIANTS", "DDIM_VARIANTS", "ELEMENT_TRAFFIC", "FEW_SPECIALIZATIONS",
    "ISSUE_RATE", "KLReference", "MASKED_DDIM_VARIANT", "ROOFLINE_END", "ROOFLINE_START", "Rollout", "STORAGES",
    "Specialization", "TABLE_END", "TABLE_START", "analyze", "bytes_per_element", "check", "compile_specialization",
    "cubin_text", "disassemble", "hot_specializations", "is_hot", "loss_specializations", "markdown", "markdown_rows",
    "mode_label", "roofline_bound", "roofline_markdown", "roofline_target", "sass_count", "sass_fields", "sass_of",
    "specializations", "summarize", "triton36_path", "update_docs",
]
