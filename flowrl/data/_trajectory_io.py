"""The wire and file formats of a ``flowrl.data.trajectory.RolloutTrajectory``: the format tags and field
tables, ``to_wire`` / ``from_wire`` (a JSON-safe dict of SGLang tensor envelopes), ``save`` / ``load`` (a
safetensors file with per-tensor and metadata checksums), and the strict check that builds a trajectory
from untrusted parts. ``RolloutTrajectory``'s methods of those names delegate here; ``FORMAT`` and
``FILE_FORMAT`` are re-exported by ``flowrl.data.trajectory``."""
from __future__ import annotations

import hashlib
import json
from numbers import Real
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..contract import Mode, ModeRules, Schedule
from ..core import _validate as V
from ..core.step_spec import ddim_options
from ..ops.functional import check_stream_weights
from .serialization import DEFAULT_MAX_BYTES, from_wire, load_safetensors, save_safetensors, to_wire
from .tree import BranchTree

# identifies the wire dict and the safetensors file; bump the version when the layout changes.
# /2 adds token_sigmas, frozen, counts and streams (all optional); /1 payloads and files still load.
# A branching rollout's tree (flowrl.data.tree) adds the key "tree" (files: tensors "tree.<field>"),
# present only when there is a tree, so a /2 payload without one is unchanged. Per-sample SDE windows add the
# tensor "sde_mask" (bool [B, T]; docs/wire_and_sp.md) the same way: present only when recorded.
FORMAT = "flowrl.RolloutTrajectory/2"
FORMAT_V1 = "flowrl.RolloutTrajectory/1"
# files only: /2 plus the metadata key "checksums" (a digest of every tensor's bytes, dtype and shape, and
# one of the other metadata), verified on load; /2 and /1 files (written before) load without it
FILE_FORMAT = "flowrl.RolloutTrajectory/3"
_TENSOR_FIELDS = ("latents", "log_probs", "timesteps", "sigmas", "latent_step_indices")
# /2 adds the last four (prev_x0_preds: dpm_sde's second order)
_OPTIONAL_TENSORS = ("sde_steps", "token_sigmas", "frozen", "counts", "prev_x0_preds")
_SETTING_FIELDS = ("mode", "noise_level", "log_prob", "reduction")  # the keys in payloads and files
# a key's attribute where they differ: the formats keep "log_prob" for the kind (a renamed key would be a new
# format); the attribute says what it is, beside the log_probs tensor
_ATTRIBUTES = {"log_prob": "log_prob_kind"}


_DDIM_FIELDS = ("prediction_type", "clip_sample_range")  # mode='ddim' settings (keys only for ddim)


def _attr(key: str) -> str:
    return _ATTRIBUTES.get(key, key)


def _rules(mode) -> Optional[ModeRules]:
    """The mode table's row (``contract.MODE_RULES``) for the label ``mode``; None when ``mode`` names
    no mode (an untrusted payload's, which its checks reject)."""
    return Mode[mode.upper()].rules if isinstance(mode, str) and mode in Mode.labels() else None


def _alpha_bar(mode) -> bool:
    """Whether ``mode``'s ``sigmas`` is an alpha-bar table (ddim): a pair per step, not T + 1 sigmas."""
    rules = _rules(mode)
    return rules is not None and rules.schedule is Schedule.ALPHA_BAR


def _has_ddim_fields(mode) -> bool:
    """Whether ``mode`` reads the settings ``_DDIM_FIELDS`` (ddim's prediction type and clip range)."""
    rules = _rules(mode)
    return rules is not None and set(_DDIM_FIELDS) <= set(rules.extra_inputs)


def _reads_prev_x0(mode) -> bool:
    """Whether ``mode`` reads the previous step's data prediction (dpm_sde at order 2)."""
    rules = _rules(mode)
    return rules is not None and "prev_x0_pred" in rules.extra_inputs


def trajectory_to_wire(traj) -> Dict[str, Any]:
    """``RolloutTrajectory.to_wire``: a JSON-safe dict (a joint rollout's ``streams`` as a list of such)."""
    wire = to_wire(traj._tensors())
    for name in _OPTIONAL_TENSORS:
        wire[name] = wire.get(name)
    wire.update({key: getattr(traj, _attr(key)) for key in _SETTING_FIELDS})
    wire["noise_level"] = float(traj.noise_level)
    if _has_ddim_fields(traj.mode):
        wire.update({name: getattr(traj, name) for name in _DDIM_FIELDS})
    wire["streams"] = None if traj.streams is None else [s.to_wire() for s in traj.streams]
    if traj.stream_weights is not None:  # the key only when weighted: an unweighted payload is unchanged
        wire["stream_weights"] = list(traj.stream_weights)
    if traj.tree is not None:
        wire["tree"] = to_wire(traj.tree.to_tensors())
    wire["format"] = FORMAT
    return wire


