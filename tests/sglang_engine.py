"""Drives the released SGLang's own rollout path (sglang 0.5.23, installed by ./run outside site-packages)
in a subprocess, and gives the tests what they need to recompute from its responses.

    python tests/sglang_engine.py CONFIGS.json OUT_DIR        (PYTHONPATH: SGLang's folder, the checkout)

For each configuration it runs, on SGLang's own code: ``FlowMatchEulerDiscreteScheduler.step`` with
``**rollout_step_kwargs(batch)`` (``FlowRolloutController.transition``), the hooks
``prepare_rollout_if_enabled`` / ``init_rollout_env_if_enabled`` / ``finalize_rollout_if_enabled``,
``rollout_api._build_response`` and ``msgspec.msgpack.encode``: the body a client receives, written to
OUT_DIR/<name>.msgpack. ``plugin: true`` runs it with ``flowrl.compat.sglang.register()``. ``sp: 2`` runs
two gloo ranks sharding the latents' height, with two stand-ins for what a server sets up (SGLang's SP
world size, and a pipeline config's shard / gather); rank 0 writes the body.

The denoiser is ``policy``: elementwise (so a shard computes what the whole sample would), the same
function the tests call to recompute log-probs with gradients.
"""
from __future__ import annotations

import json
import os
import sys
import types

import torch

SGLANG_VERSION = "0.5.23"
SHIFT = 3.0


