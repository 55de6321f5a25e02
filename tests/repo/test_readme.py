"""README.md's first screen, checked: the methods line counts what the library has, the example runs
as written (a tiny SD3 pipeline with classifier-free guidance, bf16) with every ratio exactly 1, and
the op table's names, docs and tests exist."""
import importlib
import pathlib
import re

import pytest
import torch

import flowrl
from flowrl import losses
from flowrl.contract import Mode

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_methods_line_counts_the_modes_and_losses_the_library_has():
    line = README.splitlines()[2]
    modes = re.search(r"\*\*(\d+) sampler modes\*\* \(([^)]*(?:\([^)]*\)[^)]*)*)\)", line)
    assert int(modes.group(1)) == len(Mode)
    assert re.findall(r"`(\w+)`", modes.group(2)) == [m.label for m in Mode]
    loss_functions = [n for n in losses.__all__ if n.endswith("_loss")]
    assert int(re.search(r"\*\*(\d+) training losses\*\*", line).group(1)) == len(loss_functions) == 8


def test_the_example_runs_as_written_with_ratio_exactly_one():
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import tiny_pipelines as tp

    code = re.search(r"## Example.*?```python\n(.*?)```", README, flags=re.S).group(1)
    pipe = tp.tiny_StableDiffusion3Pipeline(torch.bfloat16)
    ratios = []
    namespace = {"pipe": pipe, "ratios": ratios,
                 "pipeline_kwargs": tp.StableDiffusion3Pipeline_inputs(torch.bfloat16, guidance_scale=4.5)}
    code = code.replace("   # exactly 1 before the first update", "\n    ratios.append(ratio)")
    exec(compile(code, "README.md", "exec"), namespace)
    assert isinstance(pipe.scheduler, flowrl.FlowMatchEulerDiscreteScheduler)
    assert len(ratios) == namespace["traj"].num_steps == 4
    assert all(torch.equal(r, torch.ones_like(r)) for r in ratios)


def _table_rows():
    table = README.split("## What it provides", 1)[1].split("\n\n", 2)[1]
    return [line.split(" | ") for line in table.splitlines()[2:]]


def _resolve(name):
    """``flowrl.x.y`` as an attribute path from ``flowrl`` (modules imported on the way)."""
    obj, path = flowrl, "flowrl"
    for part in name.split(".")[1:]:
        path += "." + part
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(path)
    return obj


def test_the_op_table_names_ops_docs_and_tests_that_exist():
    rows = _table_rows()
    assert len(rows) >= 14
    for op, _, doc, test in rows:
        for name in re.findall(r"`(flowrl\.[\w.]+)", op):
            _resolve(name.rstrip("*").rstrip("."))
        for extra in re.findall(r"`(\w+)`", op.split("(+", 1)[1]) if "(+" in op else []:
            assert extra in losses.__all__, extra
        for link in re.findall(r"\]\((docs/[\w.]+\.md)", doc):
            assert (ROOT / link).is_file(), link
        for path in re.findall(r"`(tests/(?:\w+/)?\w+\.py)`", test):
            assert (ROOT / path).is_file(), path
    assert "docs/losses.md" in README and "flowrl.losses.grpo_loss" in README


def test_the_docs_index_links_every_doc():
    index = README.split("## Docs", 1)[1]
    linked = set(re.findall(r"\]\((docs/[\w.]+\.md)\)", index))
    assert linked == {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
