"""The module paths of flowrl before its layers became subpackages, kept importable.

``import flowrl.scheduler``, ``from flowrl.trajectory import RolloutTrajectory``, ``flowrl.reference``
and the rest keep working: each old path is the module it moved to (the same module object, so a
``monkeypatch`` of either path patches both). The package's layers are in docs/contributing.md.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old path -> where the module lives now
MOVED = {
    "flowrl._validate": "flowrl.core._validate",
    "flowrl.step_spec": "flowrl.core.step_spec",
    "flowrl._dispatch": "flowrl.backends._dispatch",
    "flowrl.reference": "flowrl.backends.reference",
    "flowrl._triton_ops": "flowrl.backends._triton_ops",
    "flowrl.functional": "flowrl.ops.functional",
    "flowrl.weights": "flowrl.ops.weights",
    "flowrl.trajectory": "flowrl.data.trajectory",
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
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and hands back the moved module itself."""

    def __init__(self):
        self._specs = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        # the import system set __spec__ to the old path's; the module keeps its own
        module.__spec__ = self._specs.pop(module.__name__, module.__spec__)


def install() -> None:
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