def policy_bias(shape, seed: int = 7) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def policy(x: torch.Tensor, t: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 'model': a velocity from the latents (any float dtype; computed in float32) and the timestep."""
    return ((x.float() * -0.9 + bias) * (t.float() / 1000 + 0.1)).to(dtype)


def initial_latents(batch: int, shape, dtype) -> torch.Tensor:
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(3)).to(dtype)


def _doc_block(doc: str, containing: str) -> str:
    import re

    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", doc)).read()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if containing in b)


def request_of(cfg) -> dict:
    """The /rollout/generate request a configuration stands for (the settings from_sglang needs)."""
    return {"prompt": "p", "seed": 11, "rollout_sde_type": cfg["sde_type"], "rollout_noise_level": cfg["noise_level"],
            "rollout_log_prob_no_const": cfg["no_const"], "rollout_sde_step_indices": cfg.get("sde_steps"),
            "rollout_return_step_indices": cfg.get("return_steps"), "rollout_debug_mode": cfg.get("debug", True)}


# ----------------------------------------------------------------------------------------------------------
# the subprocess


def _install_stand_ins(world: int = 1):
    """Two stand-ins, for what the rollout never calls or a server would set up:

    torchvision: SGLang's config package imports an InternVL utility that imports torchvision.transforms
    at module level; the rollout never calls it, and the torchvision wheels for this torch are CUDA builds
    a CPU torch cannot load. transformers and diffusers are imported first, so they record torchvision as
    absent (true), then the stand-in holds only the names that import reads.
    SGLang's SP world size (sp_utils.get_sp_world_size): a server's parallel state; here 1, or the gloo
    group's size."""
    import enum

    if "torchvision" not in sys.modules:
        import diffusers.utils.import_utils  # noqa: F401
        import transformers  # noqa: F401

        tv = types.ModuleType("torchvision", "stand-in for torchvision (not the package)")
        transforms = types.ModuleType("torchvision.transforms", "stand-in")
        functional = types.ModuleType("torchvision.transforms.functional", "stand-in")
        tv.__path__, transforms.__path__ = [], []

        class InterpolationMode(enum.Enum):
            NEAREST, NEAREST_EXACT, BILINEAR, BICUBIC = "nearest", "nearest-exact", "bilinear", "bicubic"
            BOX, HAMMING, LANCZOS = "box", "hamming", "lanczos"

        transforms.InterpolationMode = functional.InterpolationMode = InterpolationMode
        tv.transforms, transforms.functional = transforms, functional
        sys.modules.update({"torchvision": tv, "torchvision.transforms": transforms,
                            "torchvision.transforms.functional": functional})
    from sglang.multimodal_gen.runtime.pipelines_core import schedule_batch  # noqa: F401  (before rollout_hooks)
    from sglang.multimodal_gen.runtime.post_training import sp_utils

    sp_utils.get_sp_world_size = lambda: world


class _PipelineConfig:
    """Stand-in for a pipeline config's SP methods (SGLang's PipelineConfig shards the sequence): here the
    latents' height (dim -2) in equal parts over the gloo group."""

    def __init__(self, world: int):
        self.world = world

    def shard_latents_for_sp(self, batch, latents):
        if self.world == 1:
            return latents, False
        rank = torch.distributed.get_rank()
        return latents.chunk(self.world, dim=-2)[rank].contiguous(), True

    def gather_latents_for_sp(self, latents, batch=None):
        parts = [torch.empty_like(latents) for _ in range(self.world)]
        torch.distributed.all_gather(parts, latents.contiguous())
        return torch.cat(parts, dim=-2)

    def gather_denoising_env_static_for_sp(self, batch, kwargs):
        return kwargs


def run(cfg: dict, out_dir: str, world: int = 1) -> None:
    from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch, Req
    from sglang.multimodal_gen.runtime.entrypoints.post_training import rollout_api
    from sglang.multimodal_gen.runtime.entrypoints.post_training.utils import _maybe_deserialize
    from sglang.multimodal_gen.runtime.models.schedulers.scheduling_flow_match_euler_discrete import (
        FlowMatchEulerDiscreteScheduler)
    from sglang.multimodal_gen.runtime.post_training import rollout_hooks as hooks
    import msgspec

    import flowrl.compat.sglang as plugin

    # flowrl's backend in the engine ("auto": torch on the CPU; "triton": the kernels, through Triton's
    # interpreter without a GPU)
    os.environ["FLOWRL_BACKEND"] = cfg.get("backend", "auto")
    if cfg.get("plugin"):  # docs/integration.md's lines, as written
        exec(compile(_doc_block("integration.md", "flowrl.compat.sglang.register()"), "integration.md", "exec"), {})
    else:
        plugin.unregister()
    dtype = getattr(torch, cfg["dtype"])
    steps, batch_size, shape = cfg["steps"], cfg["batch"], tuple(cfg["shape"])
    req = request_of(cfg)
    params = SamplingParams(prompt="p", rollout=True, rollout_sde_type=req["rollout_sde_type"],
                            rollout_noise_level=req["rollout_noise_level"],
                            rollout_log_prob_no_const=req["rollout_log_prob_no_const"],
                            rollout_debug_mode=req["rollout_debug_mode"], rollout_return_dit_trajectory=True,
                            rollout_sde_step_indices=req["rollout_sde_step_indices"],
                            rollout_return_step_indices=req["rollout_return_step_indices"])
    batch = Req(sampling_params=params)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=SHIFT, use_uniform_sigmas=bool(cfg.get("uniform")))
    scheduler.set_timesteps(steps)
    batch.scheduler = scheduler
    batch.latents = initial_latents(batch_size, shape, dtype)
    batch.generator = [torch.Generator().manual_seed(req["seed"] + i) for i in range(batch_size)]
    config = _PipelineConfig(world)
    bias = policy_bias((batch_size, *shape))
    hooks.prepare_rollout_if_enabled(batch=batch, pipeline_config=config)  # before SP sharding: full shape
    controller = type(batch.rollout_controllers[hooks.VISUAL_STREAM]).__name__
    x, sharded = config.shard_latents_for_sp(batch, batch.latents)
    if sharded:
        batch.did_sp_shard_latents = True
        bias, _ = config.shard_latents_for_sp(batch, bias)
    hooks.init_rollout_env_if_enabled(batch=batch, image_kwargs={}, pos_cond_kwargs={}, neg_cond_kwargs={},
                                      guidance=None)
    for t in scheduler.timesteps:
        v = policy(x, t, bias, dtype)
        x = scheduler.step(v, t, x, **hooks.rollout_step_kwargs(batch), return_dict=False)[0]
    hooks.finalize_rollout_if_enabled(batch=batch, latents=x, num_inference_steps=steps,
                                      final_timestep=scheduler.timesteps.new_zeros(()), pipeline_config=config)
    if world > 1:
        x = config.gather_latents_for_sp(x)
        if torch.distributed.get_rank() != 0:
            return
    result = OutputBatch(output=x.float(), rollout_trajectory_data=batch.rollout_trajectory_data)
    responses = rollout_api._build_response("rid", "p", req["seed"], True, result)
    body = msgspec.msgpack.encode([r.model_dump() for r in responses])
    # SGLang's own decoder reads the body
    decoded = _maybe_deserialize(msgspec.msgpack.decode(body))
    assert isinstance(decoded[0]["rollout_log_probs"], torch.Tensor)
    with open(os.path.join(out_dir, cfg["name"] + ".msgpack"), "wb") as f:
        f.write(body)
    with open(os.path.join(out_dir, cfg["name"] + ".json"), "w") as f:
        json.dump({"controller": controller, "plugin_registered": plugin.registered()}, f)


