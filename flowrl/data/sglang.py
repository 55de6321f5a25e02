"""SGLang ``POST /rollout/generate`` responses in and out of ``RolloutTrajectory``.

SGLang returns one response per sample (sgl-project/sglang,
python/sglang/multimodal_gen/runtime/entrypoints/post_training/rollout_api.py ``_build_response``, schema
``RolloutResponse`` in .../post_training/io_struct.py, dataclasses in
.../runtime/post_training/rl_dataclasses.py). Each batch tensor is sliced to the sample (dim 0 dropped,
``_extract_single_sample_tensor``), except the schedule, which is serialized once and never sliced:

    {"request_id", "prompt", "seed", "generated_output",
     "rollout_log_probs": <tensor float32 [T]>,
     "rollout_debug_tensors": {"rollout_variance_noises", "rollout_prev_sample_means",
                               "rollout_noise_std_devs", "rollout_model_outputs"} | None,
     "denoising_env": {"image_kwargs", "pos_cond_kwargs", "neg_cond_kwargs", "guidance"} | None,
     "dit_trajectory": {"latents": <[K, ...]>, "timesteps": <[K] (or [T] when K = T + 1)>,
                        "sigmas": <float32 [T + 1], post-shift, terminal 0>,
                        optional "latent_step_indices": <int [K]>} | None,
     "inference_time_s", "peak_memory_mb"}

Tensors are envelopes (``{"__tensor__": true, "data": <safetensors>, "shape", "dtype"}``,
flowrl.data.serialization): ``data`` is raw bytes in the released servers' msgpack bodies (sglang 0.5.20 to
0.5.23, ``entrypoints/post_training/utils._maybe_serialize``) and base64 text in JSON (the pull requests'
commits); both are read. The body may be given as the msgpack bytes themselves (decoded with the
``msgpack`` package, the ``flowrl-triton[sglang]`` extra), as its JSON text, or as the decoded list. The sampling settings are the
*request's* (``rollout_sde_type``, ``rollout_noise_level``, ``rollout_log_prob_no_const``,
``rollout_sde_step_indices``, ``rollout_return_step_indices``): pass the request (``request=``) or
responses that carry them (``to_sglang`` writes them into each response). A request's
``extra_sampling_params`` override its top-level ``rollout_*`` fields, as the server resolves them
(sgl-project/sglang commit 078e5e2a5227bb6af1727574bb6212f0afb25250, .../post_training/rollout_api.py
``_build_sampling_kwargs``: the top-level fields, ``update(extra_sampling_params)``, then every None
dropped, so a null override falls back to ``SamplingParams``' default, not to the top-level value).

Keys flowrl does not read inside ``dit_trajectory``, ``denoising_env`` and ``rollout_debug_tensors`` are
accepted when their value is null, and so are the ones SGLang forks add that flowrl ignores
(``IGNORED_KEYS``: ``dit_trajectory.model_timesteps``, ``denoising_env.sample_layout``); any other is
refused, named.

Which loop steps the K latents are: ``latent_step_indices`` when given, else the request's
``rollout_return_step_indices`` when the timesteps are not one per latent, else each of K timesteps matched
to the schedule's ``sigmas * num_train_timesteps`` (index T: the final latent, timestep 0), strictly
increasing; K = T + 1 latents with T (or T + 1) timesteps are all steps. Layouts: sglang 0.5.23 records the kept latents with their own timesteps
(``FlowRolloutController.record_trajectory_step``: K latents, K timesteps, the final latent's 0, no
``latent_step_indices``); the pull requests' commits sent ``latent_step_indices``. ``to_sglang(server=)``
writes either (``SERVERS``; default the newest).

A bf16 (or fp16) rollout on sglang 0.5.23: ``scheduler.step`` upcasts the sample to float32, so
``dit_trajectory.latents`` holds the float32 upcast of each step's input, which is the sample the model
consumed (the previous step's output rounded to the latents' dtype). SGLang's ``rollout_log_probs``
score the *unrounded* float32 sample ``mean + std * noise`` (``flow_sde_sampling``), which the response
carries only through its debug tensors: ``engine_prev_sample(traj, j)`` rebuilds it bit for bit, so
``traj.step_log_prob(j, v, prev_sample=engine_prev_sample(traj, j))`` scores what the engine scored.
With ``flowrl.compat.sglang`` enabled the engine records flowrl's log-prob of the emitted sample
instead, and ``traj.step_log_prob(j, v)`` reproduces it exactly.
"""
from __future__ import annotations

