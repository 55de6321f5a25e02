"""Every Triton kernel compiles for real GPU targets, sm_90a with the newest triton installed (and
sm_80, a spot check: its hot bf16 specializations) and with triton 3.6.0 (the GPU machines' image,
an H200), on this CPU machine: Triton's interpreter, which runs the numerics tests, accepts code that
real Triton rejects, so only a compile catches that class of error. The compile runs in the
background from the session's start (tests/aot_runs.py); the checks that read it run last.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import aot_runs
import pytest
from aot_runs import ARCHS_36, ARCHS_NEWEST, CAN_COMPILE, SPOT_NEWEST, TRITON36, compile_env

pytestmark = pytest.mark.slow  # the AOT compile of every kernel specialization, with two triton versions: minutes (./run test -m 'not slow' skips it)

triton = pytest.importorskip("triton")

needs_linux_x86 = pytest.mark.skipif(not CAN_COMPILE, reason="triton's CUDA backend wheels are Linux x86_64")
_env = compile_env
DOCS_KERNELS = Path(__file__).resolve().parents[2] / "docs" / "kernels.md"


def aot_rows(pythonpath=None):
    """(exit status, rows) of the full AOT run with the installed triton or triton 3.6.0 (``TRITON36``):
    tests/aot_runs.py's, shared by this file's checks, tests/kernels/test_roofline.py's and
    tests/losses/test_losses_dpo.py's."""
    return aot_runs.rows(pythonpath)


def _expected_count(archs, spot=()):
    from flowrl.tools import aot

    return sum(len(aot.hot_specializations("bf16")) if arch in spot else
               sum(len(list(aot.specializations(storage))) for storage in aot.STORAGES) for arch in archs)


def _check_rows(rows, version, archs, spot=()):
    """Every specialization for ``archs`` compiled (the hot bf16 ones for ``spot``), with no register
    spill, and the element kernels' latents loaded (and the rollout's x' stored) 128 bits at a time
    where the JIT's alignment attributes hold, one unaligned variant excepted."""
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed[:5]
    assert len(rows) == _expected_count(archs, spot)
    assert {r["kernel"] for r in rows} == {"step_partials_kernel", "finalize_kernel", "step_backward_kernel",
                                          # flowrl.losses (kernels/loss.py)
                                          "grpo_partials_kernel", "grpo_backward_kernel", "flow_partials_kernel",
                                          "flow_backward_kernel",
                                          # the elementwise steps' pre-pass (kernels/token.py)
                                          "token_table_kernel"}
    assert {(r["storage"], r["arch"]) for r in rows} == {(s, f"sm_{a}") for a in archs
                                                         for s in (("bf16",) if a in spot else ("bf16", "fp16", "fp32"))}
    for r in rows:
        assert r["triton"] == version and r["spill_bytes"] == 0 and r["registers"] > 0, r
        if r["kernel"] in ("finalize_kernel", "token_table_kernel"):  # no latents
            continue
        if "unaligned-tensors" in r["label"]:
            assert r["loads_128"] == 0, r
        else:
            assert r["loads_128"] >= 2, r
        if "rollout" in r["label"]:
            assert r["stores_128"] >= 1, r
    # docs/kernels.md: a chunk on one warp (the launch table's (1, 1)) has its halving tree in registers
    # and warp shuffles: no shared memory in any element kernel launched on one warp (the configurations
    # that spread a chunk over several warps, ELEMENTWISE_CONFIG and WIDE_CONFIG, cross warps through
    # shared memory), and no barrier but those that order its work ("Parts")
    one_warp = [r for r in rows if r["kernel"] != "finalize_kernel" and r["num_warps"] == 1]
    assert one_warp
    for r in one_warp:
        assert r["shared_bytes"] == 0 and r["barriers"] == _expected_barriers(r["kernel"], r["label"]), r
    _check_docs_table(rows, version)


def _check_docs_table(rows, version):
    """docs/kernels.md's per-kernel table (``python -m flowrl.tools.aot --update-docs``) holds this run's
    sm_90 lines for ``version`` as the compile gives them (its sm_80 lines come from --update-docs' whole
    sm_80 compile, which CI does not run; a triton version the table does not list is not checked)."""
    from flowrl.tools import aot

    text = DOCS_KERNELS.read_text()
    if not any(row["triton"] == version for row in aot.markdown_rows(text, aot.TABLE_START, aot.TABLE_END)):
        return
    table = text.split(aot.TABLE_START, 1)[1].split(aot.TABLE_END, 1)[0].splitlines()
    stale = [line for line in aot.markdown([r for r in rows if r["arch"] == "sm_90"]).splitlines()[2:]
             if line not in table]
    assert not stale, ("docs/kernels.md's per-kernel table differs from the compile: rerun "
                       "python -m flowrl.tools.aot --update-docs docs/kernels.md", stale)


