"""The roofline check (issue 21; docs/kernels.md, "The roofline"): every hot kernel specialization
(``flowrl.tools.aot.hot_specializations``), compiled for sm_90a with the installed triton and with
triton 3.6.0, issues few enough SASS instructions per byte it moves to reach its target fraction of
an H200's copy bandwidth (``aot.roofline_target``). Deterministic: a static count of the compiled
code (loop-free, checked), not a timing; no GPU needed. sm_80 is reported (docs/kernels.md's table,
``python -m flowrl.tools.aot --roofline --arch 80``), not asserted.

The targets not met yet are listed in NOT_YET_MET with the floor measured today (the lowest bound
over bf16 / fp16 and both triton versions, rounded down to 0.01): those specializations must stay at
or above their floor (a ratchet), the others at or above their target. Raise a floor when a kernel
gets cheaper; remove the entry when the target holds.
"""
import os

import pytest

from test_compile import DOCS_KERNELS, TRITON36, aot_rows, needs_linux_x86

triton = pytest.importorskip("triton")

STORAGES = ("bf16", "fp16")

# "kernel: label" -> the floor of its bound (fraction of copy bandwidth), below its target today.
# Filled from `python -m flowrl.tools.aot --hot --storage bf16 fp16 --arch 90 --roofline` with both
# triton versions; docs/kernels.md says why each is not met yet.
NOT_YET_MET = {
    "step_partials_kernel: ddim[epsilon clip] rollout noise=philox g4w1 even": 0.88,
    "step_partials_kernel: ddim[epsilon] rollout noise=philox g4w1 even": 0.91,
    "step_partials_kernel: ddim[sample clip] rollout noise=philox g4w1 even": 0.89,
    "step_partials_kernel: ddim[v_prediction] rollout noise=philox g4w1 even": 0.94,
}


def _hot_rows(pythonpath=None):
    """(exit status, the hot rows): the hot specializations' sm_90a rows (their SASS counted) of the full
    AOT run tests/kernels/test_compile.py shares (``aot_rows``), each (storage, kernel: label) once, as
    ``aot.hot_specializations`` takes them."""
    rc, rows = aot_rows(pythonpath)
    hot, seen = [], set()
    for r in rows:
        key = (r["storage"], r["kernel"], r["label"])
        if r["arch"] == "sm_90" and r["storage"] in STORAGES and r.get("sass_per_element") is not None and key not in seen:
            seen.add(key)
            hot.append(r)
    return rc, hot


def _check(rows, version):
    from flowrl.tools import aot

    hot = {f"{s.kernel}: {s.label}" for storage in STORAGES for s in aot.hot_specializations(storage)}
    assert len(rows) == sum(len(aot.hot_specializations(storage)) for storage in STORAGES)
    assert set(NOT_YET_MET) <= hot, sorted(set(NOT_YET_MET) - hot)
    report, below = [], []
    for r in rows:
        key = f"{r['kernel']}: {r['label']}"
        assert r["ok"] and r["triton"] == version and r["arch"] == "sm_90", r
        assert r["spill_bytes"] == 0 and r["loops"] == 0, r
        assert r["registers"] <= 128, r
        assert r["target"] is not None and r["bound"] is not None, r
        floor = NOT_YET_MET.get(key, r["target"])
        report.append(f"{r['storage']} {key}: bound {r['bound']:.3f} (target {r['target']}, floor {floor})")
        if r["bound"] < floor:
            below.append(report[-1])
    print("\n".join(report))
    assert not below, below
    _check_docs_table(rows, version)


