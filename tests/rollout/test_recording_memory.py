"""The memory of a recording (docs/performance.md, "Memory of a recording"), checked against the doc:

* every pipeline of tests/rollout/test_pipeline_table.py, recorded with ``store="cpu"`` and ``store="device"``
  (fp32 and bf16): the two trajectories and replay environments are the same bit for bit, and the
  bytes per sample per step (``traj.nbytes_per_sample_step()``, the latent shapes and dtypes as
  recorded) and of the environment equal the doc's table;
* the peak device bytes of a 121-frame Wan 2.2 and LTX-2 rollout for each store option, recomputed
  from the latent shapes the doc states (``flowrl.data.trajectory_store.recording_peak_gpu_bytes``).

``python tests/rollout/test_recording_memory.py`` prints the pipeline table's rows in the doc's format.
"""
from __future__ import annotations

import pathlib
import re
import warnings

import pytest
import torch

import flowrl
from flowrl.data import trajectory_store as TS

pytestmark = pytest.mark.slow  # records every pipeline of the table with both stores (./run test -m 'not slow' skips it)

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "performance.md"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _section() -> str:
    text = DOC.read_text()
    start = text.index("## Memory of a recording")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _doc_rows():
    """``| id | dtype | latents | recording | environment |`` rows of the pipeline table."""
    rows = {}
    for line in _section().splitlines():
        m = re.match(r"\|\s*`([\w-]+)`\s*\|\s*(fp32|bf16)\s*\|([^|]*)\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|", line)
        if m:
            rows[(m.group(1), m.group(2))] = (m.group(3).strip(), int(m.group(4).replace(",", "")),
                                              int(m.group(5).replace(",", "")))
    return rows


def _record(row, dtype, store):
    pipe, call = row.build(dtype)
    shipped = pipe.scheduler
    pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(shipped.config)
    models = tuple(getattr(pipe, name) for name in row.models)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pipe.scheduler.rollout(mode="sde", noise_level=0.7, generator=torch.Generator().manual_seed(5),
                                        model=models[0] if len(models) == 1 else models, store=store,
                                        frozen=row.frozen() if row.frozen else None) as rec:
                pipe(**call())
    finally:
        pipe.scheduler = shipped
    return rec.trajectory()


def _describe(traj) -> str:
    parts = []
    for s in traj.streams or (traj,):
        parts.append(f"{list(s.latents.shape[2:])} {str(s.latents.dtype).replace('torch.', '')}")
    return " + ".join(parts)


def _measure(traj):
    env = traj.denoising_env.nbytes() // (traj.batch_size * traj.num_steps)
    return _describe(traj), traj.nbytes_per_sample_step()["total"], env


def _rows():
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    import test_pipeline_table as table

    return table


PIPELINE_IDS = ["sd3", "flux", "flux-kontext", "flux2", "flux2-klein", "qwenimage", "wan-t2v", "wan22-a14b", "wan-i2v",
                "wan22-ti2v", "ltx", "ltx-i2v", "ltx-condition", "ltx-condition-image", "ltx2", "cogview4", "lumina2",
                "hunyuan-video", "sana"]


def test_the_doc_lists_every_pipeline_of_the_table():
    table = _rows()
    assert [r.id for r in table.ROWS] == PIPELINE_IDS
    assert set(_doc_rows()) == {(i, d) for i in PIPELINE_IDS for d in DTYPES}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("row_id", PIPELINE_IDS)
def test_pipeline_recording_bytes_and_stores_agree(row_id, dtype):
    from test_trajectory_store import _bitwise, _same_trajectory

    table = _rows()
    row = table.BY_ID[row_id]
    host = _record(row, DTYPES[dtype], "cpu")
    dev = _record(row, DTYPES[dtype], "device")
    _same_trajectory(dev, host)
    for j in range(dev.num_steps):
        _bitwise(dev.model_calls(j), host.model_calls(j), f"model_calls({j})")
        _bitwise(dev.step_inputs(j), host.step_inputs(j), f"step_inputs({j})")
    assert _measure(host) == _measure(dev) == _doc_rows()[(row_id, dtype)]