def trajectory_from_wire(cls, wire: Any, *, max_bytes: Optional[int], device, where: str, nested: bool):
    """``RolloutTrajectory.from_wire``: decode ``wire`` strictly into a ``cls`` (``where`` names it in errors;
    ``nested``: a joint rollout's stream payload, which holds no streams, tree or weights)."""
    if not isinstance(wire, dict):
        raise ValueError(f"{where} must be an object; got {type(wire).__name__}")
    version = wire.get("format")
    if version not in (FORMAT, FORMAT_V1):
        raise ValueError(f"{where}: format must be {FORMAT!r} (or {FORMAT_V1!r}); got {version!r}")
    optional = ("sde_steps",) if version == FORMAT_V1 else _OPTIONAL_TENSORS
    expected = set(_TENSOR_FIELDS) | set(_SETTING_FIELDS) | set(optional) | {"format"}
    if version == FORMAT:
        expected.add("streams")
        if "sde_mask" in wire:
            expected.add("sde_mask")
        if "tree" in wire and not nested:
            expected.add("tree")
        if "stream_weights" in wire and not nested:
            expected.add("stream_weights")
    if _has_ddim_fields(wire.get("mode")):
        expected |= set(_DDIM_FIELDS)
    if set(wire) != expected:
        raise ValueError(
            f"{where}: missing keys {sorted(expected - set(wire))}, unexpected keys {sorted(set(wire) - expected)}"
        )
    tensor_names = list(_TENSOR_FIELDS) + [name for name in optional if wire[name] is not None]
    if "sde_mask" in expected:
        tensor_names.append("sde_mask")
    for name in tensor_names:
        if not isinstance(wire[name], dict) or wire[name].get("__tensor__") is not True:
            raise ValueError(f"{where}: {name} must be a tensor envelope")
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    tensors = from_wire({name: wire[name] for name in tensor_names}, max_bytes=max_bytes)
    settings = {name: wire[name] for name in _SETTING_FIELDS + _DDIM_FIELDS if name in wire}
    streams = None
    if wire.get("streams") is not None:
        if nested or not isinstance(wire["streams"], list) or len(wire["streams"]) < 2:
            raise ValueError(f"{where}: streams must be null or a list of at least 2 stream payloads (not nested)")
        streams = tuple(
            cls.from_wire(w, max_bytes=max_bytes, device=device, _where=f"{where}: streams[{k}]", _nested=True)
            for k, w in enumerate(wire["streams"])
        )
    tree = None
    if "tree" in expected:
        envelopes = wire["tree"]
        if not isinstance(envelopes, dict) or not all(
                isinstance(e, dict) and e.get("__tensor__") is True for e in envelopes.values()):
            raise ValueError(f"{where}: tree must be an object of tensor envelopes")
        tree = from_wire(envelopes, max_bytes=max_bytes)
    weights = wire.get("stream_weights") if "stream_weights" in expected else None
    if "stream_weights" in expected and not isinstance(weights, list):
        raise ValueError(f"{where}: stream_weights must be a list of numbers (one per stream)")
    return cls._checked(tensors, settings, where, device, streams, tree, weights)


def save_trajectory(traj, path) -> None:
    """``RolloutTrajectory.save``: write ``traj`` as a format /3 safetensors file (with checksums)."""
    metadata = {key: str(getattr(traj, _attr(key))) for key in ("mode", "log_prob", "reduction")}
    metadata["noise_level"] = repr(float(traj.noise_level))  # repr round-trips a float exactly
    if _has_ddim_fields(traj.mode):  # JSON: None and a float round-trip exactly
        metadata.update({name: json.dumps(getattr(traj, name)) for name in _DDIM_FIELDS})
    metadata["format"] = FORMAT
    metadata["streams"] = str(traj.num_streams if traj.streams is not None else 0)
    tensors = traj._tensors()
    for k, stream in enumerate(traj.streams or ()):
        tensors.update({f"streams.{k}.{name}": t for name, t in stream._tensors().items()})
    if traj.tree is not None:
        tensors.update({f"tree.{name}": t for name, t in traj.tree.to_tensors().items()})
    if traj.stream_weights is not None:  # JSON: a float round-trips exactly
        metadata["stream_weights"] = json.dumps(list(traj.stream_weights))
    metadata["format"] = FILE_FORMAT
    metadata["checksums"] = json.dumps(_checksums(tensors, metadata))
    save_safetensors(path, tensors, metadata)