def _expected_barriers(kernel, label):
    """The barriers of a one-warp element kernel (docs/kernels.md, "Parts"): one per tile after the
    Philox noise (a step rollout, the GRPO family's replayed mu_old) keeps the latents' loads behind it;
    ddim's Philox rollout on whole 4-tile blocks runs each tile as four parts, each drawn then loaded (a
    barrier after each part's noise, one between parts and one between tiles: 7 per tile and 3); ddim's
    backward of the mean and of the clipped KL, four parts per tile (one between parts)."""
    tiles = 4 if " g4w1" in label else 1
    ddim, replay = label.startswith("ddim["), "trust=2" in label
    if kernel == "step_partials_kernel" and "noise=philox" in label:
        return 8 * tiles - 1 if ddim and tiles > 1 and label.endswith(" even") else tiles
    if kernel == "step_backward_kernel" and ddim and ("gaussian" in label or " clip] kl" in label):
        return 4 * tiles - 1
    return 1 if kernel.startswith("grpo_") and replay else 0


@needs_linux_x86
@pytest.mark.aot
def test_every_kernel_specialization_compiles_with_the_installed_triton():
    rc, rows = aot_rows()
    _check_rows(rows, triton.__version__, ARCHS_NEWEST, SPOT_NEWEST)
    assert rc == 0


@needs_linux_x86
@pytest.mark.aot
def test_every_kernel_specialization_compiles_with_triton_3_6():
    if not (TRITON36 / "triton").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"triton 3.6.0 is missing from {TRITON36}: ./run's set-up installs it")
        pytest.skip(f"triton 3.6.0 not installed in {TRITON36} (./run's set-up installs it)")
    rc, rows = aot_rows(TRITON36)
    _check_rows(rows, "3.6.0", ARCHS_36)
    assert rc == 0


