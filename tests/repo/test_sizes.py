"""The code a maintainer meets (docs/contributing.md, "The layers"): no module over 600 lines, no internal
function over 12 parameters (a public op or loss keeps its keyword-only options, a compat adapter its
peer's signature, a @triton.jit kernel its own), every Triton kernel launched by keyword, and kernels/
importing nothing above flowrl.contract (the compile and roofline tool is flowrl.tools.aot)."""
import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "flowrl").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"), *(ROOT / "bench").glob("*.py")])
MAX_LINES = 600
MAX_PARAMETERS = 12


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kernels":
        parts = ["flowrl", "kernels", *parts[1:]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _jit(node):
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def _parameters(node):
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [p.arg for p in (a.vararg, a.kwarg) if p]
    return [n for n in names if n not in ("self", "cls", "ctx")]


def _public(path, qualname):
    """Whether ``qualname`` (a function, or Class.__init__; in flowrl.compat any public method) is public
    API: its module's __all__ names it (or its class), and no part of the module path is private."""
    module = _module_name(path)
    if any(part.startswith("_") for part in module.split(".")):
        return False
    exported = getattr(importlib.import_module(module), "__all__", ())
    owner, _, method = qualname.partition(".")
    if owner not in exported:
        return False
    if module.startswith("flowrl.compat.") and "." not in method and not method.startswith("_"):
        return True  # an adapter's method: the peer's signature (verl-omni's sample_previous_step, step)
    return qualname == owner or method == "__init__"


def _functions(tree):
    """(qualified name, node) of every def, classes' methods as Class.method."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child))
                visit(child, prefix + child.name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
    visit(tree, "")
    return out


def test_the_scan_sees_the_tree():
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {"flowrl/losses/__init__.py", "kernels/step.py", "flowrl/tools/aot/__main__.py", "bench/run.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_module_is_over_600_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)}: {lines} lines; split it by topic (docs/contributing.md)"


def test_no_internal_function_takes_more_than_12_parameters():
    wide = []
    for path in SOURCES:
        for qualname, node in _functions(ast.parse(path.read_text())):
            n = len(_parameters(node))
            if n > MAX_PARAMETERS and not _jit(node) and not _public(path, qualname):
                wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {qualname} ({n})")
    assert not wide, "group related arguments in a frozen spec or pass one by name:\n" + "\n".join(wide)


def test_the_check_finds_a_wide_internal_function(tmp_path):
    tree = ast.parse("def _f(" + ", ".join(f"a{i}" for i in range(13)) + "): pass\n")
    (name, node), = _functions(tree)
    assert len(_parameters(node)) == 13 and not _jit(node)
    assert not _public(ROOT / "flowrl" / "losses" / "_grpo.py", name)
    assert _public(ROOT / "flowrl" / "losses" / "__init__.py", "grpo_loss")


def _launches(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "_launch":
            yield node


def test_every_kernel_is_launched_by_keyword():
    """A launch passes the kernel and its grid, then every kernel argument by name."""
    found, positional = 0, []
    for path in (ROOT / "flowrl" / "backends").glob("*.py"):
        for call in _launches(ast.parse(path.read_text())):
            found += 1
            if len(call.args) > 2 or any(isinstance(a, ast.Starred) for a in call.args):
                positional.append(f"{path.name}:{call.lineno}")
    assert found >= 8, found  # step partials / finalize / backward, token table, grpo, flow forward / backward
    assert not positional, positional


def test_the_kernels_import_nothing_above_the_contract():
    """kernels/ reads flowrl.contract and itself; the backends import the kernels, never the reverse."""
    above = []
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("flowrl"):
                if node.module not in ("flowrl", "flowrl.contract") and not node.module.startswith("flowrl.kernels"):
                    above.append(f"{path.name}: from {node.module}")
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "flowrl":
                above += [f"{path.name}: from flowrl import {a.name}" for a in node.names if a.name != "contract"]
            elif isinstance(node, ast.Import):
                above += [f"{path.name}: import {a.name}" for a in node.names
                          if a.name.startswith("flowrl") and a.name != "flowrl.contract"]
    assert not above, above


def test_every_launch_configuration_is_chosen_in_launch_py():
    """docs/kernels.md, "Launch": the launch tables, the fixed configurations and the functions choosing
    among them are defined in flowrl/backends/_launch.py only (the launchers import them)."""
    elsewhere = []
    for path in (ROOT / "flowrl" / "backends").glob("*.py"):
        if path.name == "_launch.py":
            continue
        for node in ast.parse(path.read_text()).body:
            names = ([t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign)
                     else [node.name] if isinstance(node, ast.FunctionDef) else [])
            elsewhere += [f"{path.name}: {n}" for n in names
                          if (n.endswith(("_CONFIG", "LAUNCH_TABLE")) or n.endswith("_config")
                              or n in ("tiles_taken", "step_switches", "register_cap", "finalize_warps"))]
    assert not elsewhere, elsewhere
    from flowrl.backends import _launch, _triton_losses, _triton_ops
    assert _triton_ops.step_config is _launch.step_config and _triton_ops.element_config is _launch.element_config
    assert _triton_losses.REPLAY_BACKWARD_CONFIG is _launch.REPLAY_BACKWARD_CONFIG
