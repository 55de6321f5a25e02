"""The wheel a user installs holds the whole package (a hand-written package list once left
flowrl.losses out of it, and every other test runs against the editable install, which hid that).

Built from a copy of the checkout's package files with ``pip wheel --no-deps``, installed with
``pip install --no-deps --target`` into an empty folder, then used from a subprocess that sees that
folder and the interpreter's site-packages but neither the checkout nor the editable install's finder
(``python -S``: no site module, so no ``.pth`` hook; the site-packages folders come in by PYTHONPATH).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds and installs the wheel (./run test -m 'not slow' skips it)

ROOT = Path(__file__).resolve().parents[2]
# what a source distribution of the checkout holds for the build (the tests, docs and bench stay out)
BUILD_FILES = ("flowrl", "kernels", "setup.py", "setup.cfg", "pyproject.toml", "README.md", "LICENSE")

pytest.importorskip("setuptools")


def _site_folders():
    """The interpreter's site-packages folders (torch, numpy, safetensors, triton), not the checkout."""
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_FILES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    wheels = tmp_path_factory.mktemp("wheels")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)], check=True,
                   cwd=src)
    (wheel,) = wheels.glob("*.whl")
    target = tmp_path_factory.mktemp("target")
    subprocess.run(pip + ["install", "--no-deps", "--target", str(target), str(wheel)], check=True)
    return wheel, target


def _checkout_modules():
    """Every module the checkout's package has, by its installed name (kernels/ is flowrl.kernels)."""
    names = []
    for folder, prefix in ((ROOT / "flowrl", "flowrl"), (ROOT / "kernels", "flowrl.kernels")):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join([prefix] + parts))
    return names


def test_wheel_holds_every_module_of_the_checkout(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        files = {name for name in archive.namelist() if name.endswith(".py")}
    for module in _checkout_modules():
        stem = module.replace(".", "/")
        assert stem + ".py" in files or stem + "/__init__.py" in files, f"{module} is not in {wheel.name}"


SCRIPT = textwrap.dedent("""
    import importlib, json, sys
    import torch
    target, modules = sys.argv[1], json.loads(sys.argv[2])
    for name in modules:
        module = importlib.import_module(name)
        assert module.__file__.startswith(target), (name, module.__file__)
    import flowrl
    from flowrl.losses import grpo_loss
    sigmas = torch.linspace(1.0, 0.0, 5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, generator=g)
    v = torch.randn(2, 4, 8, generator=g)
    out = flowrl.sde_step(x, v, sigmas, 1, mode="sde", noise_level=0.7, generator=g, backend="torch")
    again = flowrl.step_log_prob(x, v, out.prev_sample, sigmas, 1, mode="sde", noise_level=0.7, backend="torch")
    assert torch.equal(out.log_prob, again), (out.log_prob, again)
    v.requires_grad_()
    loss = grpo_loss(x, v, out.prev_sample, sigmas, 1, old_log_prob=out.log_prob, advantages=torch.tensor([1.0, -1.0]),
                     clip_range=1e-4,
                     mode="sde", noise_level=0.7, backend="torch")
    assert loss.ratio.eq(1).all(), loss.ratio
    loss.loss.backward()
    assert torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0
    print(json.dumps({"flowrl": flowrl.__file__, "loss": float(loss.loss)}))
""")


def test_the_wheels_metadata_has_the_license_and_no_link_that_breaks_on_a_package_index(installed):
    """The long description is README.md with each relative link made plain text (a package index has no
    docs/ folder); the Apache-2.0 text ships in the wheel."""
    import email

    wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = email.message_from_string(archive.read(next(n for n in names if n.endswith("METADATA"))).decode())
        (license_file,) = [n for n in names if n.endswith("LICENSE")]
        assert "Apache License" in archive.read(license_file).decode()
    body = meta.get_payload()
    assert meta["License"] == "Apache-2.0" and body.startswith("# flowrl")
    relative = re.findall(r"\]\((?![a-z]+://|#)[^)]*\)", body)
    assert relative == [] and "(`docs/guide.md#api` in the source tree)" in body


def test_installed_wheel_imports_every_module_and_runs_without_the_checkout(installed, tmp_path):
    _, target = installed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TRITON_INTERPRET"))}
    env["PYTHONPATH"] = os.pathsep.join([str(target)] + _site_folders())
    proc = subprocess.run([sys.executable, "-S", "-c", SCRIPT, str(target), json.dumps(_checkout_modules())],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["flowrl"].startswith(str(target))


def test_the_checkouts_kernels_folder_does_not_shadow_the_kernels_distribution(tmp_path):
    """Run from the checkout's root (its folder first on sys.path, as ``python -c`` and ``python -m``
    put it), ``import kernels`` reaches the ``kernels`` distribution (Hugging Face's, which transformers
    >= 5.25 imports on ``import diffusers`` pipelines), here a stand-in, not flowrl's kernels/; and
    flowrl.kernels still loads beside it."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'stand-in'\n")
    (site / "kernels" / "layer.py").write_text("from kernels import CUDAProperties\n")
    code = ("import kernels.layer, flowrl.kernels.step; "
            "print(kernels.layer.CUDAProperties, flowrl.kernels.__name__, flowrl.kernels.step.__name__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["stand-in", "flowrl.kernels", "flowrl.kernels.step"], done.stdout
