"""./run, the README's set-up command, with a stand-in interpreter that logs what it is asked to do: what
each command installs, that the first run says what it is doing, and --help."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_venv(tmp_path):
    """A .venv whose python is a logging stand-in (every call succeeds)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexit 0\n')
    python.chmod(0o755)
    return venv, log


def run(venv, *args):
    env = {**os.environ, "FLOWRL_VENV": str(venv)}
    return subprocess.run(["bash", str(ROOT / "run"), *args], env=env, capture_output=True, text=True, cwd=ROOT)


def test_help_says_what_each_command_does():
    out = run("unused", "--help")
    assert out.returncode == 0
    for command in ("demo", "example", "test", "quick", "bench"):
        assert f"\n  {command} " in out.stdout
    bad = run("unused", "bogus")
    assert bad.returncode == 2 and "usage: ./run COMMAND" in bad.stderr


def test_the_first_run_says_what_it_installs_and_the_demo_skips_the_test_only_packages(fake_venv):
    venv, log = fake_venv
    out = run(venv, "demo", "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert "run: installing flowrl and its test extra" in out.stderr and "run: set-up done" in out.stderr
    calls = log.read_text()
    assert "-e .[test]" in calls and "-m flowrl demo --steps 2" in calls
    assert "triton==3.6.0" not in calls and "sglang==0.5.23" not in calls  # only the tests use them
    # the second run installs nothing
    log.write_text("")
    out = run(venv, "demo")
    assert out.stderr == "" and log.read_text().strip() == "-m flowrl demo"


def test_the_tests_get_triton_36_and_sglang_and_sglang_once(fake_venv):
    venv, log = fake_venv
    out = run(venv, "test", "-q")
    assert out.returncode == 0, out.stderr
    calls = log.read_text()
    assert "triton==3.6.0" in calls and "sglang==0.5.23" in calls and calls.strip().endswith("-m pytest -q")
    assert "installing triton 3.6.0" in out.stderr and "installing sglang 0.5.23" in out.stderr
    log.write_text("")
    run(venv, "test", "-q")
    assert "sglang==0.5.23" not in log.read_text()  # the stamp: a second ./run test does not reinstall


def test_the_quick_loop_spreads_the_tests_not_marked_slow_over_the_cores(fake_venv):
    venv, log = fake_venv
    out = run(venv, "quick", "tests/losses")
    assert out.returncode == 0, out.stderr
    calls = log.read_text()
    assert calls.strip().endswith("-m pytest -n auto -m not slow tests/losses")
    assert "sglang==0.5.23" in calls and "triton==3.6.0" not in calls  # the compile tests are slow ones


def test_xdist_is_a_test_dependency_and_the_readme_names_the_quick_loop():
    """``-n auto`` needs pytest-xdist from the test extra; README's Tests section gives the command."""
    assert "pytest-xdist" in (ROOT / "setup.cfg").read_text()
    assert "`./run quick`" in (ROOT / "README.md").read_text()
