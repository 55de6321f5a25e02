"""tests/aot_runs.py under pytest-xdist: the controller runs the AOT compile once for the session and the
workers read its results (without that, each worker would compile every kernel itself). Each role is a
subprocess that imports aot_runs alone, with the compile replaced by a stand-in that logs its calls."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

STAND_IN = f"""
import json, os, sys
sys.path.insert(0, {str(TESTS)!r})
import aot_runs

def run(pythonpath, archs, spot):
    print("compile", pythonpath, flush=True)
    return 0, "progress\\n" + json.dumps([dict(triton=str(pythonpath), archs=list(archs))]), ""

aot_runs._run = run
aot_runs._runs = lambda: [(None, ("90",), ()), ("/triton-3.6", ("90",), ())]
"""

WORKER = STAND_IN + """
aot_runs.start()  # at collection: only asks the controller
assert aot_runs._thread is None
print(json.dumps([aot_runs.rows(None), aot_runs.rows("/triton-3.6")]), flush=True)
"""

CONTROLLER = STAND_IN + """
assert aot_runs.wanted()
aot_runs.start()
aot_runs.start()  # a second worker's collection: still one run each
aot_runs._thread.join()
"""


def _python(code, env):
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_the_workers_read_the_controllers_one_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["FLOWRL_AOT_SHARED"] = str(tmp_path)
    workers = [_python(WORKER, dict(env, PYTEST_XDIST_WORKER=f"gw{i}")) for i in range(2)]
    deadline = time.monotonic() + 60
    while not (tmp_path / "wanted").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    controller = _python(CONTROLLER, env)
    out, err = controller.communicate(timeout=60)
    assert controller.returncode == 0, err
    assert out.splitlines() == ["compile None", "compile /triton-3.6"]  # once each, in the controller
    for worker in workers:
        out, err = worker.communicate(timeout=60)
        assert worker.returncode == 0, err
        installed, triton36 = json.loads(out.splitlines()[-1])
        assert installed == [0, [dict(triton="None", archs=["90"])]]
        assert triton36 == [0, [dict(triton="/triton-3.6", archs=["90"])]]
        assert "compile" not in out  # no worker compiled


def test_share_makes_a_folder_the_workers_inherit_and_removes_it_at_exit():
    code = STAND_IN + """
aot_runs.share()
folder = os.environ["FLOWRL_AOT_SHARED"]
aot_runs.share()  # once
assert os.environ["FLOWRL_AOT_SHARED"] == folder and os.path.isdir(folder) and not aot_runs.wanted()
print(folder)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("FLOWRL_AOT_SHARED", "PYTEST_XDIST_WORKER")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not Path(done.stdout.strip()).exists()
