"""Where a rollout keeps what it records: ``rollout(..., store="device" | "cpu")``.

``store="device"`` (the default) keeps every recorded tensor where the pipeline made it: the step's
input latent (a reference to the pipeline's own tensor, no copy), its log-prob, per-token sigmas, the
replay environment's inputs and the debug tensors. GPU memory then grows by one step's tensors per
step, B x (T + 1) latents at the end of the loop (docs/performance.md, "Memory of a recording").

``store="cpu"`` copies each step's recorded tensors into host memory as the step records them and
keeps only the copies, so the recording adds no device memory past the current step (the schedule
snapshot, [T + 1] + [T] values, and the frozen mask stay on the device: the steps read them). On a
machine with CUDA the copies go to pinned (page-locked) host memory, ``copy_(non_blocking=True)``
on the current stream, and an event recorded after each copy says when it has landed;
``trajectory()`` (and leaving the ``with`` block, before the debug tensors are stacked) waits for
those events before the host reads a copy. Without CUDA the copies are plain host tensors. The
trajectory's tensors are then host tensors; ``traj.step_inputs(j, device=...)`` moves a step's
recompute inputs back to a device.

Under CUDA-graph capture (``torch.cuda.graph``) a recording with ``store="cpu"`` is refused: the
copies are made by the Python step, which a graph replay does not run, so a replayed step would
record nothing new and overwrite nothing; record captured loops with ``store="device"`` (tested in
tests/ops/test_capturable.py) and copy the graph's outputs to the host after each replay.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

STORES = ("device", "cpu")
HOST = torch.device("cpu")


def check_store(store) -> str:
    """``store`` must be "device" or "cpu" (a ValueError / TypeError naming ``store`` otherwise)."""
    if not isinstance(store, str):
        raise TypeError(f"store must be 'device' or 'cpu'; got {type(store).__name__}")
    if store not in STORES:
        raise ValueError(f"store must be 'device' or 'cpu'; got {store!r}")
    return store


def _pin() -> bool:
    return torch.cuda.is_available()


class StepStore:
    """The copies a rollout keeps (``RolloutRecorder``'s, one per ``with`` block).

    ``keep(t)``: with ``store="device"`` returns ``t`` itself (detached); with ``store="cpu"`` a host
    copy (pinned, non-blocking, with an event, where CUDA exists). ``sync()`` waits for the pending
    copies. ``is_copy(t)`` says whether ``t`` is one of this store's copies (the tests check the
    recorder keeps nothing else)."""

    def __init__(self, store: str = "device"):
        self.store = check_store(store)
        self._events: List[Any] = []
        self._copies: Dict[int, int] = {}  # data_ptr of a copy's storage -> its nbytes

    @property
    def on_host(self) -> bool:
        return self.store == "cpu"

    def keep(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        t = t.detach()
        if not self.on_host:
            return t
        pin = _pin() and t.device.type == "cuda"
        # empty_like keeps a dense tensor's strides (LTX-2 steps a transposed view); an expanded or
        # overlapping tensor (stride 0) gets a contiguous copy of its values
        host = torch.empty_like(t, device=HOST, pin_memory=pin)
        if pin:
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            self._events.append(event)
        else:
            host.copy_(t)
        storage = host.untyped_storage()
        self._copies[storage.data_ptr()] = storage.nbytes()
        return host

    def sync(self) -> None:
        """Wait until every copy made so far has landed in host memory."""
        events, self._events = self._events, []
        for event in events:
            event.synchronize()

    def is_copy(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._copies

    def to_host(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A tensor the trajectory returns: on the host with ``store="cpu"`` (a blocking copy, for the
        schedule and masks, read once at the end), unchanged with ``store="device"``."""
        if t is None or not self.on_host:
            return t
        return t.to(HOST)

    @property
    def device(self) -> Optional[torch.device]:
        """Where the trajectory's small tensors are built: the host for ``store="cpu"``, else None
        (the schedule's device)."""
        return HOST if self.on_host else None


def move(value: Any, device) -> Any:
    """``value`` (a tensor, a tuple of them, or anything else) with its tensors on ``device`` (None:
    unchanged). A pinned host tensor moves with ``non_blocking=True`` (ordered on the current stream,
    so a kernel launched after it reads the moved values)."""
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=value.device.type == "cpu" and value.is_pinned())
    if isinstance(value, tuple):
        return tuple(move(v, device) for v in value)
    return value


def check_device(device):
    """``step_inputs(device=)``: None, a ``torch.device`` or a device string."""
    if device is None or isinstance(device, torch.device):
        return device
    if isinstance(device, (str, int)) and not isinstance(device, bool):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device must be a torch.device or a device string; got {device!r} ({exc})") from None
    raise TypeError(f"device must be None, a torch.device or a device string; got {type(device).__name__}")