def _check_docs_table(rows, version):
    """docs/kernels.md's roofline table (bf16, ``--update-docs``) states each hot bf16 row's SASS per
    element and bound for ``version`` as the compile gives them (a triton version the table has no
    columns for is not checked)."""
    from flowrl.tools import aot

    documented = {(d["kernel"].strip("`"), d["specialization"]): d
                  for d in aot.markdown_rows(DOCS_KERNELS.read_text(), aot.ROOFLINE_START, aot.ROOFLINE_END)}
    sass, bound = f"SASS / element ({version})", f"bound ({version})"
    if bound not in next(iter(documented.values()), {}):
        return
    bf16 = {(r["kernel"], r["label"]): r for r in rows if r["storage"] == "bf16"}
    assert set(documented) == set(bf16), sorted(set(documented) ^ set(bf16))
    stale = [(key, documented[key][sass], documented[key][bound], r["sass_per_element"], r["bound"])
             for key, r in bf16.items()
             if (documented[key][sass], documented[key][bound].split()[0]) != (str(r["sass_per_element"]), str(r["bound"]))]
    assert not stale, ("docs/kernels.md's roofline table differs from the compile: rerun "
                       "python -m flowrl.tools.aot --update-docs docs/kernels.md", stale)


@needs_linux_x86
@pytest.mark.slow  # the full AOT run (tests/aot_runs.py, shared with tests/kernels/test_compile.py): minutes
@pytest.mark.aot
def test_hot_specializations_reach_their_roofline_with_the_installed_triton():
    rc, rows = _hot_rows()
    _check(rows, triton.__version__)
    assert rc == 0


@needs_linux_x86
@pytest.mark.slow  # the full AOT run (tests/aot_runs.py, shared with tests/kernels/test_compile.py): minutes
@pytest.mark.aot
def test_hot_specializations_reach_their_roofline_with_triton_3_6():
    if not (TRITON36 / "triton").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"triton 3.6.0 is missing from {TRITON36}: ./run's set-up installs it")
        pytest.skip(f"triton 3.6.0 not installed in {TRITON36} (./run's set-up installs it)")
    rc, rows = _hot_rows(TRITON36)
    _check(rows, "3.6.0")
    assert rc == 0


def test_the_roofline_arithmetic():
    """The issue's model: 72 SASS instructions per element at 6 bytes per element reach 65% of copy
    bandwidth; 7.8 instructions per byte is the break-even."""
    from flowrl.tools import aot

    assert aot.roofline_bound(72, 6) == pytest.approx(0.65, abs=2e-3)
    assert aot.roofline_bound(33.4 / 4.3 * 6, 6) == pytest.approx(1.0, abs=2e-3)


def test_kernels_that_draw_philox_noise_have_the_noise_target():
    """Rollouts drawing Philox noise, the GRPO family's replayed mu_old and DPO / DGPO's eps drawn in the
    kernel: 1.0 (0.7 unaligned); the same kernels without the noise keep theirs."""
    from flowrl.tools import aot

    targets = {}
    for spec in aot.hot_specializations("bf16"):
        cx = spec.constexprs
        philox = bool(cx.get("PHILOX")) or cx.get("TRUST") == 2
        targets.setdefault((spec.kernel, philox), set()).add(aot.roofline_target(spec))
    assert targets[("flow_partials_kernel", True)] == targets[("flow_backward_kernel", True)] == {1.0}
    assert targets[("flow_partials_kernel", False)] == targets[("flow_backward_kernel", False)] == {2.0}
    assert targets[("grpo_partials_kernel", True)] == {1.0} and targets[("grpo_partials_kernel", False)] == {2.0}


