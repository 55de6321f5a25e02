"""The tree is self-contained and current: the flat module paths of before the layers (docs/contributing.md,
"The layers") and the compile and roofline tool's place inside the kernels' package are gone, each
raising ModuleNotFoundError, and no file in the repository names one; no file cites a document outside
the repository (the contract is docs/contract.md)."""
import importlib
import importlib.util
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
THIS = pathlib.Path(__file__).resolve()  # names the old paths and the outside file to look for them

# each flat module path of before the layers -> the module's path now
MOVED = {
    "flowrl._validate": "flowrl.core._validate",
    "flowrl.step_spec": "flowrl.core.step_spec",
    "flowrl._dispatch": "flowrl.backends._dispatch",
    "flowrl.reference": "flowrl.backends.reference",
    "flowrl.reference_losses": "flowrl.backends.reference_losses",
    "flowrl._triton_ops": "flowrl.backends._triton_ops",
    "flowrl._triton_losses": "flowrl.backends._triton_losses",
    "flowrl.functional": "flowrl.ops.functional",
    "flowrl.weights": "flowrl.ops.weights",
    "flowrl.trajectory": "flowrl.data.trajectory",
    "flowrl.trajectory_shard": "flowrl.data.trajectory_shard",
    "flowrl.serialization": "flowrl.data.serialization",
    "flowrl.sglang": "flowrl.data.sglang",
    "flowrl.debug": "flowrl.data.debug",
    "flowrl.denoising_env": "flowrl.data.denoising_env",
    "flowrl.scheduler": "flowrl.rollout.scheduler",
    "flowrl.recorder": "flowrl.rollout.recorder",
    "flowrl.ddim": "flowrl.rollout.ddim",
    "flowrl.timestep_lookup": "flowrl.rollout.timestep_lookup",
    "flowrl.demo": "flowrl.apps.demo",
    "flowrl.example": "flowrl.apps.example",
    # the compile and roofline tool, out of the kernels' package (kernels/ imports no flowrl.backends)
    "flowrl.kernels.aot": "flowrl.tools.aot",
}

_NAMES = "|".join(sorted((re.escape(old.split(".", 1)[1]) for old in MOVED), key=len, reverse=True))
OLD_PATH = re.compile(
    rf"(?<![\w./])flowrl\.(?:{_NAMES})(?!\w)"  # flowrl.scheduler, flowrl.reference.philox_normal, ...
    rf"|(?<![\w./])flowrl/(?:{_NAMES})\.py\b"  # flowrl/scheduler.py
    rf"|\bfrom\s+flowrl\s+import\s+(?:[\w\s]*,\s*)*(?:{_NAMES})\b")  # from flowrl import _dispatch, ...
OUTSIDE = re.compile(r"\.\./shared|/shared/|SPEC\.md|\bSPEC\b")  # the first draft the contract replaced
SKIPPED_DIRS = {".git", ".venv", "__pycache__", "build", "dist", ".pytest_cache", ".benchmarks", ".hypothesis",
                ".whl", ".gl"}


def _repository_files():
    """The repository's files: git's tracked and not-ignored ones, else a walk that skips what .gitignore
    ignores."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        done = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                              capture_output=True, timeout=60)
        if done.returncode == 0:
            return sorted({ROOT / p for p in done.stdout.decode().split("\0") if p})
    found = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts) or parts[:2] == ("bench", "local"):
            continue
        found.append(path)
    return sorted(found)


def _text_files():
    for path in _repository_files():
        if not path.is_file() or path.resolve() == THIS:
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def _mentions(pattern):
    found = []
    for path, text in _text_files():
        for number, line in enumerate(text.splitlines(), 1):
            for m in pattern.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)}")
    return found


def test_the_scan_sees_the_tree():
    files = {p.relative_to(ROOT).as_posix() for p, _ in _text_files()}
    assert {"flowrl/__init__.py", "kernels/common.py", "docs/contract.md", "README.md", "flowrl/oracle/steps.py"} <= files
    assert not any(f.startswith((".venv/", ".git/")) for f in files)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_does_not_import(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert importlib.util.find_spec(MOVED[old]) is not None, MOVED[old]


def test_no_file_names_an_old_module_path():
    found = _mentions(OLD_PATH)
    assert not found, "old module paths (now: " + ", ".join(f"{o} -> {n}" for o, n in MOVED.items()) + "):\n" + \
        "\n".join(found)


def test_no_file_cites_a_document_outside_the_repository():
    found = _mentions(OUTSIDE)
    assert not found, "cite docs/contract.md (and its section) instead:\n" + "\n".join(found)


def test_the_patterns_find_what_they_look_for():
    for text in ("import flowrl.scheduler", "flowrl.reference.philox_normal", "(flowrl/recorder.py)",
                 "from flowrl import losses, _dispatch", "``flowrl._triton_losses``",
                 "python -m flowrl.kernels.aot --update-docs"):
        assert OLD_PATH.search(text), text
    for text in ("flowrl.rollout.scheduler", "flowrl.backends.reference_losses", "flowrl/rollout/recorder.py",
                 "from flowrl import losses", "flowrl.sde_step", "flowrl.references", "flowrl.DDIMScheduler",
                 "flowrl.kernels.step", "flowrl.tools.aot", "python -m flowrl.tools.aot --update-docs"):
        assert not OLD_PATH.search(text), text
    for text in ("(SPEC, Modes)", "../shared/SPEC.md"):
        assert OUTSIDE.search(text), text
    for text in ("StepSpec", "_SPEC_TENSORS", "the spec's tensors", "SPECIALIZATION"):
        assert not OUTSIDE.search(text), text