def test_the_specializations_cover_every_switch_the_launchers_use():
    from flowrl.backends import _triton_ops
    from flowrl.contract import LogProbKind, Mode, NoiseSource, Op
    from flowrl.tools import aot

    specs = [s for storage in aot.STORAGES for s in aot.specializations(storage)]
    partials = [s.constexprs for s in specs if s.kernel == "step_partials_kernel"]
    backward = [s.constexprs for s in specs if s.kernel == "step_backward_kernel"]
    finalize = [s.constexprs for s in specs if s.kernel == "finalize_kernel"]
    # the full matrix for the original modes; one specialization per op for the modes whose kernels add
    # per-sample coefficients or a per-element mean to those paths (ddim, aot.FEW_SPECIALIZATIONS)
    reduced = set(aot.FEW_SPECIALIZATIONS) | {Mode.DDIM}
    full = [m for m in Mode if m not in reduced]
    assert {(c["MODE"], c["OP"], c["NOISE"], c["WRITE_MEAN"], c["PHILOX_ALIGNED"]) for c in partials} >= {
        (int(m), int(Op.ROLLOUT), int(n), w, a) for m in full for n in NoiseSource for w in (False, True)
        for a in ((True, False) if n is NoiseSource.PHILOX else (False,))
        if not (n is NoiseSource.PHILOX and not a and not w)} | {
        (int(m), int(op), int(NoiseSource.TENSOR), False, False) for m in Mode for op in (Op.LOG_PROB, Op.KL)} | {
        (int(m), int(Op.ROLLOUT), int(n), w, a) for m in reduced
        for n, w, a in ((NoiseSource.TENSOR, True, False), (NoiseSource.PHILOX, False, True))}
    assert {(c["MODE"], c["KIND"], c["MEAN"]) for c in backward} == {
        (int(m), int(k), mean) for m in full for k in LogProbKind for mean in (True, False)} | {
        (int(m), int(k), True) for m in reduced for k in (LogProbKind.GAUSSIAN, LogProbKind.KL)}
    assert {(c["MODE"], c["KIND"], c["MEAN"]) for c in finalize} == {
        (int(m), int(k), mean) for m in full for k in LogProbKind for mean in (True, False)} | {
        (int(m), int(LogProbKind.GAUSSIAN), True) for m in reduced}
    # ddim: every prediction type, with and without the clip, and its deterministic (eta = 0) rollout
    ddim = [c for c in partials if c["MODE"] == int(Mode.DDIM)]
    assert {c["PRED"] for c in ddim} == {0, 1, 2} and {c["CLIP"] for c in ddim} == {True, False}
    # epsilon with and without the clip in every storage (DDIMScheduler's default; Stable Diffusion's
    # config, DDPO's), with every op
    for storage in aot.STORAGES:
        eps = {(c["CLIP"], c["OP"]) for s in specs if s.kernel == "step_partials_kernel"
               and s.signature["v_ptr"] == "*" + storage for c in [s.constexprs]
               if c["MODE"] == int(Mode.DDIM) and c["PRED"] == 0}
        assert eps == {(clip, int(op)) for clip in (False, True) for op in Op}, storage
    assert any(c["NOISE"] == int(NoiseSource.NONE) for c in ddim)
    assert {c["WIDTH"] for c in finalize} >= {2, 64, 1024, _triton_ops.MAX_FINALIZE_WIDTH}
    # the one-tile table, the step kernels' multi-tile table (step_config) and the elementwise steps'
    configs = {(g, w) for table in (_triton_ops.LAUNCH_TABLE, _triton_ops.STEP_LAUNCH_TABLE) for _, g, w in table}
    configs |= {_triton_ops.ELEMENTWISE_CONFIG}
    # the forward's WIDE_CONFIG: Philox from an unaligned offset, ddim's float32 rollouts (element_config);
    # SLIM_CONFIG: float32 elementwise steps with one lookup per element
    forward = configs | {_triton_ops.WIDE_CONFIG, _triton_ops.UNALIGNED_PHILOX_CONFIG, _triton_ops.SLIM_CONFIG}
    step = [s for s in specs if s.kernel in ("step_partials_kernel", "step_backward_kernel")]
    group = {id(s): s.constexprs.get("GROUP", s.constexprs.get("BLOCK", 0) // 1024) for s in step}
    assert {(group[id(s)], s.num_warps) for s in step if s.kernel == "step_partials_kernel"} == forward
    assert {(group[id(s)], s.num_warps) for s in step if s.kernel == "step_backward_kernel"} == configs
    # TILES as the launcher sets it (step_switches); every one-warp configuration of each step kernel on
    # whole blocks (EVEN) and masked; the multi-warp ones masked only (step_switches never sets EVEN there)
    assert all(s.constexprs["TILES"] == _triton_ops.element_tiles(group[id(s)], s.num_warps) for s in step)
    assert any(s.constexprs["TILES"] > 1 for s in step)
    for kernel in ("step_partials_kernel", "step_backward_kernel"):
        one_warp = {(group[id(s)], s.constexprs["EVEN"]) for s in step if s.kernel == kernel and s.num_warps == 1}
        assert one_warp == {(g, even) for g, _ in one_warp for even in (True, False)}, (kernel, one_warp)
    assert not any(s.constexprs["EVEN"] for s in step if s.num_warps > 1)


@needs_linux_x86
def test_the_compile_check_catches_what_the_interpreter_accepts(tmp_path):
    """Negative control: a kernel reading a plain-int module global (the defect that kept flowrl's
    kernels from compiling on any GPU) runs under the interpreter but fails this compile."""
    (tmp_path / "bad_kernel.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl

        PLAIN_INT = 2

        @triton.jit
        def bad(out_ptr, KIND: tl.constexpr):
            if KIND == PLAIN_INT:
                tl.store(out_ptr, 1.0)
    '''))
    code = textwrap.dedent('''
        import sys
        sys.path.insert(0, ".")
        import bad_kernel
        from flowrl.tools.aot import Specialization, compile_specialization
        try:
            compile_specialization(Specialization("bad", {"out_ptr": "*fp32"}, {"KIND": 2}, (), 1), kernel=bad_kernel.bad)
        except Exception as exc:
            print("FAILED", type(exc).__name__, exc)
        else:
            print("COMPILED")
    ''')
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=600)
    assert "FAILED" in res.stdout and "PLAIN_INT" in res.stdout, res.stdout + res.stderr[-2000:]
    interp = subprocess.run(
        [sys.executable, "-c", "import sys, torch; sys.path.insert(0, '.'); import bad_kernel; "
         "out = torch.zeros(1); bad_kernel.bad[(1,)](out, KIND=2); print(float(out[0]))"],
        cwd=tmp_path, env=dict(_env(tmp_path), TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert interp.stdout.strip() == "1.0", interp.stdout + interp.stderr[-2000:]


def _probe_ptx(tmp_path, source: str, name: str, signature: dict) -> str:
    """The sm_90a PTX of the @triton.jit function ``name`` in ``source`` (a module written to
    ``tmp_path``), compiled by flowrl/tools/aot's compile_specialization in a fresh process and cache,
    every pointer 16-byte aligned: how the inline-PTX helpers' tests below see the compiled code."""
    (tmp_path / "probe_kernel.py").write_text(textwrap.dedent(source))
    code = textwrap.dedent(f'''
        import sys
        sys.path.insert(0, ".")
        import probe_kernel
        from flowrl.tools.aot import Specialization, compile_specialization
        sig = {signature!r}
        spec = Specialization({name!r}, sig, {{}}, tuple(sig), 1)
        print(compile_specialization(spec, kernel=probe_kernel.{name}).asm["ptx"])
    ''')
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@needs_linux_x86
@pytest.mark.parametrize("storage", ["bf16", "fp16"])
def test_packed_rounding_puts_each_pair_in_memory_order(tmp_path, storage):
    """common.round_pairs' one conversion per pair (inline PTX: the interpreter runs round_to instead,
    so only the compiled code shows this). The PTX ISA's cvt.rn.{bf16x2,f16x2}.f32 d, a, b puts a in the
    upper half of d, b in the lower: in a copy through round_pairs, each stored word's conversion must
    take the loaded word's upper half (element 2i + 1) first and its lower half (element 2i, the lower
    address) second, the words stored in the order they were loaded."""
    ptx = _probe_ptx(tmp_path, '''
        import triton
        import triton.language as tl
        from flowrl.kernels.common import round_pairs

        @triton.jit
        def pairs(x_ptr, out_ptr):
            words = round_pairs(tl.load(x_ptr + tl.arange(0, 256)).to(tl.float32), out_ptr.dtype.element_ty)
            tl.store(out_ptr.to(tl.pointer_type(tl.uint32)) + tl.arange(0, 128), words)
    ''', "pairs", {"x_ptr": f"*{storage}", "out_ptr": f"*{storage}"})
    import re

    (loaded,) = re.findall(r"ld\.global\.v4\.b32 \{ (%r\d+), (%r\d+), (%r\d+), (%r\d+) \}", ptx)
    element = {}  # 16-bit register -> element index: mov.b32 {lo, hi}, word
    for lo, hi, word in re.findall(r"mov\.b32\s+\{(%rs\d+), (%rs\d+)\}, (%r\d+);", ptx):
        element[lo], element[hi] = 2 * loaded.index(word), 2 * loaded.index(word) + 1
    for dst, src in re.findall(r"cvt\.f32\.b?f16\s+(%r\d+), (%rs\d+);", ptx):
        element[dst] = element[src]
    kind = {"bf16": "bf16x2", "fp16": "f16x2"}[storage]
    pairs = {dst: (element[hi], element[lo]) for dst, hi, lo in re.findall(rf"cvt\.rn\.{kind}\.f32 (%r\d+), (%r\d+), (%r\d+);", ptx)}
    (stored,) = re.findall(r"st\.global\.v4\.b32 \[ %rd\d+ \+ 0 \], \{ (%r\d+), (%r\d+), (%r\d+), (%r\d+) \}", ptx)
    assert [pairs[w] for w in stored] == [(2 * i + 1, 2 * i) for i in range(4)], ptx[-3000:]


def _widened_pair_order(ptx: str):
    """For each stored word of the to_f32 kernel below: the (upper, lower) element indices of its
    cvt.rn.bf16x2.f32, each register's element known from the instruction that made it out of loaded
    word i (shl by 16: its low half, element 2i; and 0xffff0000: its high half, element 2i + 1)."""
    import re

    (loaded,) = re.findall(r"ld\.global\.v4\.b32 \{ (%r\d+), (%r\d+), (%r\d+), (%r\d+) \}", ptx)
    element = {}
    for dst, word in re.findall(r"shl\.b32 (%r\d+), (%r\d+), 16;", ptx):
        if word in loaded:
            element[dst] = 2 * loaded.index(word)
    for dst, word in re.findall(r"and\.b32 (%r\d+), (%r\d+), 0xffff0000;", ptx):
        element[dst] = 2 * loaded.index(word) + 1
    for dst, a, b in re.findall(r"add\.rn\.f32\s+(%r\d+), (%r\d+), (%r\d+);", ptx):
        if a == b and a in element:
            element[dst] = element[a]
    pairs = {dst: (element[hi], element[lo])
             for dst, hi, lo in re.findall(r"cvt\.rn\.bf16x2\.f32\s+(%r\d+), (%r\d+), (%r\d+);", ptx)}
    (stored,) = re.findall(r"st\.global\.v4\.b32 \[ %rd\d+ \+ 0 \], \{ (%r\d+), (%r\d+), (%r\d+), (%r\d+) \}", ptx)
    return [pairs[w] for w in stored]


@needs_linux_x86
def test_packed_widening_gives_each_value_its_element(tmp_path):
    """common.to_f32's bfloat16 conversion (inline PTX on each 32-bit register of two values: the
    interpreter runs the cast instead, so only the compiled code shows this): in x -> 2 x rounded back,
    each stored word's packed conversion must take element 2i + 1 (the loaded word's high half, by
    the and) as its upper half and element 2i (the shift) as its lower one. A listing with the two
    outputs swapped is rejected (negative control)."""
    ptx = _probe_ptx(tmp_path, '''
        import triton
        import triton.language as tl
        from flowrl.kernels.common import to_f32

        @triton.jit
        def widen(x_ptr, out_ptr):
            x = to_f32(tl.load(x_ptr + tl.arange(0, 256)))
            tl.store(out_ptr + tl.arange(0, 256), (x + x).to(tl.bfloat16))
    ''', "widen", {"x_ptr": "*bf16", "out_ptr": "*bf16"})
    assert _widened_pair_order(ptx) == [(2 * i + 1, 2 * i) for i in range(4)], ptx[-3000:]
    import re

    swapped = re.sub(r"\{ shl\.b32 (%r\d+), (%r\d+), 16; and\.b32 (%r\d+), (%r\d+), 0xffff0000; \}",
                     r"{ shl.b32 \3, \2, 16; and.b32 \1, \4, 0xffff0000; }", ptx)
    assert swapped != ptx and _widened_pair_order(swapped) == [(2 * i, 2 * i + 1) for i in range(4)]


def _stored_halves(ptx: str):
    """Which half of the mul.wide.u32 product each of the kernel below's two stores writes, in order:
    mov.b64 {low, high} splits the 64-bit product, its first register the low word."""
    import re

    ((low, high),) = re.findall(r"mul\.wide\.u32 t, %r\d+, 0x[0-9a-f]+; mov\.b64 \{(%r\d+), (%r\d+)\}, t;", ptx)
    return [{low: "low", high: "high"}[r] for r in re.findall(r"st\.global\.b32 \[ %rd\d+ \+ 0 \], \{ (%r\d+) \}", ptx)]


@needs_linux_x86
def test_philox_multiply_returns_the_high_word_first(tmp_path):
    """common.mul_wide_u32 (inline PTX: the interpreter runs the 64-bit product instead) returns
    (high, low): storing its first result at out[i] and its second at out[32 + i], the first store
    must write the product's high word. A listing with the split's registers swapped is rejected
    (negative control)."""
    ptx = _probe_ptx(tmp_path, '''
        import triton
        import triton.language as tl
        from flowrl.kernels.common import PHILOX_M0, PHILOX_M0_ASM, mul_wide_u32

        @triton.jit
        def wide(x_ptr, out_ptr):
            i = tl.arange(0, 32)
            hi, lo = mul_wide_u32(tl.load(x_ptr + i), PHILOX_M0, PHILOX_M0_ASM)
            tl.store(out_ptr + i, hi)
            tl.store(out_ptr + 32 + i, lo)
    ''', "wide", {"x_ptr": "*u32", "out_ptr": "*u32"})
    assert "0xd2511f53" in ptx and _stored_halves(ptx) == ["high", "low"], ptx[-3000:]
    import re

    swapped = re.sub(r"mov\.b64 \{(%r\d+), (%r\d+)\}, t;", r"mov.b64 {\2, \1}, t;", ptx)
    assert swapped != ptx and _stored_halves(swapped) == ["low", "high"]
