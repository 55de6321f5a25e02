"""The pipeline table: flowrl's scheduler swapped into unmodified diffusers 0.42.1 pipelines with tiny
random components (tests/tiny_pipelines.py, after diffusers' own tests' ``get_dummy_components``; prompt
embeddings instead of text encoders, ``output_type="latent"``), one row per pipeline.

Each row checks (1) the one-line swap ``flowrl.FlowMatchEulerDiscreteScheduler.from_config(config)``
gives the stock scheduler's latents bit for bit without a rollout, in float32 and bfloat16, and (2) an
sde rollout (noise level 0.7, seeded generator, ``model=pipe.transformer``; Wan 2.2 A14B
``model=(pipe.transformer, pipe.transformer_2)``) recomputes every step's log-prob bit for bit from the
recorded model calls (``traj.model_calls(j)`` replayed through the module ``traj.model_indices(j)``
names, ``traj.step_model_output``, ``traj.step_log_prob``: first ratio exactly 1), and a changed
velocity on one scored element changes the recomputed log-prob. Family needs (docs/scheduler.md,
docs/replay.md) are in each row's note.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch

import flowrl

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")  # the pipeline modules import it for their text-encoder types
pytest.importorskip("PIL")

import tiny_pipelines as tiny  # noqa: E402

pytestmark = pytest.mark.slow  # runs 19 tiny diffusers pipelines through the swap and the replay (./run test -m 'not slow' skips it)

STEPS = tiny.STEPS  # 3
BATCH = 2


def _class_row(cls: str, builder: Optional[str] = None, **inputs):
    """``tiny_<cls>(dtype)`` + ``<cls>_inputs(dtype, batch, steps, **inputs)`` as ``(pipe, call)``."""
    def build(dtype):
        pipe = getattr(tiny, builder or f"tiny_{cls}")(dtype)

        def call(seed: int = 0):
            kwargs = getattr(tiny, f"{cls}_inputs")(dtype, batch=BATCH, steps=STEPS, **inputs)
            return dict(kwargs, generator=torch.Generator().manual_seed(seed))

        return pipe, call

    return build


def _video_row(builder: Callable, **options):
    def build(dtype):
        pipe, call = builder(dtype, **options)
        return pipe, (lambda seed=0: call(batch=BATCH, seed=seed))

    return build


def _ti2v_frozen():
    mask = torch.zeros(1, 1, 3, 1, 1, dtype=torch.bool)  # [B, C, F, H, W]: 9 frames -> 3 latent frames
    mask[:, :, 0] = True  # frame 0 is replaced by the image condition (docs/scheduler.md)
    return mask


def _ltx2_velocity(pipe, traj, j, raw):
    """LTX-2 steps each stream with ``out.float()`` turned v -> x0 -> v with ``scheduler.sigmas[i]``
    (docs/scheduler.md): rebuilt per stream from the replayed (video, audio) output."""
    (out,) = raw
    sigma = traj.sigmas[j]
    velocities = []
    for k, v in enumerate(out[:2]):
        x = traj.streams[k].latents[:, j]
        velocities.append((x - (x - v.float() * sigma)) / sigma)
    return tuple(velocities)


@dataclass
class Row:
    id: str
    build: Callable  # dtype -> (pipe, call(seed) -> kwargs)
    note: str = ""
    frozen: Optional[Callable] = None  # () -> rollout(frozen=) mask
    velocity: Optional[Callable] = None  # (pipe, traj, j, raw) -> model_output, where step_model_output cannot
    streams: int = 1
    stock: Optional[Callable] = None  # config -> the stock diffusers scheduler to compare with (Sana)
    models: tuple = ("transformer",)  # the pipe's modules to record: one is passed as model=, several as a tuple
    marks: list = field(default_factory=list)  # on the rollout recompute test


ROWS = [
    Row("sd3", _class_row("StableDiffusion3Pipeline", guidance_scale=4.5), "batched CFG 4.5"),
    Row("flux", _class_row("FluxPipeline")),
    Row("flux-kontext", _class_row("FluxKontextPipeline"), "token cut of the reference-image tokens"),
    Row("flux2", _class_row("Flux2Pipeline"), "sigmas + mu passed to set_timesteps"),
    Row("flux2-klein", _class_row("Flux2KleinPipeline"), "CFG 4 over two calls"),
    Row("qwenimage", _class_row("QwenImagePipeline")),
    Row("wan-t2v", _class_row("WanPipeline"), "CFG 6 over two calls"),
    Row("wan22-a14b", _class_row("WanPipeline", builder="tiny_WanPipeline_A14B"),
        "two experts (transformer above boundary 875, transformer_2 below), CFG 6: "
        "model=(transformer, transformer_2), each call replayed on traj.model_indices(j)'s expert",
        models=("transformer", "transformer_2")),
    Row("wan-i2v", _video_row(tiny.tiny_wan_i2v)),
    Row("wan22-ti2v", _video_row(tiny.tiny_wan22_ti2v), "expand_timesteps: rollout(frozen=frame-0 mask)",
        frozen=_ti2v_frozen),
    Row("ltx", _class_row("LTXPipeline"), "batched CFG 3 after .float()"),
    Row("ltx-i2v", _video_row(tiny.tiny_ltx_i2v), "unpacked to frames, frame 0 dropped"),
    Row("ltx-condition", _video_row(tiny.tiny_ltx_condition, with_image=False), "per-token timesteps [B, 1]"),
    Row("ltx-condition-image", _video_row(tiny.tiny_ltx_condition, with_image=True),
        "per-token timesteps [B, S], image tokens held at t = 0"),
    Row("ltx2", _video_row(tiny.tiny_ltx2),
        "video + audio streams (model_output a tuple); v -> x0 -> v per stream rebuilt by the test "
        "(the environment's transform is stream 0's and needs the sample)",
        velocity=_ltx2_velocity, streams=2),
    Row("cogview4", _class_row("CogView4Pipeline"), "dynamic shifting (linear) with mu"),
    Row("lumina2", _class_row("Lumina2Pipeline", guidance_scale=4.0), "sign -out, normalized CFG 4"),
    Row("hunyuan-video", _class_row("HunyuanVideoPipeline"), "embedded guidance"),
    Row("sana", _class_row("SanaPipeline"),
        "shipped DPMSolverMultistep(flow_shift=3): from_config maps flow_shift to shift; compared with "
        "diffusers' FlowMatchEuler(shift=3); output .float()",
        stock=lambda cfg: diffusers.FlowMatchEulerDiscreteScheduler.from_config(cfg, shift=cfg["flow_shift"])),
]
BY_ID = {row.id: row for row in ROWS}


@pytest.fixture(scope="module")
def pipes():
    cache = {}

    def get(row_id, dtype):
        if (row_id, dtype) not in cache:
            cache[(row_id, dtype)] = BY_ID[row_id].build(dtype)
        return cache[(row_id, dtype)]

    return get


def outputs(result) -> tuple:
    return tuple(t for t in result.to_tuple() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row_id", list(BY_ID))
def test_swapped_scheduler_gives_the_stock_latents(pipes, row_id, dtype):
    row = BY_ID[row_id]
    pipe, call = pipes(row_id, dtype)
    shipped = pipe.scheduler
    assert not isinstance(shipped, flowrl.FlowMatchEulerDiscreteScheduler)  # diffusers' own, as shipped
    try:
        if row.stock is not None:
            pipe.scheduler = row.stock(shipped.config)
        expected = outputs(pipe(**call()))
        pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(shipped.config)  # the one-line swap
        if row.stock is not None:
            assert pipe.scheduler.config.shift == pipe.scheduler.config.get("shift") == shipped.config.flow_shift
        got = outputs(pipe(**call()))
    finally:
        pipe.scheduler = shipped
    assert len(got) == len(expected) >= 1
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _with_stream0(model_output, changed0):
    return changed0 if not isinstance(model_output, tuple) else (changed0,) + tuple(model_output[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row_id", [pytest.param(r.id, marks=r.marks) for r in ROWS])
def test_sde_rollout_recomputes_every_step_from_the_recorded_calls(pipes, row_id, dtype):
    row = BY_ID[row_id]
    pipe, call = pipes(row_id, dtype)
    shipped = pipe.scheduler
    pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(shipped.config)
    models = tuple(getattr(pipe, name) for name in row.models)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pipe.scheduler.rollout(mode="sde", noise_level=0.7, generator=torch.Generator().manual_seed(5),
                                        model=models[0] if len(models) == 1 else models,
                                        frozen=row.frozen() if row.frozen else None) as rec:
                pipe(**call())
    finally:
        pipe.scheduler = shipped
    messages = [str(w.message) for w in caught if "flowrl" in str(w.message)]
    if row.velocity is None:
        assert not messages, messages  # every step's output transform was found
    traj = rec.trajectory()
    assert traj.num_steps == STEPS and traj.num_streams == row.streams and traj.batch_size == BATCH
    assert bool(torch.isfinite(traj.log_probs).all()) and bool((traj.log_probs != 0).all())

    # every given module ran on some step (the experts' routing is in the recording)
    assert {i for j in range(traj.num_steps) for i in traj.model_indices(j)} == set(range(len(models)))

    velocities = []
    for j in range(traj.num_steps):
        with torch.no_grad():
            raw = [models[i](**kwargs) for i, kwargs in zip(traj.model_indices(j), traj.model_calls(j))]
        v = row.velocity(pipe, traj, j, raw) if row.velocity else traj.step_model_output(j, raw)
        log_prob = traj.step_log_prob(j, v)
        assert torch.equal(log_prob, traj.log_probs[:, j]), j
        assert torch.equal(torch.exp(log_prob - traj.log_probs[:, j]), torch.ones(BATCH)), j  # ratio exactly 1
        velocities.append(v)

    # a changed velocity on one scored element (not frozen, not held at t = 0) changes the log-prob
    j = 1
    inputs = traj.step_inputs(j)
    v = velocities[j]
    v0 = (v[0] if isinstance(v, tuple) else v).clone()
    unscored = torch.zeros(v0.shape, dtype=torch.bool)
    for key in ("frozen", "token_sigmas"):
        value = inputs.get(key)
        if value is not None:
            value = value[0] if isinstance(value, tuple) else value
            unscored |= value if key == "frozen" else (value == 0)
    assert bool((~unscored).any())
    v0[tuple((~unscored).nonzero()[-1].tolist())] += 1.0
    changed = traj.step_log_prob(j, _with_stream0(v, v0))
    assert not torch.equal(changed, traj.log_probs[:, j])