import json
from numbers import Integral, Real
from typing import Any, Dict, List, Optional

import torch

from ..core import _validate as V
from .debug import DebugTensors
from ..contract import Mode
from .serialization import DEFAULT_MAX_BYTES, from_wire, to_wire
from .trajectory import RolloutTrajectory

# rollout_sde_type -> flowrl mode; rollout_log_prob_no_const -> flowrl log_prob_kind (docs/contract.md)
SDE_TYPES = {mode.rules.sglang: mode.label for mode in Mode if mode.rules.sglang is not None}
SETTING_FIELDS = ("rollout_sde_type", "rollout_noise_level", "rollout_log_prob_no_const",
                  "rollout_sde_step_indices", "rollout_return_step_indices")
# SGLang's RolloutRequest defaults, which the server applies to a request that omits a field
REQUEST_DEFAULTS = {"rollout_sde_type": "sde", "rollout_noise_level": 0.7, "rollout_log_prob_no_const": False,
                    "rollout_sde_step_indices": None, "rollout_return_step_indices": None}
DEBUG_FIELDS = ("rollout_variance_noises", "rollout_prev_sample_means", "rollout_noise_std_devs",
                "rollout_model_outputs")
ENV_FIELDS = ("image_kwargs", "pos_cond_kwargs", "neg_cond_kwargs", "guidance")
DIT_FIELDS = ("latents", "timesteps", "sigmas", "latent_step_indices")
# to_sglang's response formats: the released server's (raw-bytes envelopes for msgpack; K timesteps, one per
# kept latent; no latent_step_indices) and the pull requests' commit's (base64 envelopes for JSON; T + 1
# timesteps and latent_step_indices)
SERVERS = ("0.5.23", "078e5e2a")
# keys SGLang forks add that flowrl accepts with any value and does not read
IGNORED_KEYS = {"dit_trajectory": ("model_timesteps",), "denoising_env": ("sample_layout",),
                "rollout_debug_tensors": ()}


