"""flowrl.rollout.scheduler mirrors diffusers' FlowMatchEulerDiscreteScheduler (copied from
diffusers/schedulers/scheduling_flow_match_euler_discrete.py, diffusers 0.42.1): when the installed
diffusers changes one of the methods the copy mirrors, this fails, naming the methods to re-read
and re-copy (then update MIRRORED and setup.cfg's tested upper bound).

Each method's source is compared as its syntax tree without its docstring (comments, blank lines and
formatting do not count), hashed."""
from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap

import pytest

diffusers = pytest.importorskip("diffusers")

COPIED_FROM = ("diffusers/schedulers/scheduling_flow_match_euler_discrete.py", "0.42.1")

# method -> hash of diffusers 0.42.1's source (every method that flowrl's class overrides)
MIRRORED = {
    "__init__": "e2195ee6812e25dc",
    "shift": "13e0bf92319477fb",
    "step_index": "36a814ed16ad1c7c",
    "begin_index": "64cb0a137ae382b4",
    "set_begin_index": "7a87333bfa54c769",
    "set_shift": "d53aa9be5e67b91b",
    "scale_noise": "e578ed9956f497ba",
    "_sigma_to_t": "a1aaaa654924a274",
    "time_shift": "8e30d6d0c2a16c08",
    "_time_shift_exponential": "b968dbad5a79d054",
    "_time_shift_linear": "0c7b2acaa9217e7a",
    "stretch_shift_to_terminal": "f8ec6d6ea0026027",
    "set_timesteps": "6643c918e5c936a9",
    "_convert_to_karras": "27b6ae082dbc9ad0",
    "_convert_to_exponential": "917aa5733b550e03",
    "_convert_to_beta": "28404b823a38ab57",
    "index_for_timestep": "1e22e488943eb86f",
    "_init_step_index": "82231b626a31f569",
    "step": "3de3332178d7bb69",
    "__len__": "b1f679a7ccbf1544",
}


def source_hash(obj) -> str:
    if isinstance(obj, property):
        obj = obj.fget
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()[:16]


def test_the_copy_names_its_source():
    import flowrl.rollout.scheduler as copy

    path, version = COPIED_FROM
    assert path in copy.__doc__ and f"diffusers {version}" in copy.__doc__


def test_installed_diffusers_still_has_what_the_copy_mirrors():
    theirs = diffusers.FlowMatchEulerDiscreteScheduler
    changed = sorted(name for name, digest in MIRRORED.items()
                     if name not in vars(theirs) or source_hash(vars(theirs)[name]) != digest)
    assert not changed, (
        f"diffusers {diffusers.__version__} changed FlowMatchEulerDiscreteScheduler.{', '.join(changed)} since "
        f"{COPIED_FROM[1]}, which flowrl.rollout.scheduler copies: re-read them against the copy")


def test_the_copy_overrides_every_method_diffusers_defines():
    from flowrl.rollout.scheduler import FlowMatchEulerDiscreteScheduler

    theirs = diffusers.FlowMatchEulerDiscreteScheduler
    defined = {name for name, value in vars(theirs).items()
               if callable(value) or isinstance(value, (property, classmethod, staticmethod))}
    defined -= {"__doc__", "__module__"}
    assert defined <= set(MIRRORED), f"diffusers defines {sorted(defined - set(MIRRORED))}, which the copy does not mirror"
    assert set(MIRRORED) <= set(vars(FlowMatchEulerDiscreteScheduler))