# ---------------------------------------------------------------------------------------------------
# memory of a recording (docs/performance.md, "Memory of a recording")


def _per_step_fields(traj) -> Dict[str, int]:
    """Bytes per sample per loop step of one stream's recorded tensors: a kept latent counts once per
    step (K = T + 1 latents for T steps: the extra final latent is the T + 1-th), the per-step
    tensors [B, T, ...] once per step."""
    b, t = traj.batch_size, traj.num_steps
    out = {"latents": traj.latents.nbytes // (b * traj.latents.shape[1]), "log_probs": traj.log_probs.nbytes // (b * t)}
    for name in ("token_sigmas", "prev_x0_preds", "counts"):
        value = getattr(traj, name)
        if value is not None:
            out[name] = value.nbytes // (b * t)
    return out


def nbytes_per_sample_step(traj) -> Dict[str, int]:
    """What a recording costs per sample per loop step, by field (a joint rollout's streams summed,
    ``"stream<k>.latents"`` etc.), plus ``"total"``: the latent of one step of one sample (its dtype
    as recorded), its log-prob, and per-token sigmas / dpm_sde's previous x0 / a stream's counts where
    recorded. The schedule (T + 1 sigmas, T timesteps), the frozen mask, the replay environment
    (``traj.denoising_env.nbytes()``) and debug tensors are not per-step and not included."""
    streams = traj.streams if traj.streams is not None else (traj,)
    out: Dict[str, int] = {}
    for k, s in enumerate(streams):
        prefix = f"stream{k}." if traj.streams is not None else ""
        for name, n in _per_step_fields(s).items():
            out[prefix + name] = n
    if traj.streams is not None:  # the joint log-prob [B, T] the top level holds
        out["log_probs"] = traj.log_probs.nbytes // (traj.batch_size * traj.num_steps)
    out["total"] = sum(out.values())
    return out


def latent_nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of one sample's latent of ``shape`` (without the batch dim) in ``dtype``."""
    return math.prod(int(d) for d in shape) * torch.empty((), dtype=dtype).element_size()


def recording_peak_gpu_bytes(streams, *, batch: int, steps: int, store: str) -> int:
    """The device bytes a rollout's recording holds at its peak, beyond the pipeline's own tensors:
    ``streams`` lists each recording stream as ``(latent_shape, latent_dtype, step_dtype)`` (one
    sample's latent shape without the batch dim, the dtype of the loop's first input, the dtype each
    step emits: the model output's), for ``batch`` samples and ``steps`` loop steps T, without a replay
    environment or debug tensors. Per stream, with L(d) one sample's latent bytes in dtype d and P the
    promoted dtype of the two:

    ``store="device"``: the recorder holds step 0's input and the T later inputs / final output,
    B (L(latent_dtype) + T L(step_dtype)); ``trajectory()`` converts those not in P to P
    (``.to(P)``, a list) and stacks all T + 1, B (T + 1) L(P), while the held ones are still
    referenced; the log-probs [B] per step are held and stacked, 2 B T 4; with several streams each
    stream's counts too (2 B T 4) and the joint log-prob (B T 4 once); and the schedule snapshot, T + 1
    float32 sigmas and T float32 timesteps, 4 (2 T + 1) per stream.

    ``store="cpu"``: every recorded tensor goes to the host as its step records it; the device keeps
    each stream's schedule snapshot, 4 (2 T + 1) (a ``frozen=`` mask, when given, is one sample's mask
    expanded to B, not counted here)."""
    check_store(store)
    total = 0
    for shape, latent_dtype, step_dtype in streams:
        total += 4 * (2 * steps + 1)
        if store == "cpu":
            continue
        promoted = torch.promote_types(latent_dtype, step_dtype)
        held = latent_nbytes(shape, latent_dtype) + steps * latent_nbytes(shape, step_dtype)
        converted = ((latent_dtype != promoted) + steps * (step_dtype != promoted)) * latent_nbytes(shape, promoted)
        stacked = (steps + 1) * latent_nbytes(shape, promoted)
        total += batch * (held + converted + stacked) + 2 * batch * steps * 4
        if len(streams) > 1:
            total += 2 * batch * steps * 4
    if store == "device" and len(streams) > 1:
        total += batch * steps * 4
    return total


__all__ = ["STORES", "StepStore", "check_store", "move", "nbytes_per_sample_step", "latent_nbytes",
           "recording_peak_gpu_bytes"]
