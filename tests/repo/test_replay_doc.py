"""docs/replay.md's loops, run as written: from flowrl's recorder (a tiny SD3 pipeline with CFG 4.5) and
from SGLang-structured responses, every first-update ratio is exactly 1."""
import pathlib
import re

import pytest
import torch

import flowrl
import flowrl.data.sglang

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
import tiny_pipelines as tp  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "replay.md"


def block(containing):
    """The one python block of docs/replay.md that contains ``containing``."""
    found = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if containing in b]
    assert len(found) == 1, (containing, len(found))
    return found[0]


def test_recorder_loop_in_the_docs_gives_ratio_one():
    code = block('env_device="cpu"')
    assert "traj.step_model_output" in code and "rec.trajectory()" in code
    pipe = tp.tiny_StableDiffusion3Pipeline(torch.bfloat16)
    ratios = []
    namespace = {"flowrl": flowrl, "torch": torch, "pipe": pipe, "model": pipe.transformer, "device": "cpu",
                 "pipeline_kwargs": tp.StableDiffusion3Pipeline_inputs(torch.bfloat16, guidance_scale=4.5)}
    # the loop's body, plus a line collecting each ratio
    code = code.replace("   # exactly 1 before the first update", "\n    ratios.append(ratio)")
    namespace["ratios"] = ratios
    exec(compile(code, str(DOC), "exec"), namespace)
    assert len(ratios) == namespace["traj"].num_steps == 4
    assert all(torch.equal(r, torch.ones_like(r)) for r in ratios)


def test_sglang_loop_in_the_docs_gives_ratio_one():
    code = block("from_sglang(responses, request=request)")
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 6, generator=g).bfloat16()
    w = torch.randn(6, 6, generator=g).bfloat16()
    with sched.rollout(generator=torch.Generator().manual_seed(1)) as rec:
        for t in sched.timesteps:
            x = sched.step(x @ w * (t / 1000), t, x).prev_sample
    responses = flowrl.data.sglang.to_sglang(rec.trajectory())
    request = {"rollout_sde_type": "sde", "rollout_noise_level": 0.7, "rollout_log_prob_no_const": False}
    for r in responses:  # as SGLang sends them: no settings in the responses
        for k in list(r):
            if k.startswith("rollout_") and k not in ("rollout_log_probs", "rollout_debug_tensors"):
                del r[k]
        assert "latent_step_indices" not in r["dit_trajectory"]  # sglang 0.5.23's layout
    ratios = []
    namespace = {"flowrl": flowrl, "torch": torch, "responses": responses, "request": request, "ratios": ratios,
                 "policy_velocity": lambda traj, j: traj.latents[:, j] @ w * (traj.timesteps[j] / 1000)}
    code = code.replace("    ratio = torch.exp(traj.step_log_prob(j, v) - traj.log_probs[:, j])",
                        "    ratio = torch.exp(traj.step_log_prob(j, v) - traj.log_probs[:, j])\n    ratios.append(ratio)")
    exec(compile(code, str(DOC), "exec"), namespace)
    assert len(ratios) == 4 and all(torch.equal(r, torch.ones_like(r)) for r in ratios)