class SGLangDenoisingEnv:
    """SGLang's ``denoising_env`` of each sample (the pipeline's conditioning kwargs, not per-step
    model calls), decoded, one dict per sample in batch order; ``to_sglang`` writes them back."""

    def __init__(self, samples: List[Optional[Dict[str, Any]]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)


def _fail(where: str, msg: str):
    raise ValueError(f"SGLang response {where}: {msg}")


def _tensor(obj: Any, where: str) -> torch.Tensor:
    if not isinstance(obj, torch.Tensor):
        _fail(where, f"must be a tensor envelope; got {type(obj).__name__}")
    return obj


def _is_msgpack(body) -> bool:
    """A msgpack body starts with an array or map marker; JSON text with '[', '{' or whitespace."""
    return len(body) > 0 and (body[0] in (0xdc, 0xdd, 0xde, 0xdf) or 0x80 <= body[0] <= 0x9f)


def decode_body(body: Any, max_bytes: Optional[int] = None) -> Any:
    """The body of ``POST /rollout/generate`` as the server sent it (msgpack bytes), decoded to the
    per-sample dicts (tensor envelopes left as they are) with the ``msgpack`` package."""
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError(f"body must be the response's bytes; got {type(body).__name__}")
    limit = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if len(body) > limit:
        raise ValueError(f"SGLang response: body of {len(body)} bytes exceeds max_bytes = {limit}")
    try:
        import msgpack
    except ImportError:
        raise ImportError("decoding SGLang's msgpack body needs the msgpack package (pip install msgpack, or "
                          "flowrl-triton[sglang]); or pass the decoded list") from None
    try:
        return msgpack.unpackb(bytes(body), raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"SGLang response: invalid msgpack body: {exc}") from None


def _parse(response: Any, max_bytes: int) -> List[Dict[str, Any]]:
    if isinstance(response, (bytes, bytearray, memoryview)) and _is_msgpack(bytes(response[:1])):
        response = decode_body(response, max_bytes)
    elif isinstance(response, (str, bytes, bytearray)):
        try:
            response = json.loads(response)
        except ValueError as exc:
            raise ValueError(f"SGLang response: invalid JSON: {exc}") from None
    if isinstance(response, dict):
        response = [response]
    if not isinstance(response, list) or not response:
        raise ValueError(f"SGLang response must be a dict, its JSON text or a non-empty list of per-sample dicts; "
                         f"got {type(response).__name__ if not isinstance(response, list) else 'an empty list'}")
    for i, r in enumerate(response):
        if not isinstance(r, dict):
            raise ValueError(f"SGLang response [{i}] must be a dict; got {type(r).__name__}")
    try:
        return from_wire(response, max_bytes=max_bytes)
    except ValueError as exc:
        raise ValueError(f"SGLang response: {exc}") from None


def _unknown_keys(obj: Dict[str, Any], known, group: str, where: str) -> None:
    """Refuse a key of ``obj`` (the response's ``group`` object) that flowrl neither reads nor ignores
    (IGNORED_KEYS), unless its value is null."""
    extra = sorted(k for k in set(obj) - set(known) - set(IGNORED_KEYS[group]) if obj[k] is not None)
    if extra:
        _fail(f"{where}['{extra[0]}']", f"unexpected keys {extra} with non-null values in {group} (flowrl reads "
              f"{list(known)}, ignores {list(IGNORED_KEYS[group])} and accepts any other key only when null)")


# the one setting that may differ between a batch's samples: each request's SDE steps (per-sample windows)
PER_SAMPLE_FIELD = "rollout_sde_step_indices"


def _settings(samples: List[Dict[str, Any]], request):
    """(settings, origin): the rollout settings and, per setting, the field it came from (for messages).
    ``settings[PER_SAMPLE_FIELD]`` is a list of one entry per sample when the samples' requests give
    different step sets (``request`` a list of per-sample requests, or responses carrying them)."""
    if isinstance(request, (list, tuple)):
        if len(request) != len(samples):
            raise ValueError(f"request as a list must hold one request per sample ({len(samples)}); got "
                             f"{len(request)}")
        parts = [_settings([s], r) for s, r in zip(samples, request)]
        settings, origin = dict(parts[0][0]), {k: v.replace("request[", "request[0][", 1) for k, v in parts[0][1].items()}
        for i, (other, _) in enumerate(parts[1:], 1):
            for k in SETTING_FIELDS:
                if k != PER_SAMPLE_FIELD and other[k] != settings[k]:
                    _fail(f"[{i}] {k}", f"{other[k]!r} (from request[{i}]) disagrees with request[0]'s {settings[k]!r}: "
                          f"of the rollout settings only {PER_SAMPLE_FIELD} may differ between a batch's requests")
        per = [other[PER_SAMPLE_FIELD] for other, _ in parts]
        if any(p != per[0] for p in per):
            settings[PER_SAMPLE_FIELD] = _PerSample(per)
            origin[PER_SAMPLE_FIELD] = f"request[b]['{PER_SAMPLE_FIELD}']"
        return settings, origin
    carried = [{k: s[k] for k in SETTING_FIELDS if k in s} for s in samples]
    if request is not None:
        if not isinstance(request, dict):
            raise TypeError(f"request must be the /rollout/generate request dict; got {type(request).__name__}")
        extra = request.get("extra_sampling_params")
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"request['extra_sampling_params'] must be an object or null; got {type(extra).__name__}")
        settings = {k: request.get(k, REQUEST_DEFAULTS[k]) for k in SETTING_FIELDS}
        origin = {k: f"request['{k}']" for k in SETTING_FIELDS}
        # the server's _build_sampling_kwargs: extra_sampling_params override, then None is dropped
        # (SamplingParams' default applies; its rollout defaults are RolloutRequest's)
        for k in SETTING_FIELDS:
            if extra and k in extra:
                settings[k] = REQUEST_DEFAULTS[k] if extra[k] is None else extra[k]
                origin[k] = f"request['extra_sampling_params']['{k}']"
        for i, c in enumerate(carried):
            for k, v in c.items():
                if v != settings[k]:
                    _fail(f"[{i}] {k}", f"{v!r} disagrees with the request's {settings[k]!r} (from {origin[k]})")
        return settings, origin
    if not carried[0]:
        raise ValueError(
            "SGLang response: rollout_sde_type, rollout_noise_level and rollout_log_prob_no_const are missing: "
            "SGLang's responses do not carry the sampling settings; pass request= (the /rollout/generate request "
            "dict) so the trajectory recomputes with the settings the rollout used"
        )
    def shared(c):
        return {k: v for k, v in c.items() if k != PER_SAMPLE_FIELD}

    for i, c in enumerate(carried):
        if shared(c) != shared(carried[0]):
            _fail(f"[{i}]", f"settings {c} disagree with sample 0's {carried[0]}")
    missing = [k for k in SETTING_FIELDS[:3] if k not in carried[0]]
    if missing:
        _fail("", f"missing {missing[0]}")
    settings, origin = {k: carried[0].get(k) for k in SETTING_FIELDS}, {k: k for k in SETTING_FIELDS}
    per = [c.get(PER_SAMPLE_FIELD) for c in carried]
    if any(p != per[0] for p in per):  # each response carries its own request's steps
        settings[PER_SAMPLE_FIELD] = _PerSample(per)
        origin[PER_SAMPLE_FIELD] = f"[b]['{PER_SAMPLE_FIELD}']"
    return settings, origin


