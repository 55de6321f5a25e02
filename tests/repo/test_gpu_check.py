"""bench/gpu_check.sh, the one-call GPU check, run here in its dry mode (DRY_RUN=1: every phase on the
CPU with tiny shapes and a few test files), and bench/run.py's checkpoints: a GPU lease is short, so
the script must work the first time it meets a GPU, and a phase cut at its time share must keep the
rows it measured."""
from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

pytestmark = pytest.mark.slow  # runs bench/gpu_check.sh's dry run and the suite's collection in subprocesses (./run test -m 'not slow' skips it)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "bench", "gpu_check.sh")
BENCH_PHASES = ("targets", "sweep", "modes", "fp32", "losses")
TEST_PHASES = ("tests_gpu", "tests_rest")


def _csv_rows(tar: tarfile.TarFile, name: str):
    return list(csv.DictReader(io.StringIO(tar.extractfile(name).read().decode())))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run stands in for a GPU: on one, the script runs for real")
def test_dry_run_does_every_phase_and_brings_back_two_files(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "BENCH_ARGS")}
    env.update(DRY_RUN="1", TOTAL_S="600", OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    log = (tmp_path / "gpu_check.log").read_text()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # what a lease brings back is at most 8 files: the log and one archive
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.log", "gpu_check_results.tar"]
    summary = log.strip().splitlines()[-1]
    for phase in TEST_PHASES + BENCH_PHASES:
        assert f" {phase}=0" in summary, summary
    with tarfile.open(tmp_path / "gpu_check_results.tar") as tar:
        names = [os.path.basename(n) for n in tar.getnames() if tar.getmember(n).isfile()]
        for phase in TEST_PHASES:
            assert f"{phase}.xml" in names
        for phase in BENCH_PHASES:
            csvs = [n for n in tar.getnames() if n.endswith(f"-{phase}.csv")]
            assert len(csvs) == 1 and any(n.endswith(f"-{phase}.md") for n in names), (phase, names)
            rows = _csv_rows(tar, csvs[0])
            assert rows and all(r["tag"] == phase and "partial" not in r for r in rows), phase
            assert {r["impl"] for r in rows} == {"flowrl-torch", "eager"}, phase
            assert not any(r["note"].startswith("CHECK FAILED") for r in rows), phase
        targets = _csv_rows(tar, next(n for n in tar.getnames() if n.endswith("-targets.csv")))
        # the 5-D target shape runs the conditioned video ops too
        assert {"rollout", "recompute_fwd", "recompute_fwd_bwd", "kl_fwd_bwd", "rollout_cond"} <= {r["op"] for r in targets}
        assert {r["mode"] for r in targets} == {"sde", "cps"} and {r["dtype"] for r in targets} == {"bf16"}
    # every benchmark table is in the log too
    assert log.count("| op | mode | dtype | shape | impl |") >= len(BENCH_PHASES)


def test_sweep_checkpoints_its_rows_after_each_configuration(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import run as bench
    finally:
        sys.path.pop(0)
    seen = []
    rows, _, _ = bench.run_sweep(
        torch.device("cpu"), [(1, 8, 16), (2, 8, 16)], ["fp32"], ["sde"], ["rollout"], ["flowrl-torch", "eager"],
        timing_budget_s=0.01, log=lambda s: None, progress=lambda rows, copy: seen.append(len(rows)))
    assert seen == [2, 4] and len(rows) == 4
    seen.clear()
    loss_rows, _, _ = bench.run_loss_sweep(
        torch.device("cpu"), [(1, 8, 16)], ["fp32", "bf16"], bench.LOSS_OPS[:1], ["flowrl-torch", "eager"],
        timing_budget_s=0.01, log=lambda s: None, progress=lambda rows, copy: seen.append(len(rows)))
    assert seen == [2, 4] and len(loss_rows) == 4
    # main() writes each checkpoint marked partial, under its tag; the finished file has no such mark
    marks = []
    real_write = bench.write_results

    def spy(rows, header, table, out_dir):
        marks.append(header.get("partial"))
        return real_write(rows, header, table, out_dir)

    bench.write_results = spy
    try:
        assert bench.main(["--device", "cpu", "--shapes", "1x8x16,2x8x16", "--dtypes", "fp32", "--modes", "sde",
                           "--ops", "rollout", "--impls", "flowrl-torch,eager", "--no-compile", "--timing-budget",
                           "0.01", "--tag", "probe", "--out", str(tmp_path)]) == 0
    finally:
        bench.write_results = real_write
    assert marks == ["yes", "yes", None]
    (path,) = [p for p in os.listdir(tmp_path) if p.endswith("-probe.csv")]
    assert len(list(csv.DictReader(open(tmp_path / path)))) == 4


def test_suite_collects_and_skips_without_diffusers(tmp_path):
    """The GPU image has no diffusers (flowrl's optional extra): the tests that need it skip, and no
    test file fails to import, which would stop the whole CUDA run at collection."""
    fake = tmp_path / "diffusers"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'diffusers\'", name="diffusers")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           os.path.join(REPO, "tests")], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "could not import 'diffusers'" in done.stdout  # the stand-in took effect


def test_a_flowrl_implementation_that_raises_fails_the_run(tmp_path, monkeypatch):
    """On a GPU the first sign of a kernel that does not compile may be the benchmark: its row says
    why and the run exits non-zero (a failing torch.compile baseline is only reported)."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import run as bench
    finally:
        sys.path.pop(0)
    real_build = bench.build

    def build(impl, case, op):
        if impl == "flowrl-torch":
            raise RuntimeError("PTX compile failed")
        return real_build(impl, case, op)

    monkeypatch.setattr(bench, "build", build)
    argv = ["--device", "cpu", "--shapes", "1x8x16", "--dtypes", "fp32", "--modes", "sde", "--ops", "rollout",
            "--impls", "flowrl-torch,eager", "--no-compile", "--timing-budget", "0.01", "--out", str(tmp_path)]
    assert bench.main(argv) == 1
    (path,) = [p for p in os.listdir(tmp_path) if p.endswith(".csv")]
    notes = {r["impl"]: r["note"] for r in csv.DictReader(open(tmp_path / path))}
    assert notes == {"flowrl-torch": "RuntimeError: PTX compile failed", "eager": ""}
    monkeypatch.setattr(bench, "build", real_build)
    assert bench.main(argv) == 0


def test_every_mode_and_step_op_has_its_static_bound_from_the_docs_table():
    """bench/run.py's static bound beside each measured GB/s (docs/kernels.md's roofline table, bf16):
    every mode of every step op has one (ddim's labels carry its prediction, dpm_sde's its order),
    and it is the lowest of the op's kernels' bounds there."""
    from flowrl.tools import aot

    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import baseline
        import run as bench
    finally:
        sys.path.pop(0)
    with open(bench.DOCS_KERNELS) as f:
        rows = {(r["kernel"].strip("`"), r["specialization"]): r
                for r in aot.markdown_rows(f.read(), aot.ROOFLINE_START, aot.ROOFLINE_END)}
    for op in bench.OPS + bench.TREE_OPS:
        for mode in baseline.MODES:
            assert bench.static_bound(op, mode, "bf16", "3.6.0") > 0, (op, mode)
        assert bench.static_bound(op, "sde", "fp32", "3.6.0") != bench.static_bound(op, "sde", "fp32", "3.6.0")  # NaN
    philox = float(rows[("step_partials_kernel", "ddim[epsilon] rollout noise=philox g4w1 even")]["bound (3.6.0)"].split()[0])
    assert bench.static_bound("rollout_tree", "ddim", "bf16", "3.6.0") == 100 * philox
    fwd = float(rows[("step_partials_kernel", "dpm_sde 2nd-order log_prob g4w1 even")]["bound (3.6.0)"].split()[0])
    bwd = [float(r["bound (3.6.0)"].split()[0]) for (k, label), r in rows.items()
           if k == "step_backward_kernel" and label.startswith("dpm_sde 2nd-order gaussian mean grads=")]
    assert bench.static_bound("recompute_fwd_bwd", "dpm_sde", "bf16", "3.6.0") == 100 * min([fwd, *bwd])


def test_a_benchmark_run_writes_where_git_does_not_look_unless_told(monkeypatch):
    """./run bench --quick leaves the checkout clean: its default folder is ignored; --out bench/results
    records a table on purpose."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import run as bench
    finally:
        sys.path.pop(0)
    assert os.path.relpath(bench.DEFAULT_OUT, REPO) == os.path.join("bench", "local")
    ignored = subprocess.run(["git", "check-ignore", "-q", os.path.join(bench.DEFAULT_OUT, "x-2026-12-04.csv")],
                             cwd=REPO)
    assert ignored.returncode == 0
    kept = subprocess.run(["git", "check-ignore", "-q", os.path.join(REPO, "bench", "results", "x.csv")], cwd=REPO)
    assert kept.returncode == 1
