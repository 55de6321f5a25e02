"""Smoke test of ``python -m flowrl demo`` (README, "Quick start"), run as a user runs it: in a
subprocess, on the CPU, with the smallest arguments that give a whole report (about 2 s a run)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from mode_coverage import every_mode_but

pytestmark = pytest.mark.slow  # each case runs the demo in a subprocess (./run test -m 'not slow' skips it)

STEPS, BATCH = 2, 2
SMALL = ["--steps", str(STEPS), "--batch", str(BATCH), "--dim", "1", "--device", "cpu"]

MODES_ELSEWHERE = {}  # every mode runs the demo (a new Mode joins MODES)
MODES = every_mode_but(MODES_ELSEWHERE)
EXTRA_FLAGS = {"cps": ["--log-prob-kind", "sq_err"]}  # one mode also runs a log-prob kind that is not the default

RATIOS = re.compile(r"importance ratios exp\(logp_new - logp_old\): min (\S+), max (\S+)$", re.M)
IDENTICAL = re.compile(
    r"recomputed log-probs bit-identical to the rollout's: (\S+) \((\d+) values, max \|ratio - 1\| = (\S+)\)$", re.M
)


def demo(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FLOWRL_BACKEND", "TRITON_INTERPRET")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "flowrl", "demo", *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "flags", [["--mode", m, *EXTRA_FLAGS.get(m, [])] for m in MODES],
    ids=["-".join([m, *EXTRA_FLAGS.get(m, [])[1:]]) for m in MODES],
)
def test_demo_ratios_are_exactly_one(flags):
    res = demo(*SMALL, *flags)
    report = res.stdout + res.stderr
    assert res.returncode == 0, report
    assert "Traceback" not in res.stderr, report

    m = RATIOS.search(res.stdout)
    assert m, report
    assert (float(m.group(1)), float(m.group(2))) == (1.0, 1.0), m.group(0)

    m = IDENTICAL.search(res.stdout)
    assert m, report
    verdict, count, worst = m.group(1), int(m.group(2)), float(m.group(3))
    assert count == BATCH * STEPS, m.group(0)  # one log-prob per sample and step
    assert worst == 0.0, m.group(0)
    assert verdict == "yes", m.group(0)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--mode", "heun"], "argument --mode: invalid choice: 'heun'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--steps", "0"], "--steps, --batch and --dim must be positive"),
        (["--noise-level", "1.5", "--mode", "cps"], "flowrl demo: error: noise_level must be in [0, 1] for mode='cps'"),
    ],
    ids=["mode", "unknown-flag", "steps-0", "cps-noise-level"],
)
def test_demo_rejects_a_bad_flag(args, message):
    res = demo(*SMALL, *args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr, res.stderr
    assert res.stdout == "", res.stdout  # rejected before any of the report is printed
    assert "Traceback" not in res.stderr, res.stderr


def test_unknown_command_prints_usage():
    res = subprocess.run([sys.executable, "-m", "flowrl", "dmeo"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "usage: python -m flowrl {demo,info}" in res.stderr, res.stderr


@pytest.mark.parametrize("small", [["--steps", "1"], ["--batch", "1"]], ids=["steps-1", "batch-1"])
def test_demo_smallest_accepted_flags_give_a_clean_report(small):
    """The smallest values the flag check accepts: a 1-step schedule (the timing section steps inside
    it) and one sample (no standard error to print, no nan)."""
    res = demo(*SMALL, *small)
    m = RATIOS.search(res.stdout)
    assert m and (float(m.group(1)), float(m.group(2))) == (1.0, 1.0), res.stdout + res.stderr
    assert res.returncode == 0, res.stdout + res.stderr
    assert not re.search(r"\bnan\b", res.stdout), res.stdout
    assert "Warning" not in res.stderr, res.stderr
