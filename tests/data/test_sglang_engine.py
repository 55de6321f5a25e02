"""The released SGLang (0.5.23) end to end: its own rollout engine, response builder and msgpack, then
flowrl reads the body and recomputes (issue: SGLang as it ships).

``tests/sglang_engine.py`` drives SGLang's code in one subprocess (SGLang's import patches transformers
and redirects Triton's cache: kept out of this process) for every configuration below, with and
without ``flowrl.compat.sglang``; the tests here decode what it wrote. ./run installs the package (no
dependency tree, the modules' narrowest import set) in ``.venv/sglang-0.5.23``; without it they skip.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.data.sglang import engine_prev_sample, from_sglang

import sglang_engine as E

pytestmark = pytest.mark.slow  # one subprocess drives SGLang for every configuration (about a minute)
ROOT = Path(__file__).resolve().parents[2]
SGLANG_DIR = Path(os.environ.get("FLOWRL_SGLANG_DIR", Path(sys.prefix) / "sglang-0.5.23"))
SHAPE = [4, 8, 8]  # the SP runs split the height (8) over 2 ranks


def _cfg(name, dtype="bfloat16", sde_type="sde", noise_level=0.7, no_const=False, plugin=True, **extra):
    return dict(name=name, dtype=dtype, sde_type=sde_type, noise_level=noise_level, no_const=no_const,
                plugin=plugin, steps=extra.pop("steps", 5), batch=extra.pop("batch", 2), shape=SHAPE, **extra)


OFF = [_cfg("off_fp32_sde", "float32", plugin=False), _cfg("off_bf16_sde", plugin=False),
       _cfg("off_fp32_cps_noconst", "float32", "cps", 0.5, True, plugin=False)]
ON = [_cfg("on_fp32_sde", "float32"), _cfg("on_bf16_sde"), _cfg("on_bf16_cps", sde_type="cps"),
      _cfg("on_bf16_ode", sde_type="ode", no_const=True), _cfg("on_fp32_ode_gaussian", "float32", "ode"),
      _cfg("on_bf16_steps", sde_steps=[1, 2], return_steps=[1, 2, 3]),
      _cfg("on_bf16_noconst_uniform", noise_level=0.5, no_const=True, uniform=True, debug=False),
      _cfg("on_fp32_sde_sp2", "float32", sp=2), _cfg("on_bf16_cps_sp2", sde_type="cps", sp=2),
      # the Triton kernels in the engine (Triton's interpreter here), recomputed on the same backend
      _cfg("on_bf16_sde_triton", steps=3, backend="triton"), _cfg("on_bf16_cps_triton_sp2", "bfloat16", "cps", steps=3,
                                                                   backend="triton", sp=2)]
CONFIGS = {c["name"]: c for c in OFF + ON}


@pytest.fixture(scope="module")
def bodies(tmp_path_factory):
    if not (SGLANG_DIR / ".flowrl-installed").exists():
        pytest.skip(f"sglang 0.5.23 is not installed in {SGLANG_DIR} (./run test installs it; it could not here)")
    out = tmp_path_factory.mktemp("sglang")
    (out / "configs.json").write_text(json.dumps(list(CONFIGS.values())))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SGLANG_DIR), str(ROOT)])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sglang_engine.py"), str(out / "configs.json"),
                           str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def load(bodies, name):
    cfg = CONFIGS[name]
    body = (bodies / f"{name}.msgpack").read_bytes()
    return cfg, body, from_sglang(body, request=E.request_of(cfg)), json.loads((bodies / f"{name}.json").read_text())


def velocity(cfg, traj, j):
    """The engine's denoiser on the trajectory's latents (the training forward, here without a graph)."""
    bias = E.policy_bias((cfg["batch"], *cfg["shape"]))
    k = traj.latent_step_indices.tolist().index(j)  # loop step j's latent (return_step_indices filters them)
    return E.policy(traj.latents[:, k], traj.timesteps[j], bias, getattr(torch, cfg["dtype"]))


def recomputable(traj):
    kept = set(traj.latent_step_indices.tolist())
    return [j for j in range(traj.num_steps) if j in kept and j + 1 in kept]


def max_ratio_dev(cfg, traj, prev_sample=None):
    worst = 0.0
    for j in recomputable(traj):
        extra = {} if prev_sample is None else {"prev_sample": prev_sample(traj, j)}
        lp = traj.step_log_prob(j, velocity(cfg, traj, j), **extra)
        worst = max(worst, float((torch.exp(lp.double() - traj.log_probs[:, j].double()) - 1).abs().max()))
    return worst


def logprob_bound(traj, j, x_next, std):
    """How far two float32 evaluations of SGLang's step log-prob can differ (docs/replay.md):
    the engine's term is -eps^2 / 2 - log std - log sqrt(2 pi) from the noise; flowrl's is -r^2 / (2 std^2)
    with r = x' - mu re-formed from the float32 sample, whose rounding moves r by at most ulp(x') / 2, so
    each term by |eps| ulp(x') / (2 std); the two stds (different float32 formulas) differ by a few ulps
    (2^-21 relative), and two float32 sums of N terms by about log2(N) 2^-24 of the sum of |terms|."""
    eps = traj.debug_tensors.rollout_variance_noises[:, j].double().flatten(1)
    ulp = torch.finfo(torch.float32).eps * x_next.double().abs().flatten(1).clamp_min(2.0 ** -126)
    s = std.double().flatten()[:, None]
    term = (eps * eps / 2 + s.log().abs() + 0.919).mean(1)
    n = eps.shape[1]
    return (eps.abs() * ulp / (2 * s)).mean(1) + (eps * eps).mean(1) * 2.0 ** -21 + 2 * math.log2(n) * 2.0 ** -24 * term


# ---------------------------------------------------------------------------------------------- without it


@pytest.mark.parametrize("name", [c["name"] for c in OFF])
def test_released_body_decodes_and_matches_flowrls_step_with_sglangs_noise(bodies, name, capsys):
    """A body exactly as sglang 0.5.23 sends it (msgpack, raw-bytes envelopes, no latent_step_indices)
    decodes; flowrl's step with SGLang's noise gives SGLang's samples, and flowrl's log-prob of the sample
    the engine scored is SGLang's within the float32 bound above."""
    cfg, body, traj, meta = load(bodies, name)
    assert meta["controller"] == "FlowRolloutController"
    assert traj.latents.dtype == torch.float32  # 0.5.23 records step()'s float32 upcast, bf16 rollouts too
    assert traj.latents.shape[:2] == (cfg["batch"], cfg["steps"] + 1)
    kind = "sq_err" if cfg["no_const"] else "gaussian"
    worst_x = worst_lp = 0.0
    for j in range(traj.num_steps):
        v = velocity(cfg, traj, j)
        noise = traj.debug_tensors.rollout_variance_noises[:, j]
        ours = flowrl.sde_step(traj.latents[:, j], v, traj.sigmas, j, mode=traj.mode, noise_level=traj.noise_level,
                               noise=noise, log_prob_kind=kind, out_dtype=torch.float32)
        engine = engine_prev_sample(traj, j)
        # the same formula in float32, written differently: a few ulps apart
        torch.testing.assert_close(ours.prev_sample, engine, rtol=4 * 2.0 ** -23, atol=4 * 2.0 ** -23)
        worst_x = max(worst_x, float((ours.prev_sample - engine).abs().max()))
        emitted = traj.latents[:, j + 1]
        if cfg["dtype"] == "bfloat16":  # what the model consumed next is the engine's sample rounded
            assert torch.equal(emitted, engine.bfloat16().float())
        else:
            assert torch.equal(emitted, engine)
        lp = traj.step_log_prob(j, v, prev_sample=engine)
        dlp = (lp.double() - traj.log_probs[:, j].double()).abs()
        if kind == "gaussian":
            bound = logprob_bound(traj, j, engine, ours.std_dev)
        else:  # -r^2 against -(std eps)^2: r moved by ulp(x') / 2
            eps, std = noise.double().flatten(1), ours.std_dev.double()[:, None]
            bound = (2 * (std * eps).abs() * torch.finfo(torch.float32).eps * engine.double().abs().flatten(1)
                     + (std * eps) ** 2 * 2.0 ** -20).mean(1) + 1e-12
        assert bool((dlp <= bound).all()), (j, dlp.tolist(), bound.tolist())
        worst_lp = max(worst_lp, float(dlp.max()))
    # docs/replay.md quotes these: within 4.8e-7 of SGLang's sample and log-probs; 0.11 from bf16 latents alone
    assert worst_x <= 4.8e-7 and worst_lp <= 4.8e-7
    if cfg["dtype"] == "bfloat16":
        # the recompute from the latents alone scores the rounded sample SGLang did not score
        assert round(max_ratio_dev(cfg, traj), 2) == 0.11
    with capsys.disabled():
        print(f"\n[sglang 0.5.23] {name}: max |x' - SGLang's| {worst_x:.3g}, max |dlogp| {worst_lp:.3g}, "
              f"|ratio - 1| {max_ratio_dev(cfg, traj, engine_prev_sample):.3g} (engine_prev_sample), "
              f"{max_ratio_dev(cfg, traj):.3g} (latents alone)")


# ------------------------------------------------------------------------------------------------- with it


@pytest.mark.parametrize("name", [c["name"] for c in ON])
def test_with_flowrl_in_the_engine_the_ratio_is_exactly_one(bodies, name, capsys):
    cfg, body, traj, meta = load(bodies, name)
    assert meta == {"controller": "FlowRLRolloutController", "plugin_registered": True}
    steps = recomputable(traj)
    assert steps and bool(torch.isfinite(traj.log_probs).all())
    backend = cfg.get("backend", "auto")
    for j in steps:
        lp = traj.step_log_prob(j, velocity(cfg, traj, j), backend=backend)
        assert torch.equal(torch.exp(lp - traj.log_probs[:, j]), torch.ones_like(lp)), j
    assert traj.mode == cfg["sde_type"] and traj.log_prob_kind == ("sq_err" if cfg["no_const"] else "gaussian")
    if cfg.get("return_steps"):
        assert traj.latent_step_indices.tolist() == cfg["return_steps"]
    if cfg.get("sde_steps"):
        assert traj.sde_steps.tolist() == cfg["sde_steps"]
        ode = [j for j in range(traj.num_steps) if j not in cfg["sde_steps"]]
        assert bool((traj.log_probs[:, ode] == 0).all())  # deterministic steps: log-prob 0
    if cfg.get("debug", True):
        d = traj.debug_tensors
        b, t = cfg["batch"], cfg["steps"]
        assert d.rollout_prev_sample_means.shape == (b, t, *SHAPE) and d.rollout_noise_std_devs.shape == (b, t, 1)
        assert d.rollout_variance_noises.shape == (b, t, *SHAPE) and d.rollout_model_outputs.shape[:2] == (b, t)
    else:
        assert traj.debug_tensors is None
    with capsys.disabled():
        print(f"\n[sglang 0.5.23 + flowrl.compat.sglang] {name}: |ratio - 1| = 0 on steps {steps} ({backend})")


def test_with_flowrl_sglangs_noise_and_samples_stay_sglangs(bodies):
    """The plugin draws SGLang's noise from the request's generators: the same seed gives the same images
    up to the step's float32 rounding, in float32 and bf16."""
    for dtype in ("fp32", "bf16"):
        _, _, off, _ = load(bodies, f"off_{dtype}_sde")
        _, _, on, _ = load(bodies, f"on_{dtype}_sde")
        assert torch.equal(on.debug_tensors.rollout_variance_noises[:, 0], off.debug_tensors.rollout_variance_noises[:, 0])
        torch.testing.assert_close(on.latents, off.latents, rtol=0.02 if dtype == "bf16" else 1e-5,
                                   atol=0.02 if dtype == "bf16" else 1e-5)


def test_under_sequence_parallelism_the_log_probs_are_the_unsharded_ones(bodies):
    for sp, whole in (("on_bf16_cps_sp2", "on_bf16_cps"), ("on_fp32_sde_sp2", "on_fp32_sde")):
        _, _, a, _ = load(bodies, sp)
        _, _, b, _ = load(bodies, whole)
        assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.latents, b.latents), sp
        for k, v in a.debug_tensors.as_dict().items():
            assert torch.equal(v, getattr(b.debug_tensors, k)), (sp, k)