class _PerSample(list):
    """One value per sample (a setting that differs between the samples' requests)."""


def _index_list(value, name: str) -> Optional[List[int]]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(v, Integral) and not isinstance(v, bool) for v in value):
        _fail(name, f"must be a list of ints or null; got {value!r}")
    return [int(v) for v in value]


def _step_indices(timesteps: torch.Tensor, sigmas: torch.Tensor, kept: int, num_train_timesteps: float,
                  where: str) -> torch.Tensor:
    """Loop step of each kept latent from its timestep, matched against sigmas * num_train_timesteps."""
    num_steps = sigmas.numel() - 1
    if timesteps.numel() in (num_steps, num_steps + 1) and kept == num_steps + 1:
        return torch.arange(kept, dtype=torch.int64)
    if timesteps.numel() != kept:
        _fail(f"{where}['timesteps']", f"has {timesteps.numel()} entries for {kept} latents (K latents need K "
              f"timesteps, T = {num_steps} timesteps with K = T + 1, or latent_step_indices / the request's "
              "rollout_return_step_indices naming the kept steps)")
    table = (sigmas.float() * num_train_timesteps).double()
    gaps = (table[:-1] - table[1:]).abs()
    t = timesteps.double()
    dist = (t[:, None] - table[None, :]).abs()
    best = dist.argmin(dim=1)
    ok = dist.gather(1, best[:, None])[:, 0] < 0.5 * float(gaps.min())
    if not bool(ok.all()):
        bad = int((~ok).nonzero()[0])
        _fail(f"{where}['timesteps']", f"entry {bad} ({float(t[bad])}) matches no step of the schedule "
              f"sigmas * {num_train_timesteps} (a num_train_timesteps other than {num_train_timesteps}?)")
    if kept > 1 and not bool((best[1:] > best[:-1]).all()):
        _fail(f"{where}['timesteps']", f"map to loop steps {best.tolist()}, not strictly increasing")
    return best.to(torch.int64)


