"""docs/contributing.md's recipes, held to the tree: every file a recipe names exists, each recipe names
every file a new mode or loss changes and the tests that check them, every ``Mode`` is run by each test
module's list of modes or named there as covered elsewhere (tests/mode_coverage.py), no test module
lists modes by hand, and the docs that list the modes or the losses name every one."""
import ast
import importlib
import pathlib
import re

import pytest

from flowrl import losses
from flowrl.contract import Mode

import mode_coverage

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONTRIBUTING = (ROOT / "docs" / "contributing.md").read_text()
# a file path as the recipes write it, in backticks: no placeholder (tests/test_<name>.py)
PATH = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.(?:py|md|cfg|sh))`")
UPDATE_DOCS = "python -m flowrl.tools.aot --update-docs docs/kernels.md"


def _section(text, heading):
    """The text under ``heading`` (a markdown heading line) up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1:]
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[:end.start()] if end else rest


def _test_file(stem):
    """tests/<layer>/<stem>.py, the test module of that name wherever the tree keeps it."""
    (path,) = (ROOT / "tests").rglob(f"{stem}.py")
    return str(path.relative_to(ROOT))


MODE_RECIPE = _section(CONTRIBUTING, "## Adding a mode")
LOSS_RECIPE = _section(CONTRIBUTING, "## Adding a loss")
REGENERATE = _section(CONTRIBUTING, "## Regenerating docs/kernels.md's tables")

# What a new first-order mode changes beyond its code (the finding: README.md's count and
# docs/kernels.md's tables were missing), and the tests that hold each; the suites of mode_coverage run it.
MODE_FILES = {
    "flowrl/contract.py", "flowrl/backends/reference.py", "kernels/common.py",  # the code
    "flowrl/oracle/steps.py", "tests/ops/test_contract.py", "tests/ops/test_properties.py",  # the float64 formulas and their tests
    "docs/contract.md", "docs/guide.md", "docs/losses.md", "README.md", "docs/kernels.md",  # the docs
    "tests/repo/test_readme.py", "tests/kernels/test_compile.py", "tests/kernels/test_roofline.py", "tests/repo/test_recipes.py",  # their checks
    "tests/mode_coverage.py", *(_test_file(suite) for suite in mode_coverage.SUITES),
}
LOSS_FILES = {
    "flowrl/losses/__init__.py", "flowrl/losses/_custom_ops.py", "flowrl/losses/distributed.py",
    "flowrl/distributed.py", "flowrl/contract.py", "flowrl/backends/reference_losses.py", "kernels/loss.py",
    "flowrl/tools/aot/loss_specs.py", "flowrl/tools/aot/roofline.py",  # its specializations, bytes and target
    "docs/compile.md", "docs/losses.md", "docs/contract.md", "README.md", "docs/kernels.md",
    "tests/ops/test_argument_order.py", "tests/losses/test_losses_distributed.py", "tests/ops/test_torch_compile.py",
    "tests/ops/test_empty_batch.py", "tests/repo/test_readme.py", "tests/kernels/test_compile.py", "tests/kernels/test_roofline.py",
    "flowrl/oracle/losses.py", "tests/ops/test_contract.py",  # its float64 formula and the test that holds it
    "bench/cases.py", "bench/roofline.py", "bench/loss_suite.py",  # its benchmark row (bench/run.py --suite losses)
}


@pytest.mark.parametrize("recipe", ["## Adding a mode", "## Adding a loss", "## Regenerating docs/kernels.md's tables"])
def test_every_file_a_recipe_names_exists(recipe):
    named = set(PATH.findall(_section(CONTRIBUTING, recipe)))
    assert named, recipe
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/contributing.md, {recipe!r}, names files that do not exist: {missing}"


def test_the_mode_recipe_names_every_file_a_mode_changes():
    named = set(PATH.findall(MODE_RECIPE))
    assert MODE_FILES <= named, f"the mode recipe does not name {sorted(MODE_FILES - named)}"
    assert "NOT_YET_MET" in MODE_RECIPE and "MODES_ELSEWHERE" in MODE_RECIPE


def test_the_loss_recipe_names_every_file_a_loss_changes():
    named = set(PATH.findall(LOSS_RECIPE))
    assert LOSS_FILES <= named, f"the loss recipe does not name {sorted(LOSS_FILES - named)}"


def test_the_recipes_regenerate_the_tables_with_the_tools_own_command():
    from flowrl.tools import aot

    assert UPDATE_DOCS in aot.__doc__  # the command flowrl/tools/aot documents
    assert UPDATE_DOCS in REGENERATE
    for marker in (aot.TABLE_START, aot.TABLE_END, aot.ROOFLINE_START, aot.ROOFLINE_END):
        assert marker in REGENERATE and marker in (ROOT / "docs" / "kernels.md").read_text(), marker
    assert "hot_specializations" in REGENERATE and "./run test -m aot" in REGENERATE


@pytest.mark.parametrize("suite", mode_coverage.SUITES)
def test_every_mode_is_tested_or_named_elsewhere_with_a_reason(suite):
    """Each suite runs every Mode but those its MODES_ELSEWHERE names; a name there carries why, and the
    test file that covers it instead (one that exists and names the mode)."""
    module = importlib.import_module(suite)
    modes, elsewhere = list(module.MODES), dict(module.MODES_ELSEWHERE)
    labels = list(Mode.labels())
    assert not set(modes) & set(elsewhere), (suite, sorted(set(modes) & set(elsewhere)))
    assert set(modes) | set(elsewhere) == set(labels), (suite, sorted(set(labels) - set(modes) - set(elsewhere)))
    assert modes == [m for m in labels if m in modes], f"{suite}.MODES is not in Mode order"
    for mode, why in elsewhere.items():
        files = re.findall(r"tests/(?:\w+/)?\w+\.py", why)
        assert files, f"{suite}.MODES_ELSEWHERE[{mode!r}] names no test file: {why!r}"
        assert all((ROOT / f).is_file() for f in files), (suite, mode, files)
        covering = [f for f in files if re.search(rf"\b{mode}\b", (ROOT / f).read_text())]
        assert covering, f"{suite}.MODES_ELSEWHERE[{mode!r}]: none of {files} names {mode!r}"
    for table in ("ETA", "ETA_MAX"):  # a noise level for every mode the suite runs
        if hasattr(module, table):
            assert set(getattr(module, table)) == set(modes), (suite, table)


def test_mode_coverage_lists_every_module_that_runs_over_modes():
    """A test module that builds MODES from mode_coverage is one of SUITES (so it is checked above)."""
    users = {p.stem for p in (ROOT / "tests").rglob("test_*.py")
             if re.search(r"^MODES = ", p.read_text(), flags=re.M) and "every_mode_but" in p.read_text()}
    assert users == set(mode_coverage.SUITES), sorted(users ^ set(mode_coverage.SUITES))


def _mode_list(node):
    """A literal tuple / list / set of three or more mode labels, or a dict keyed by them."""
    labels = set(Mode.labels())
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = node.elts
    elif isinstance(node, ast.Dict):
        items = node.keys
    else:
        return False
    names = [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return len(names) == len(items) >= 3 and set(names) <= labels


def test_no_test_module_lists_modes_by_hand():
    """Lists of mode names in tests (assigned, looped over, parametrized, sampled) come from mode_coverage,
    so a new Mode cannot be left out of one unnoticed; MODES_ELSEWHERE (the named exclusions) is exempt."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                exempt = any(isinstance(t, ast.Name) and t.id.endswith("_ELSEWHERE") for t in node.targets)
                hit = not exempt and _mode_list(node.value)
            elif isinstance(node, (ast.For, ast.comprehension)):
                hit = _mode_list(node.iter)
            elif isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                hit = func.endswith(("parametrize", "sampled_from")) and any(_mode_list(a) for a in node.args)
            else:
                hit = False
            if hit:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert not found, found


def test_the_docs_that_list_the_modes_name_every_mode():
    """The recipe's docs rows: docs/contract.md's Modes table and per-token sentence, docs/guide.md's
    ``mode`` list, docs/losses.md's GRPO-family list (README.md's methods line: tests/repo/test_readme.py)."""
    contract = (ROOT / "docs" / "contract.md").read_text()
    table = _section(contract, "## Modes: mean `mu` and standard deviation `std` of x' given x")
    assert re.findall(r"^\| `(\w+)` \|", table, flags=re.M) and \
        set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M)) == set(Mode.labels())
    flat = re.sub(r"\s+", " ", contract)
    per_token = re.search(r"per-token schedules and frozen masks are the flow modes' per-element steps \(([^)]*)\)",
                          flat).group(1)
    assert {m.label for m in Mode if m.rules.per_token} <= set(re.findall(r"`(\w+)`", per_token)), per_token
    guide = re.sub(r"\s+", " ", (ROOT / "docs" / "guide.md").read_text())
    mode_list = re.search(r"- `mode`: (.*?) - `log_prob_kind`", guide).group(1)
    assert set(Mode.labels()) <= set(re.findall(r"`(\w+)`", mode_list)), mode_list
    loss_doc = re.sub(r"\s+", " ", (ROOT / "docs" / "losses.md").read_text())
    family = re.search(r"The GRPO family's `mode` is any mode whose mean is `a x \+ c v` \(([^)]*)\)", loss_doc).group(1)
    assert {m.label for m in Mode if m.rules.losses} <= set(re.findall(r"`(\w+)`", family)), family


def test_the_kernels_note_names_every_op_and_loss_it_launches_for():
    """docs/kernels.md's "Which public call launches what" has a row for every step op and every loss."""
    note = (ROOT / "docs" / "kernels.md").read_text()
    table = note.split("Which public call launches what", 1)[1].split("\n\n", 2)[1]
    named = set(re.findall(r"`(?:flowrl\.(?:losses\.)?)?(\w+)`", "\n".join(line.split(" | ")[0] for line in
                                                                           table.splitlines()[2:])))
    expected = {"sde_step", "step_log_prob", "step_kl"} | {
        n for n in losses.__all__ if n.endswith("_loss") or n == "awm_log_prob"}
    assert expected <= named, sorted(expected - named)