def test_bytes_per_element_follow_the_element_traffic_table():
    from flowrl.contract import LogProbKind, Mode, NoiseSource, Op
    from flowrl.tools import aot
    from flowrl.tools.aot.loss_specs import _grpo_loss
    from flowrl.tools.aot.steps import Rollout, _backward, _partials

    g = (1, 1)
    assert aot.bytes_per_element(_partials("bf16", Mode.SDE, Op.LOG_PROB, *g)) == 6
    assert aot.bytes_per_element(_partials("bf16", Mode.SDE, Op.KL, *g)) == 4
    assert aot.bytes_per_element(_partials("bf16", Mode.SDE, Op.ROLLOUT, *g, Rollout(NoiseSource.PHILOX, False, True))) == 6
    assert aot.bytes_per_element(_partials("bf16", Mode.SDE, Op.ROLLOUT, *g, Rollout(NoiseSource.PHILOX, True, True))) == 10
    # given float32 noise and the float32 mean
    assert aot.bytes_per_element(_partials("bf16", Mode.SDE, Op.ROLLOUT, *g, Rollout(NoiseSource.TENSOR, True, False))) == 14
    assert aot.bytes_per_element(_partials("fp32", Mode.SDE, Op.LOG_PROB, *g)) == 12
    assert aot.bytes_per_element(_backward("bf16", Mode.SDE, LogProbKind.GAUSSIAN, True, (False, True, False), *g)) == 8
    assert aot.bytes_per_element(_backward("bf16", Mode.SDE, LogProbKind.GAUSSIAN, True, (True, True, True), *g)) == 12
    assert aot.bytes_per_element(_grpo_loss("bf16", Mode.SDE, True, 2, *g)) == 8
    assert aot.bytes_per_element(_grpo_loss("bf16", Mode.SDE, True, 1, *g)) == 12


def test_sass_count_drops_padding_and_finds_runtime_loops():
    from flowrl.tools import aot

    straight = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA 0x30;
        /*0020*/                   FADD R2, R2, R3 ;
        /*0030*/                   EXIT ;
        /*0040*/                   BRA 0x40;
        /*0050*/                   NOP;
        /*0060*/                   NOP;
"""
    assert aot.sass_count(straight) == (4, 0)
    assert aot.sass_count(straight.replace("@!P0 BRA 0x30", "@!P0 BRA 0x0")) == (4, 1)


@needs_linux_x86
@pytest.mark.slow  # compiles kernels for sm_90a and disassembles them (the quick loop leaves the compile checks out)
def test_batched_disassembly_counts_each_kernel_as_its_own_listing(tmp_path):
    """aot.disassemble: kernels disassembled together (one nvdisasm call over their concatenated machine
    code) count as each one's own ELF listing (``nvdisasm -c`` of its cubin, branch targets as labels),
    a runtime loop included; and a kernel with a runtime loop is reported with one."""
    import subprocess
    import sys
    import textwrap

    from test_compile import _env

    (tmp_path / "two_kernels.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl

        @triton.jit
        def straight(out_ptr, a):
            i = tl.arange(0, 256)
            tl.store(out_ptr + i, tl.sqrt_rn(i.to(tl.float32) * a))

        @triton.jit
        def looped(out_ptr, n):
            acc = tl.zeros((256,), tl.float32)
            for k in range(n):
                acc = acc * 0.5 + k
            tl.store(out_ptr + tl.arange(0, 256), acc)
    '''))
    code = textwrap.dedent(r'''
        import os, re, subprocess, sys, tempfile
        sys.path.insert(0, ".")
        import two_kernels
        from flowrl.tools import aot
        from flowrl.tools.aot.compile import _tool
        compiled = [aot.compile_specialization(aot.Specialization(name, {"out_ptr": "*fp32", arg: t}, {}, ("out_ptr",), 1),
                                               kernel=getattr(two_kernels, name))
                    for name, arg, t in (("straight", "a", "fp32"), ("looped", "n", "i32"))] * 2
        together = [aot.sass_count(part) for part in aot.disassemble([aot.cubin_text(c.asm["cubin"]) for c in compiled])]
        alone = []
        for c in compiled:  # the ELF listing: instructions, less NOPs and the self-branch; loops as labels
            path = os.path.join(tempfile.mkdtemp(), "k.cubin")
            with open(path, "wb") as f:
                f.write(c.asm["cubin"])
            listing = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True,
                                     check=True).stdout
            at, labels, branches = 0, {}, []
            for line in listing.splitlines():
                if re.match(r"^\.L_x_\d+:", line):
                    labels[line.strip(":")] = at
                elif re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?!\s|NOP)", line):
                    target = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", line)
                    if target:
                        branches.append((at, target.group(1)))
                    at += 1
            alone.append((at - sum(labels[t] == a for a, t in branches),
                          sum(labels[t] < a for a, t in branches)))
        print(together, alone)
        assert together == alone
        assert [loops > 0 for _, loops in together] == [False, True, False, True]
    ''')
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def test_docs_state_how_many_hot_specializations_meet_their_targets():
    """docs/kernels.md's count of hot specializations at target is the hot set less NOT_YET_MET."""
    import pathlib
    import re

    from flowrl.tools import aot

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "kernels.md").read_text()
    met, hot = map(int, re.search(r"(\d+) of the (\d+) hot specializations meet their targets", text).groups())
    keys = {f"{s.kernel}: {s.label}" for storage in STORAGES for s in aot.hot_specializations(storage)}
    assert hot == len(keys)
    assert met == hot - len(NOT_YET_MET)
    assert re.search(rf"the other {len(NOT_YET_MET)} are tests/kernels/test_roofline.py's", text.replace("\n", " "))
    # "What is left" / the ninth round: _check holds every hot specialization at <= 128 registers
    assert re.search(r"every hot specialization within 128 registers", text.replace("\n", " "))
    count, low, high = re.search(r"the (\d+)\s+NOT_YET_MET floors rose from \S+ to ([\d.]+)-([\d.]+)", text).groups()
    assert (int(count), float(low), float(high)) == (len(NOT_YET_MET), min(NOT_YET_MET.values()),
                                                     max(NOT_YET_MET.values()))
    per_storage = re.search(r"(\d+) for bf16, (\d+) for fp16", re.sub(r"\s+", " ", text)).groups()
    assert tuple(map(int, per_storage)) == tuple(len(aot.hot_specializations(storage)) for storage in STORAGES)
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text().replace("\n", " ")
    assert re.search(rf"{met} of the {hot} hot specializations meet their targets", re.sub(r"\s+", " ", readme))