# ---------------------------------------------------------------------------------------------------
# 121-frame Wan 2.2 and LTX-2 (the shapes and sources the doc states)

def _wan(channels, spatial, height, width, frames=121, temporal=4):
    return (channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)


def _ltx2(height=512, width=768, frames=121, frame_rate=24.0):
    video = (128, (frames - 1) // 8 + 1, height // 32, width // 32)
    audio_frames = round(frames / frame_rate * 16000 / 160 / 4)
    audio = (8, audio_frames, 64 // 4)
    return video, audio


F32, BF16 = torch.float32, torch.bfloat16
LONG_VIDEO = {
    # name: (streams: (latent shape, first-step dtype, step dtype))
    "Wan 2.2 TI2V-5B, 1280x704": [(_wan(48, 16, 704, 1280), F32, BF16)],
    "Wan 2.2 A14B, 1280x720": [(_wan(16, 8, 720, 1280), F32, BF16)],
    "LTX-2, 768x512": [(s, F32, F32) for s in _ltx2()],
}


def _doc_long_rows():
    rows = {}
    for line in _section().splitlines():
        m = re.match(r"\|\s*([^|`]+?)\s*\|\s*`([^`]*)`\s*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|",
                     line)
        if m and m.group(1) in LONG_VIDEO:
            rows[m.group(1)] = (m.group(2),) + tuple(int(m.group(k).replace(",", "")) for k in range(3, 7))
    return rows


def long_video_row(name, batch=8, steps=50):
    streams = LONG_VIDEO[name]
    shapes = " + ".join(str(list(s)) for s, _, _ in streams)
    latent = sum(TS.latent_nbytes(s, torch.promote_types(a, b)) for s, a, b in streams)
    per_step = latent + 4 * (1 if len(streams) == 1 else 1 + 2 * len(streams))  # + log-probs (and counts)
    return (shapes, latent, per_step,
            TS.recording_peak_gpu_bytes(streams, batch=batch, steps=steps, store="device"),
            TS.recording_peak_gpu_bytes(streams, batch=batch, steps=steps, store="cpu"))


def test_long_video_peak_bytes_are_the_docs_arithmetic():
    assert _wan(48, 16, 704, 1280) == (48, 31, 44, 80)
    assert _wan(16, 8, 720, 1280) == (16, 31, 90, 160)
    assert _ltx2() == ((128, 16, 16, 24), (8, 126, 16))
    doc = _doc_long_rows()
    assert set(doc) == set(LONG_VIDEO)
    for name in LONG_VIDEO:
        assert doc[name] == long_video_row(name), (name, doc[name], long_video_row(name))


def test_per_step_arithmetic_matches_a_recording_of_the_same_structure():
    # the per-step column's rule (latent in the promoted dtype + 4 per log-prob, + counts for streams)
    # is what nbytes_per_sample_step measures on a recording with one / two streams
    from test_trajectory_store import _record

    _, one = _record("cpu", "bf16")
    assert one.nbytes_per_sample_step()["total"] == TS.latent_nbytes((6, 8, 4), F32) + 4
    _, two = _record("cpu", "joint-streams")
    assert two.nbytes_per_sample_step()["total"] == TS.latent_nbytes((6, 8, 4), F32) + TS.latent_nbytes((5, 4), F32) + 4 * 5


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    table = _rows()
    for row in table.ROWS:
        for name, dtype in DTYPES.items():
            latents, total, env = _measure(_record(row, dtype, "cpu"))
            print(f"| `{row.id}` | {name} | {latents} | {total:,} | {env:,} |")
    for name in LONG_VIDEO:
        shapes, latent, per_step, dev, cpu = long_video_row(name)
        print(f"| {name} | `{shapes}` | {latent:,} | {per_step:,} | {dev:,} | {cpu:,} |")