def test_the_response_format_is_unchanged_and_sglangs_decoder_reads_it(bodies):
    """Same keys, envelope dtypes and shapes with and without the plugin (the subprocess also decoded the
    plugin's body with SGLang's own ``_maybe_deserialize``)."""
    import msgpack

    def layout(obj):
        if isinstance(obj, dict) and obj.get("__tensor__"):
            return ("tensor", obj["dtype"], tuple(obj["shape"]), type(obj["data"]).__name__)
        if isinstance(obj, dict):
            return {k: layout(v) for k, v in obj.items() if k not in ("inference_time_s",)}
        if isinstance(obj, list):
            return [layout(v) for v in obj]
        return type(obj).__name__

    for dtype in ("fp32", "bf16"):
        on = msgpack.unpackb((bodies / f"on_{dtype}_sde.msgpack").read_bytes())
        off = msgpack.unpackb((bodies / f"off_{dtype}_sde.msgpack").read_bytes())
        assert layout(on) == layout(off)
        assert layout(on)[0]["rollout_log_probs"] == ("tensor", "torch.float32", (5,), "bytes")


def test_the_seam_and_what_the_plugin_refuses(bodies):
    checks = json.loads((bodies / "checks.json").read_text())
    assert checks["default"] == "FlowRolloutController"
    assert checks["registered"] == [True, "FlowRLRolloutController"]
    assert checks["unregistered"] == [False, "FlowRolloutController"]
    assert checks["wrap"] == "FlowRLRolloutController"
    assert "cannot honour ode_transition" in checks["ode_transition"]
    assert checks["sde_type"].startswith("ValueError: rollout_sde_type must be one of")
    assert checks["not_a_controller"].startswith("TypeError: controller must be SGLang's FlowRolloutController")
    assert "set_timesteps ran again" in checks["reset"]