@needs_linux_x86
@pytest.mark.slow  # compiles for sm_90a and counts SASS (the quick loop leaves the compile checks out)
def test_philox_normals_cost_at_most_34_sass_each(tmp_path):
    """docs/kernels_log.md ("Fourth round", "Fifth round"): Philox and noise stream 4's Box-Muller alone,
    1,024 normals on one warp, compiled for sm_90a with the installed triton, issue at most 34 SASS
    instructions per normal, stores included (1,046 per 1,024 with triton 3.9.0, 1,076 with 3.6.0;
    1,100 / 1,135 before the uint32 counters and one mul.wide per multiply; stream 3 took 1,183 /
    1,199). A ratchet on the noise's own cost, apart from the kernels around it."""
    import subprocess
    import sys
    import textwrap

    from test_compile import _env

    (tmp_path / "normals_kernel.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl
        from flowrl.kernels.common import philox_key, philox_normal_block

        @triton.jit
        def normals(out_ptr, seed, stream, first):
            k0, k1 = philox_key(seed)
            tl.store(out_ptr + tl.arange(0, 1024), philox_normal_block(k0, k1, stream, first, 1024, True))
    '''))
    code = textwrap.dedent('''
        import sys
        sys.path.insert(0, ".")
        import normals_kernel
        from flowrl.tools import aot
        sig = {"out_ptr": "*fp32", "seed": "i64", "stream": "u32", "first": "i64"}
        compiled = aot.compile_specialization(aot.Specialization("normals", sig, {}, ("out_ptr",), 1),
                                              kernel=normals_kernel.normals)
        print(*aot.sass_of(compiled))
    ''')
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    instructions, loops = map(int, res.stdout.split()[-2:])
    assert loops == 0 and instructions * 32 / 1024 <= 34, instructions
