"""The full AOT runs that tests/kernels/test_compile.py, tests/kernels/test_roofline.py and tests/losses/test_losses_dpo.py
check: every kernel specialization compiled for real GPU targets (flowrl/tools/aot, ``--sass-hot``),
with the installed triton for sm_90a (and for sm_80 a spot check, the hot bf16 specializations),
and with triton 3.6.0 (the GPU machines' image, an H200) for sm_90a.

The compile is most of CI's time and keeps every core busy while the rest of the suite runs one
thread, so conftest.py starts these runs in a background thread as soon as the session's tests are
chosen, and runs the tests that read them (marked ``aot``) last; ``rows`` waits for a run to finish.
Each run is a subprocess without TRITON_INTERPRET (under it @triton.jit makes interpreted functions),
in a fresh TRITON_CACHE_DIR (a cached build can hide a compile error), removed afterwards. Triton
3.6.0 is installed by ``./run``'s set-up into ``.venv/triton-3.6`` (``pip install --no-deps
--target``) and put first on PYTHONPATH; ``FLOWRL_TRITON36`` names another folder.

CI's 30-minute line on two cores: triton 3.6.0 for sm_80 (a quarter of the compile time) and the
installed triton's sm_80 beyond the spot check (538 of its 701 specializations) are compiled on
demand: ``python -m flowrl.tools.aot --update-docs docs/kernels.md`` (every specialization, both
archs, both versions) or ``[PYTHONPATH=.venv/triton-3.6] python -m flowrl.tools.aot --arch 80``. The compile
runs niced, so that the suite's one thread keeps a core.

Under pytest-xdist (``-n``) the controller, the one process that lives the whole session, runs the
compile once (``share``: conftest.py, before the workers start): a worker that collected ``aot``
tests leaves a file saying so in the shared folder (``FLOWRL_AOT_SHARED``), the controller starts the
runs when a worker's collection is in, and writes each run's result there; a worker's ``rows`` waits
for that file. Without it each worker would compile everything itself.
"""
import atexit
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRITON36 = Path(os.environ.get("FLOWRL_TRITON36", ROOT / ".venv" / "triton-3.6"))
ARCHS_NEWEST = ("90", "80")
SPOT_NEWEST = ("80",)  # sm_80: a spot check, the hot bf16 specializations (flowrl/tools/aot --spot-arch)
ARCHS_36 = ("90",)
# triton's CUDA backend wheels (ptxas, nvdisasm) are Linux x86_64
CAN_COMPILE = sys.platform == "linux" and platform.machine() == "x86_64"
TIMEOUT_S = 2400

SHARED = "FLOWRL_AOT_SHARED"  # under pytest-xdist: the folder of the controller's results (share())

_lock = threading.Lock()
_done = {}  # str(pythonpath) -> threading.Event
_results = {}  # str(pythonpath) -> (exit status or None, stdout, stderr)
_running = []  # (Popen, folder) of the runs (each its own process group: the compile workers with it)
_stopping = threading.Event()
_thread = None


def compile_env(tmp, pythonpath=None):
    """The environment of a compile subprocess: no TRITON_INTERPRET, a fresh cache and temporary folder
    under ``tmp``, and ``pythonpath`` (another triton) first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton-cache")
    env["TMPDIR"] = str(tmp)  # the aot CLI's own cache folder too: removed with ``tmp`` even if it is killed
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _runs():
    """(pythonpath, archs, spot-checked archs) of each run: the installed triton, then triton 3.6.0
    where it is installed."""
    runs = [(None, ARCHS_NEWEST, SPOT_NEWEST)]
    if (TRITON36 / "triton").is_dir():
        runs.append((TRITON36, ARCHS_36, ()))
    return runs


def _run(pythonpath, archs, spot):
    tmp = tempfile.mkdtemp(prefix="flowrl-aot-test-")
    try:
        with _lock:
            if _stopping.is_set():
                return None, "", "the session ended before this run started"
            niced = ["nice", "-n", "10"] if shutil.which("nice") else []  # the suite's one thread keeps its core
            proc = subprocess.Popen([*niced, sys.executable, "-m", "flowrl.tools.aot", "--json", "--sass-hot",
                                     "--arch", *archs, *(["--spot-arch", *spot] if spot else []),
                                     "--jobs", str(os.cpu_count() or 1)], cwd=tmp,
                                    env=compile_env(tmp, pythonpath), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
            _running.append((proc, tmp))
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, err = proc.communicate()
            err += f"\n(killed after {TIMEOUT_S} s)"
        return proc.returncode, out, err
    except Exception as exc:  # reported by rows()
        return None, "", f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kill(proc):
    """The run and its compile workers (its process group)."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def _stop():
    """At exit (a session that ends early, -x): no new run starts and the ones running are stopped."""
    with _lock:
        _stopping.set()
        for proc, tmp in _running:
            if proc.poll() is None:
                _kill(proc)
                proc.wait()
                shutil.rmtree(tmp, ignore_errors=True)  # the compile's own cache sits under it too