def load_trajectory(cls, path, *, max_bytes: Optional[int], device):
    """``RolloutTrajectory.load``: read a file written by ``save`` (format /3; /2 and /1 files too) into a ``cls``."""
    where = f"RolloutTrajectory file {str(path)!r}"
    try:
        tensors, metadata = load_safetensors(path, max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
    except ValueError as exc:
        raise ValueError(f"{where}: not a readable flowrl trajectory file: {exc}") from None
    version = metadata.get("format")
    if version == FILE_FORMAT:
        _verify_checksums(tensors, metadata, where)
        metadata = {k: v for k, v in metadata.items() if k != "checksums"}
        version = metadata["format"] = FORMAT
    elif version not in (FORMAT, FORMAT_V1):
        raise ValueError(f"{where}: metadata format must be {FILE_FORMAT!r} (or the older {FORMAT!r}, "
                         f"{FORMAT_V1!r}); got {version!r}: not a flowrl trajectory file")
    ddim_keys = set(_DDIM_FIELDS) if _has_ddim_fields(metadata.get("mode")) else set()
    expected = set(_SETTING_FIELDS) | {"format"} | ddim_keys
    optional_keys = {"streams", "stream_weights"}
    if set(metadata) - optional_keys != expected or (version == FORMAT_V1 and optional_keys & set(metadata)):
        extra = " plus optional 'streams', 'stream_weights'" if version == FORMAT else ""
        raise ValueError(f"{where}: metadata keys must be {sorted(expected)}{extra}; got {sorted(metadata)}")
    num_streams = 0
    if "streams" in metadata:
        if not metadata["streams"].isdigit() or int(metadata["streams"]) == 1 or int(metadata["streams"]) > 64:
            raise ValueError(f"{where}: metadata streams must be 0 or a count in [2, 64]; got {metadata['streams']!r}")
        num_streams = int(metadata["streams"])
    optional = {"sde_steps"} if version == FORMAT_V1 else set(_OPTIONAL_TENSORS)
    allowed = set(_TENSOR_FIELDS) | optional | ({"sde_mask"} if version == FORMAT else set())
    groups: List[Dict[str, torch.Tensor]] = [dict() for _ in range(num_streams + 1)]
    tree = None
    if version == FORMAT and any(name.startswith("tree.") for name in tensors):
        tree = {name[5:]: tensors.pop(name) for name in list(tensors) if name.startswith("tree.")}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "streams" and parts[1].isdigit() and int(parts[1]) < num_streams:
            groups[1 + int(parts[1])][parts[2]] = t
        else:
            groups[0][name] = t
    for k, group in enumerate(groups):
        if not set(_TENSOR_FIELDS) <= set(group) <= allowed:
            label = "tensors" if k == 0 else f"stream {k - 1} tensors"
            raise ValueError(
                f"{where}: {label} must be {sorted(_TENSOR_FIELDS)} plus optional {sorted(optional)}; got "
                f"{sorted(group)}"
            )
    try:
        noise_level = float(metadata["noise_level"])
    except ValueError:
        raise ValueError(f"{where}: noise_level {metadata['noise_level']!r} is not a number") from None
    settings = {name: metadata[name] for name in ("mode", "log_prob", "reduction")}
    settings["noise_level"] = noise_level
    for name in _DDIM_FIELDS:
        if name in metadata:
            try:
                settings[name] = json.loads(metadata[name])
            except ValueError:
                raise ValueError(f"{where}: {name} {metadata[name]!r} is not JSON") from None
    streams = None
    if num_streams:
        streams = tuple(
            cls._checked(g, dict(settings, reduction="sum"), f"{where}: stream {k}", device)
            for k, g in enumerate(groups[1:])
        )
    weights = None
    if "stream_weights" in metadata:
        try:
            weights = json.loads(metadata["stream_weights"])
        except ValueError:
            raise ValueError(f"{where}: stream_weights {metadata['stream_weights']!r} is not JSON") from None
        if not isinstance(weights, list):
            raise ValueError(f"{where}: stream_weights must be a list of numbers (one per stream)")
    return cls._checked(groups[0], settings, where, device, streams, tree, weights)


def checked_trajectory(cls, tensors: Dict[str, torch.Tensor], settings: Dict[str, Any], where: str, device,
                       streams: Optional[Tuple[Any, ...]] = None, tree: Optional[Dict[str, torch.Tensor]] = None,
                       stream_weights: Optional[list] = None):
    """``RolloutTrajectory._checked``: build a ``cls`` from untrusted parts, checking what the fields' docs
    promise."""
    mode, noise_level = settings["mode"], settings["noise_level"]
    try:
        V.check_choice("mode", mode, V.MODES)
        V.check_choice("log_prob", settings["log_prob"], V.LOG_PROB_KINDS)
        V.check_choice("reduction", settings["reduction"], V.REDUCTIONS)
        if isinstance(noise_level, bool) or not isinstance(noise_level, Real):
            raise ValueError(f"noise_level must be a number; got {noise_level!r}")
        noise_level = V.check_noise_level(noise_level, mode)
        ddim = ddim_options(mode, settings.get("prediction_type"), settings.get("clip_sample_range"))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None

    latents, log_probs = tensors["latents"], tensors["log_probs"]
    timesteps, sigmas, steps = tensors["timesteps"], tensors["sigmas"], tensors["latent_step_indices"]
    sde_steps = tensors.get("sde_steps")
    token_sigmas, frozen, counts = tensors.get("token_sigmas"), tensors.get("frozen"), tensors.get("counts")

    def fail(msg: str):
        raise ValueError(f"{where}: {msg}")

    try:
        if _alpha_bar(mode):
            sigmas = V.check_alpha_bar_table(sigmas, sigmas.device,
                                             allow_zero_alpha=ddim["prediction"].label != "epsilon")
        else:
            sigmas = V.check_sigmas(sigmas, sigmas.device)
    except (ValueError, TypeError) as exc:
        fail(str(exc))
    num_steps = sigmas.numel() // 2 if _alpha_bar(mode) else sigmas.numel() - 1
    if not latents.dtype.is_floating_point or latents.dim() < 2:
        fail(f"latents must be a float tensor [B, K, ...]; got {latents.dtype} {tuple(latents.shape)}")
    batch, kept = latents.shape[0], latents.shape[1]
    if log_probs.dtype != torch.float32 or tuple(log_probs.shape) != (batch, num_steps):
        fail(f"log_probs must be float32 [B, T] = [{batch}, {num_steps}]; got {log_probs.dtype} "
             f"{tuple(log_probs.shape)}")
    if timesteps.dim() != 1 or timesteps.numel() != num_steps or timesteps.dtype == torch.bool:
        fail(f"timesteps must be 1-D numeric of length T = {num_steps}; got {timesteps.dtype} {tuple(timesteps.shape)}")
    if counts is not None and (counts.dtype != torch.float32 or tuple(counts.shape) != (batch, num_steps)):
        fail(f"counts must be float32 [B, T] = [{batch}, {num_steps}]; got {counts.dtype} {tuple(counts.shape)}")
    latent = latents.shape[2:]

    def broadcasts(t: torch.Tensor, lead: tuple) -> bool:
        return (t.dim() == len(lead) + len(latent) and tuple(t.shape[:len(lead)]) == lead
                and all(d in (1, s) for d, s in zip(t.shape[len(lead):], latent)))

    if token_sigmas is not None:
        if token_sigmas.dtype != torch.float32 or not broadcasts(token_sigmas, (batch, num_steps)):
            fail(f"token_sigmas must be float32 [B, T, ...] broadcastable to a latent {tuple(latent)}; got "
                 f"{token_sigmas.dtype} {tuple(token_sigmas.shape)}")
        lo, hi = (float(token_sigmas.min()), float(token_sigmas.max())) if token_sigmas.numel() else (0.0, 0.0)
        if not (0.0 <= lo and hi <= 1.0):
            fail(f"token_sigmas must lie in [0, 1]; got values in [{lo}, {hi}]")
    if frozen is not None and (frozen.dtype != torch.bool or not broadcasts(frozen, (batch,))):
        fail(f"frozen must be bool [B, ...] broadcastable to a latent {tuple(latent)}; got {frozen.dtype} "
             f"{tuple(frozen.shape)}")

    def check_index(name: str, t: torch.Tensor, length: Optional[int], upper: int):
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1:
            fail(f"{name} must be a 1-D integer tensor; got {t.dtype} {tuple(t.shape)}")
        if length is not None and t.numel() != length:
            fail(f"{name} must have length {length}; got {t.numel()}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > upper):
            fail(f"{name} values must lie in [0, {upper}]")
        return t.to(torch.int64)

    steps = check_index("latent_step_indices", steps, kept, num_steps)
    if sde_steps is not None:
        sde_steps = check_index("sde_steps", sde_steps, None, num_steps - 1)
    sde_mask = tensors.get("sde_mask")
    if sde_mask is not None:
        if sde_mask.dtype != torch.bool or tuple(sde_mask.shape) != (batch, num_steps):
            fail(f"sde_mask must be bool [B, T] = [{batch}, {num_steps}]; got {sde_mask.dtype} {tuple(sde_mask.shape)}")
        if sde_steps is not None:
            fail("sde_mask (per-sample SDE steps) and sde_steps (one set for the batch) are exclusive")
    prev_x0_preds = tensors.get("prev_x0_preds")
    if prev_x0_preds is not None and (
            prev_x0_preds.dtype not in (torch.float32, torch.float64)
            or tuple(prev_x0_preds.shape) != (batch, num_steps) + tuple(latents.shape[2:])):
        fail(f"prev_x0_preds must be float32 (float64) [B, T, ...] = {[batch, num_steps, *latents.shape[2:]]}; got "
             f"{prev_x0_preds.dtype} {tuple(prev_x0_preds.shape)}")
    if prev_x0_preds is not None and not _reads_prev_x0(mode):
        fail(f"prev_x0_preds is mode 'dpm_sde''s; got mode {mode!r}")
    if streams is not None:
        if any(st.batch_size != batch or st.num_steps != num_steps for st in streams):
            fail("every stream must have the batch size and step count of the trajectory")
        if not torch.equal(streams[0].latents.to(latents.device), latents):
            fail("streams[0] must be the trajectory's own stream (the same latents)")
    if tree is not None:
        if streams is not None:
            fail("a branching rollout's tree and joint streams are not combined")
        tree = BranchTree.from_tensors(tree, batch, num_steps, where=f"{where}: tree")
    if stream_weights is not None:
        if streams is None:
            fail("stream_weights weights a joint rollout's streams; this payload has no streams")
        try:
            stream_weights = check_stream_weights(stream_weights, len(streams))
        except (ValueError, TypeError) as exc:
            fail(str(exc))
    fields = dict(
        latents=latents, log_probs=log_probs, timesteps=timesteps, sigmas=sigmas, latent_step_indices=steps,
        sde_steps=sde_steps, token_sigmas=token_sigmas, frozen=frozen, counts=counts, prev_x0_preds=prev_x0_preds,
        sde_mask=sde_mask,
    )
    if device is not None:
        fields = {k: (v.to(device) if v is not None else None) for k, v in fields.items()}
    if ddim:
        fields.update(prediction_type=ddim["prediction"].label, clip_sample_range=ddim["clip_sample_range"])
    return cls(**fields, mode=mode, noise_level=noise_level, log_prob_kind=settings["log_prob"],
               reduction=settings["reduction"], streams=streams, tree=tree, stream_weights=stream_weights)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _checksums(tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> Dict[str, Any]:
    """A digest per tensor (its dtype, shape and bytes) and one of the metadata (every key but this one)."""
    out = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        h = hashlib.blake2b(f"{t.dtype}{list(t.shape)}".encode(), digest_size=16)
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy of the bytes
        out[name] = h.hexdigest()
    settings = {k: v for k, v in metadata.items() if k != "checksums"}
    return {"tensors": out, "metadata": _digest(json.dumps(settings, sort_keys=True).encode())}


def _verify_checksums(tensors: Dict[str, torch.Tensor], metadata: Dict[str, str], where: str) -> None:
    try:
        recorded = json.loads(metadata.get("checksums", ""))
        recorded["tensors"], recorded["metadata"]  # noqa: B018  (both present)
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"{where}: the checksums metadata is missing or unreadable: the file is damaged") from None
    actual = _checksums(tensors, metadata)
    if set(recorded["tensors"]) != set(actual["tensors"]):
        raise ValueError(f"{where}: damaged: it holds tensors {sorted(actual['tensors'])}, its checksums name "
                         f"{sorted(recorded['tensors'])}")
    for name in sorted(actual["tensors"]):
        if actual["tensors"][name] != recorded["tensors"][name]:
            raise ValueError(f"{where}: damaged: tensor {name!r} does not match its checksum (its bytes changed "
                             "since it was saved)")
    if actual["metadata"] != recorded["metadata"]:
        raise ValueError(f"{where}: damaged: the metadata (settings {sorted(k for k in metadata if k != 'checksums')}) "
                         "does not match its checksum (edited since it was saved)")


__all__ = ["FORMAT", "FORMAT_V1", "FILE_FORMAT", "trajectory_to_wire", "trajectory_from_wire", "save_trajectory",
           "load_trajectory", "checked_trajectory"]