def test_without_sglang_the_plugin_says_what_it_needs(monkeypatch):
    import flowrl.compat.sglang as plugin

    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="needs SGLang's diffusion rollout engine"):
        plugin.register()


def test_the_docs_loop_on_the_engines_body_gives_ratio_one(bodies):
    """docs/replay.md's block for flowrl inside SGLang's engine, run as written on the released engine's
    bf16 body."""
    import re

    doc = (ROOT / "docs" / "replay.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "server's msgpack bytes" in b)
    cfg, body, _, _ = load(bodies, "on_bf16_sde")
    ratios = []
    namespace = {"flowrl": flowrl, "torch": torch, "body": body, "request": E.request_of(cfg),
                 "policy_velocity": lambda traj, j: velocity(cfg, traj, j)}
    code = code.replace("   # exactly 1 before the first update", "\n    ratios.append(ratio)")
    exec(compile(code, "docs/replay.md", "exec"), {**namespace, "ratios": ratios})
    assert len(ratios) == cfg["steps"] and all(torch.equal(r, torch.ones_like(r)) for r in ratios)


def test_what_the_docs_say_of_sglangs_own_loops():
    """docs/integration.md: the loops that build a rollout controller in sglang 0.5.23 (the generic
    denoising stage, Cosmos3's) take the default builder, which register() replaces, and none passes a
    model's own ode_transition (the one option the plugin refuses). Read from the installed package."""
    import re

    if not (SGLANG_DIR / ".flowrl-installed").exists():
        pytest.skip(f"sglang 0.5.23 is not installed in {SGLANG_DIR}")
    root = SGLANG_DIR / "sglang" / "multimodal_gen" / "runtime"
    calls = {}
    for path in root.rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"prepare_rollout_if_enabled\((.*?)\)", text, flags=re.S):
            if "def " not in text[max(0, m.start() - 4):m.start()]:
                calls.setdefault(path.relative_to(root).as_posix(), []).append(m.group(1))
        if path.name != "flow_rollout_controller.py":
            assert "ode_transition=" not in text, path
    assert sorted(calls) == ["pipelines_core/stages/denoising.py",
                             "pipelines_core/stages/model_specific_stages/cosmos3.py"]
    assert all("build_controller" not in args for found in calls.values() for args in found)