def checks(out_dir: str) -> None:
    """The plugin's seam and refusals, against SGLang's own controller and hooks: results to checks.json."""
    from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req
    from sglang.multimodal_gen.runtime.models.schedulers.scheduling_flow_match_euler_discrete import (
        FlowMatchEulerDiscreteScheduler)
    from sglang.multimodal_gen.runtime.post_training import rollout_hooks as hooks

    import flowrl.compat.sglang as plugin

    def built(**settings):
        batch = Req(sampling_params=SamplingParams(prompt="p", rollout=True, **settings))
        batch.scheduler = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
        batch.scheduler.set_timesteps(3)
        batch.latents = torch.zeros(1, 2, 4, 4)
        batch.generator = [torch.Generator().manual_seed(0)]
        hooks.prepare_rollout_if_enabled(batch=batch, pipeline_config=_PipelineConfig(1))
        return batch.rollout_controllers[hooks.VISUAL_STREAM]

    def error(fn):
        try:
            fn()
        except (ValueError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    out = {}
    plugin.unregister()
    out["default"] = type(built()).__name__
    out["register_returns"] = plugin.register().__name__
    plugin.register()  # idempotent
    out["registered"] = [plugin.registered(), type(built()).__name__]
    plugin.unregister()
    out["unregistered"] = [plugin.registered(), type(built()).__name__]
    stock = built()
    stock.ode_transition = lambda **kw: kw["sample"]
    out["ode_transition"] = error(lambda: plugin.as_flowrl(stock))
    odd = built()
    odd.sde_type = "flow"  # SamplingParams refuses it first; a loop building its own controller might not
    out["sde_type"] = error(lambda: plugin.as_flowrl(odd))
    out["not_a_controller"] = error(lambda: plugin.as_flowrl(object()))
    wrapped = plugin.wrap(hooks._build_scheduler_rollout_controller)
    batch = Req(sampling_params=SamplingParams(prompt="p", rollout=True))
    batch.scheduler = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    batch.scheduler.set_timesteps(3)
    batch.latents = torch.zeros(1, 2, 4, 4)
    batch.generator = [torch.Generator().manual_seed(0)]
    hooks.prepare_rollout_if_enabled(batch=batch, pipeline_config=_PipelineConfig(1), build_controller=wrapped)
    out["wrap"] = type(batch.rollout_controllers[hooks.VISUAL_STREAM]).__name__
    # the scheduler reset after the rollout began: its sigmas are no longer the controller's
    controller = batch.rollout_controllers[hooks.VISUAL_STREAM]
    batch.scheduler.set_timesteps(sigmas=[0.9, 0.5, 0.2])
    t = batch.scheduler.timesteps[0]
    out["reset"] = error(lambda: batch.scheduler.step(torch.zeros(1, 2, 4, 4), t, torch.zeros(1, 2, 4, 4),
                                                      **hooks.rollout_step_kwargs(batch)))
    assert controller is batch.rollout_controllers[hooks.VISUAL_STREAM]
    with open(os.path.join(out_dir, "checks.json"), "w") as f:
        json.dump(out, f)


def _rank_main(rank: int, world: int, port: int, cfgs, out_dir: str) -> None:
    _install_stand_ins(world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for cfg in cfgs:
            run(cfg, out_dir, world)
    finally:
        torch.distributed.destroy_process_group()


def main(argv) -> None:
    cfgs = json.load(open(argv[1]))
    out_dir = argv[2]
    _install_stand_ins()
    import sglang

    assert sglang.__version__ == SGLANG_VERSION, sglang.__version__
    torch.manual_seed(0)
    checks(out_dir)
    for cfg in [c for c in cfgs if c.get("sp", 1) == 1]:
        run(cfg, out_dir)
    sp = [c for c in cfgs if c.get("sp", 1) > 1]
    if sp:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank_main, args=(sp[0]["sp"], port, sp, out_dir), nprocs=sp[0]["sp"], join=True)


if __name__ == "__main__":
    main(sys.argv)