def from_sglang(response: Any, *, request: Optional[Dict[str, Any]] = None, num_train_timesteps: float = 1000.0,
                max_bytes: Optional[int] = None, device=None, reduction: str = "mean"):
    """A batch ``RolloutTrajectory`` from SGLang ``/rollout/generate`` response(s): the body as the
    server sent it (msgpack bytes), one per-sample response dict, its JSON text, or the list of
    per-sample responses (batch order; tensor envelopes with raw-bytes or base64 ``data``). Strict: anything
    missing, inconsistent or malformed raises ``ValueError`` naming the field. ``request``: the request
    dict whose ``rollout_*`` settings the rollout used (needed unless the responses carry them), or a
    list of one request per sample (the batch gathered from several requests). Per-request SDE steps:
    when the samples' ``rollout_sde_step_indices`` differ (per-sample requests, or responses carrying
    their own, as ``to_sglang`` writes them), the trajectory records them as its per-sample
    ``sde_mask`` (a null entry: every step); every other setting must agree.
    ``reduction``: SGLang averages the per-element log-prob ("mean")."""
    samples = _parse(response, DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
    settings, origin = _settings(samples, request)
    sde_type = settings["rollout_sde_type"]
    if sde_type not in SDE_TYPES:
        _fail(origin["rollout_sde_type"], f"must be one of {sorted(SDE_TYPES)}; got {sde_type!r}")
    noise_level = settings["rollout_noise_level"]
    if isinstance(noise_level, bool) or not isinstance(noise_level, Real):
        _fail(origin["rollout_noise_level"], f"must be a number; got {noise_level!r}")
    if not isinstance(settings["rollout_log_prob_no_const"], bool):
        _fail(origin["rollout_log_prob_no_const"], f"must be a bool; got {settings['rollout_log_prob_no_const']!r}")
    log_prob_kind = "sq_err" if settings["rollout_log_prob_no_const"] else "gaussian"
    per_sample = settings[PER_SAMPLE_FIELD] if isinstance(settings[PER_SAMPLE_FIELD], _PerSample) else None
    sde_steps = None if per_sample is not None else _index_list(settings[PER_SAMPLE_FIELD], origin[PER_SAMPLE_FIELD])
    sde_rows = None if per_sample is None else [
        _index_list(v, origin[PER_SAMPLE_FIELD].replace("[b]", f"[{b}]")) for b, v in enumerate(per_sample)]
    return_steps = _index_list(settings["rollout_return_step_indices"], origin["rollout_return_step_indices"])

    latents, log_probs, envs, debug_rows = [], [], [], []
    schedule = None
    for i, s in enumerate(samples):
        where = f"[{i}]"
        dit = s.get("dit_trajectory")
        if not isinstance(dit, dict):
            _fail(f"{where}['dit_trajectory']", "is missing: request rollout_return_dit_trajectory=True")
        _unknown_keys(dit, DIT_FIELDS, "dit_trajectory", f"{where}['dit_trajectory']")
        for key in ("latents", "timesteps", "sigmas"):
            if dit.get(key) is None:
                _fail(f"{where}['dit_trajectory']['{key}']", "is missing")
        lat = _tensor(dit["latents"], f"{where}['dit_trajectory']['latents']")
        ts = _tensor(dit["timesteps"], f"{where}['dit_trajectory']['timesteps']")
        sig = _tensor(dit["sigmas"], f"{where}['dit_trajectory']['sigmas']")
        if not lat.dtype.is_floating_point or lat.dim() < 1:
            _fail(f"{where}['dit_trajectory']['latents']", f"must be a float tensor [K, ...]; got {lat.dtype} {tuple(lat.shape)}")
        if ts.dim() != 1 or ts.dtype == torch.bool:
            _fail(f"{where}['dit_trajectory']['timesteps']", f"must be 1-D numeric; got {ts.dtype} {tuple(ts.shape)}")
        try:
            sig = V.check_sigmas(sig, sig.device)
        except (ValueError, TypeError) as exc:
            _fail(f"{where}['dit_trajectory']['sigmas']", str(exc))
        if schedule is None:
            schedule = (sig, ts, dit.get("latent_step_indices"))
        else:
            if not (sig.dtype == schedule[0].dtype and torch.equal(sig, schedule[0])):
                _fail(f"{where}['dit_trajectory']['sigmas']", "differs from sample 0's: per-sample schedules disagree")
            if not (ts.dtype == schedule[1].dtype and ts.shape == schedule[1].shape and torch.equal(ts, schedule[1])):
                _fail(f"{where}['dit_trajectory']['timesteps']", "differ from sample 0's: per-sample schedules disagree")
        lp = _tensor(s.get("rollout_log_probs"), f"{where}['rollout_log_probs']")
        if lp.dtype != torch.float32 or tuple(lp.shape) != (sig.numel() - 1,):
            _fail(f"{where}['rollout_log_probs']", f"must be float32 [T] = [{sig.numel() - 1}]; got {lp.dtype} {tuple(lp.shape)}")
        if not bool(torch.isfinite(lp).all()):
            bad = (~torch.isfinite(lp)).nonzero()[:, 0].tolist()
            _fail(f"{where}['rollout_log_probs']", f"is {float(lp[bad[0]])} at loop step {bad[0]} (non-finite at steps "
                  f"{bad} of T = {lp.numel()}): no ratio can be formed against it (SGLang's gaussian log-prob divides by "
                  "the step's std, which is 0 at the last cps step)")
        if latents and (lat.shape != latents[0].shape or lat.dtype != latents[0].dtype):
            _fail(f"{where}['dit_trajectory']['latents']", f"{lat.dtype} {tuple(lat.shape)} differs from sample 0's "
                  f"{latents[0].dtype} {tuple(latents[0].shape)}")
        latents.append(lat)
        log_probs.append(lp)
        env = s.get("denoising_env")
        if env is not None and not isinstance(env, dict):
            _fail(f"{where}['denoising_env']", f"must be null or an object with keys {list(ENV_FIELDS)}")
        if env is not None:
            _unknown_keys(env, ENV_FIELDS, "denoising_env", f"{where}['denoising_env']")
        envs.append(env)
        dbg = s.get("rollout_debug_tensors")
        if dbg is not None:
            if not isinstance(dbg, dict) or not set(DEBUG_FIELDS) <= set(dbg):
                _fail(f"{where}['rollout_debug_tensors']", f"must be null or an object with keys {list(DEBUG_FIELDS)}")
            _unknown_keys(dbg, DEBUG_FIELDS, "rollout_debug_tensors", f"{where}['rollout_debug_tensors']")
            for k in DEBUG_FIELDS:
                _tensor(dbg[k], f"{where}['rollout_debug_tensors']['{k}']")
        debug_rows.append(dbg)

    sigmas, timesteps, given_steps = schedule
    num_steps, kept = sigmas.numel() - 1, int(latents[0].shape[0])
    # step filters checked against the schedule here, so a bad entry is named, not found later as a bad index
    # (per-request SDE steps: each sample's row, named by its own field)
    for field, values, upper, what in (
            (origin["rollout_return_step_indices"], return_steps, num_steps,
             "loop steps 0..T - 1 and T, the final latent"),
            (origin[PER_SAMPLE_FIELD], sde_steps, num_steps - 1, "loop steps 0..T - 1"),
            *((origin[PER_SAMPLE_FIELD].replace("[b]", f"[{b}]"), row, num_steps - 1, "loop steps 0..T - 1")
              for b, row in enumerate(sde_rows or ()))):
        for v in values or ():
            if v < 0 or v > upper:
                _fail(field, f"entry {v} is outside [0, {upper}]: the response's schedule (dit_trajectory.sigmas, "
                      f"T + 1 = {num_steps + 1} values) has T = {num_steps} steps, and the entries name {what}")
    if given_steps is not None:
        steps = _tensor(given_steps, "[0]['dit_trajectory']['latent_step_indices']")
        for i, s in enumerate(samples[1:], 1):
            other = s["dit_trajectory"].get("latent_step_indices")
            if other is None or not torch.equal(other, steps):
                _fail(f"[{i}]['dit_trajectory']['latent_step_indices']", "differs from sample 0's")
        if steps.dtype.is_floating_point or steps.dtype == torch.bool or steps.dim() != 1 or steps.numel() != kept:
            _fail("[0]['dit_trajectory']['latent_step_indices']", f"must be 1-D integer of length K = {kept}")
        steps = steps.to(torch.int64)
    elif return_steps is not None and len(set(return_steps)) == kept and timesteps.numel() != kept:
        # the request names the kept steps; the timesteps are not one per latent to check them against
        steps = torch.tensor(sorted(set(return_steps)), dtype=torch.int64)
    else:
        steps = _step_indices(timesteps, sigmas, kept, num_train_timesteps, "[0]['dit_trajectory']")
    if return_steps is not None and steps.tolist() != sorted(set(return_steps)):
        _fail("[0]['dit_trajectory']['latents']", f"hold loop steps {steps.tolist()} but rollout_return_step_indices "
              f"is {return_steps}")
    # the trajectory's timesteps are the loop's T timesteps: the response's when it sends all of them
    if timesteps.numel() == num_steps:
        loop_timesteps = timesteps
    elif timesteps.numel() == num_steps + 1:
        loop_timesteps = timesteps[:num_steps]
    else:  # filtered: the schedule's own values, as the scheduler computes them
        loop_timesteps = (sigmas[:num_steps].float() * num_train_timesteps).to(timesteps.dtype)
    if any(d is not None for d in debug_rows) and any(d is None for d in debug_rows):
        _fail("rollout_debug_tensors", "present for some samples and missing for others")
    debug = None
    if debug_rows[0] is not None:
        try:
            debug = DebugTensors(**{k: torch.stack([d[k] for d in debug_rows]) for k in DEBUG_FIELDS})
        except RuntimeError as exc:
            _fail("rollout_debug_tensors", f"per-sample shapes disagree: {exc}")
    tensors = {"latents": torch.stack(latents), "log_probs": torch.stack(log_probs), "timesteps": loop_timesteps,
               "sigmas": sigmas, "latent_step_indices": steps}
    if sde_steps is not None:
        tensors["sde_steps"] = torch.tensor(sorted(set(sde_steps)), dtype=torch.int64)
    if sde_rows is not None:  # per-request steps (None: every step, SGLang's default) as the per-sample mask
        mask = torch.zeros(len(sde_rows), num_steps, dtype=torch.bool)
        for b, row in enumerate(sde_rows):
            mask[b, list(range(num_steps)) if row is None else row] = True
        if bool((mask == mask[:1]).all()):  # one set written two ways (null, every step): the batch-wide form
            tensors["sde_steps"] = mask[0].nonzero().flatten()
        else:
            tensors["sde_mask"] = mask
    traj = RolloutTrajectory._checked(
        tensors, {"mode": SDE_TYPES[sde_type], "noise_level": float(noise_level), "log_prob": log_prob_kind,
                  "reduction": reduction}, "SGLang response", device)
    traj.denoising_env = SGLangDenoisingEnv(envs) if any(e is not None for e in envs) else None
    traj.debug_tensors = debug
    return traj


def to_sglang(traj, *, server: str = SERVERS[0], wire: bool = True, **fields) -> List[Dict[str, Any]]:
    """Per-sample response dicts in the structure ``server`` sends (``SERVERS``, see the module doc), with
    the sampling settings added so ``from_sglang`` needs no request. ``fields`` (e.g. ``request_id``,
    ``prompt``, ``seed``) are copied into every response. ``wire=True`` encodes tensors as envelopes:
    raw bytes for "0.5.23" (what its msgpack body carries: ``msgpack.packb(responses)`` is such a body),
    base64 text for "078e5e2a" (JSON-safe). The latents keep the trajectory's dtype."""
    if server not in SERVERS:
        raise ValueError(f"server must be one of {list(SERVERS)}; got {server!r}")
    V.check_bool("wire", wire)
    if traj.mode not in SDE_TYPES.values():
        raise ValueError(f"SGLang has no rollout_sde_type for mode {traj.mode!r} (it knows {sorted(SDE_TYPES)})")
    if traj.reduction != "mean":
        raise ValueError(f"SGLang's log-probs are per-element means; this trajectory's reduction is {traj.reduction!r}")
    steps = traj.latent_step_indices.to("cpu")
    num_steps = traj.num_steps
    # every loop step's timestep and the final latent's (0)
    all_timesteps = torch.cat([traj.timesteps.to("cpu"), traj.timesteps.new_zeros(1).to("cpu")])
    settings = {
        "rollout_sde_type": traj.mode, "rollout_noise_level": float(traj.noise_level),
        "rollout_log_prob_no_const": traj.log_prob_kind == "sq_err",
        "rollout_sde_step_indices": None if traj.sde_steps is None else traj.sde_steps.tolist(),
        "rollout_return_step_indices": None if steps.numel() == num_steps + 1 else steps.tolist(),
    }
    if server == "0.5.23":  # the kept latents' own timesteps (record_trajectory_step), no step indices
        dit = {"timesteps": all_timesteps[steps]}
    else:
        dit = {"timesteps": all_timesteps, "latent_step_indices": steps}
    env = traj.denoising_env
    out = []
    for i in range(traj.batch_size):
        response = dict(fields)
        response.update(settings)
        if traj.sde_mask is not None:  # per-sample windows: each sample's request steps
            response[PER_SAMPLE_FIELD] = traj.sde_mask[i].nonzero().flatten().tolist()
        response["rollout_log_probs"] = traj.log_probs[i]
        response["dit_trajectory"] = {"latents": traj.latents[i], **dit, "sigmas": traj.sigmas}
        # flowrl's recorded per-step calls (DenoisingEnv) have no SGLang counterpart: null (docs/replay.md)
        response["denoising_env"] = env.samples[i] if isinstance(env, SGLangDenoisingEnv) else None
        debug = traj.debug_tensors
        response["rollout_debug_tensors"] = (None if debug is None else
                                             {k: getattr(debug, k)[i] for k in DEBUG_FIELDS})
        out.append(to_wire(response, raw_bytes=server == "0.5.23") if wire else response)
    return out


def engine_prev_sample(traj, j: int) -> torch.Tensor:
    """The sample SGLang's own engine scored at loop step ``j``: ``mean + noise * std`` in float32, as
    ``FlowRolloutController.flow_sde_sampling`` formed it before ``scheduler.step`` rounded it to the
    latents' dtype, rebuilt bit for bit from the response's debug tensors (``rollout_debug_mode``, on
    by default in sglang 0.5.23). Pass it as ``traj.step_log_prob(j, v, prev_sample=...)`` to score what
    ``rollout_log_probs`` scored; in a float32 rollout it equals ``latents[:, j + 1]``."""
    debug = traj.debug_tensors
    if debug is None:
        raise ValueError("engine_prev_sample needs the response's rollout_debug_tensors (request "
                         "rollout_debug_mode=True): the unrounded sample SGLang scored is not in the latents")
    if isinstance(j, bool) or not isinstance(j, Integral) or not 0 <= j < traj.num_steps:
        raise ValueError(f"j must be a loop step in [0, {traj.num_steps - 1}]; got {j!r}")
    mean = debug.rollout_prev_sample_means[:, j]
    noise = debug.rollout_variance_noises[:, j]
    std = debug.rollout_noise_std_devs[:, j].reshape(mean.shape[0], *([1] * (mean.dim() - 1)))
    return mean + noise * std


__all__ = ["from_sglang", "to_sglang", "decode_body", "engine_prev_sample", "SGLangDenoisingEnv", "SDE_TYPES",
           "REQUEST_DEFAULTS", "IGNORED_KEYS", "SERVERS"]