def _shared():
    """The folder the controller's runs write to, in a pytest-xdist session (None outside one)."""
    folder = os.environ.get(SHARED)
    return Path(folder) if folder else None


def _is_worker():
    return _shared() is not None and "PYTEST_XDIST_WORKER" in os.environ


def _result_file(pythonpath):
    return _shared() / ("installed.json" if pythonpath is None else "triton36.json")


def share():
    """In the pytest-xdist controller, before its workers start (they inherit the environment): the
    folder where workers ask for the runs and the controller leaves their results."""
    if _shared() is None:
        folder = tempfile.mkdtemp(prefix="flowrl-aot-shared-")
        os.environ[SHARED] = folder
        atexit.register(shutil.rmtree, folder, True)


def wanted():
    """Whether a worker of this pytest-xdist session has collected tests that read the runs."""
    return _shared() is not None and (_shared() / "wanted").exists()


def start():
    """Start the runs one after the other in a background thread (once per session). In a pytest-xdist
    worker: only ask the controller to (``wanted``)."""
    global _thread
    if _is_worker():
        (_shared() / "wanted").touch()
        return
    with _lock:
        if _thread is not None:
            return
        runs = _runs()
        for pythonpath, _, _ in runs:
            _done[str(pythonpath)] = threading.Event()

        def work():
            for pythonpath, archs, spot in runs:
                _results[str(pythonpath)] = _run(pythonpath, archs, spot)
                if _shared() is not None:  # for the workers: written whole, then renamed into place
                    part = _result_file(pythonpath).with_suffix(".part")
                    rc, out, err = _results[str(pythonpath)]
                    part.write_text(json.dumps(dict(rc=rc, out=out, err=err)))
                    part.replace(_result_file(pythonpath))
                _done[str(pythonpath)].set()

        atexit.register(_stop)
        _thread = threading.Thread(target=work, name="flowrl-aot-runs", daemon=True)
        _thread.start()


def rows(pythonpath=None):
    """(exit status, rows) of the run with the installed triton (``pythonpath`` None) or with triton
    3.6.0 (``TRITON36``), waiting for it to finish."""
    start()
    key = str(pythonpath)
    if key not in {str(p) for p, _, _ in _runs()}:
        raise FileNotFoundError(f"no AOT run for {pythonpath}: triton 3.6.0 is not installed there")
    if _is_worker():  # the controller runs them (share())
        rc, out, err = _wait_for_controller(pythonpath)
    else:
        _done[key].wait()
        rc, out, err = _results[key]
    assert out.strip(), err[-3000:]
    return rc, json.loads(out.strip().splitlines()[-1])


def _wait_for_controller(pythonpath):
    """(exit status, stdout, stderr) of a run the pytest-xdist controller runs, once its file is there."""
    path = _result_file(pythonpath)
    deadline = time.monotonic() + TIMEOUT_S * len(_runs()) + 600  # its run may come after the other
    while not path.exists():
        if time.monotonic() > deadline:
            return None, "", f"the controller's AOT run left no {path.name} in {path.parent}"
        time.sleep(1)
    result = json.loads(path.read_text())
    return result["rc"], result["out"], result["err"]
