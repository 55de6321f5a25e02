"""The output transform of a rollout's denoising environment (``flowrl.data.denoising_env``): how a
step's ``model_output`` is made from its model calls' outputs (``OutputTransform``), its detection
(``detect_transform``: the first transform that reproduces the output bit for bit, with the guidance
scale estimated by least squares) and the bitwise comparison both use. ``flowrl.data.denoising_env``
re-exports the public names."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

UserTransform = Callable[[List[torch.Tensor]], torch.Tensor]

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (``torch.equal`` calls -0.0 and 0.0 equal and NaN unequal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    view = _INT_VIEW.get(a.dtype)
    if view is not None:
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


@dataclass(frozen=True)
class OutputTransform:
    """How a step's ``model_output`` is made from its model calls' outputs, in this order:

    ``token_cut``: keep the first ``token_cut`` tokens (dim 1) of each output (reference-image tokens
    dropped). ``precast``: cast each output to this dtype first (LTX's ``.float()``). ``cfg``: None
    (one call, its output), ``"batched"`` (one call on a doubled batch, halves ``uncond_index`` /
    ``cond_index`` of dim 0) or ``"split"`` (two calls, by call index); combined as
    ``uncond + guidance_scale * (cond - uncond)``; ``cfg_renorm`` then rescales it to the cond output's norm
    over the last dim (Lumina2's ``cfg_normalization``). ``sign``: -1 negates (Lumina2). ``frames``:
    ``(F, H, W, drop)`` unpacks tokens ``[B, F*H*W, C]`` to ``[B, C, F, H, W]`` and drops the first
    ``drop`` frames (LTX image-to-video). ``out_dtype``: the final cast. ``user``: the user's
    ``output_transform`` instead of all of these.
    """

    out_dtype: torch.dtype
    token_cut: Optional[int] = None
    precast: Optional[torch.dtype] = None
    cfg: Optional[str] = None
    guidance_scale: Optional[float] = None
    uncond_index: int = 0
    cond_index: int = 1
    cfg_renorm: bool = False
    sign: int = 1
    frames: Optional[Tuple[int, int, int, int]] = None
    user: Optional[UserTransform] = None

    @property
    def num_calls(self) -> int:
        return 2 if self.cfg == "split" else 1

    def apply(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        outputs = list(outputs)
        if self.user is not None:
            return self.user(outputs)
        if len(outputs) != self.num_calls:
            raise ValueError(f"this step's transform ({self.describe()}) takes {self.num_calls} model output(s); "
                             f"got {len(outputs)}")
        if self.token_cut is not None:
            outputs = [o[:, :self.token_cut] for o in outputs]
        if self.precast is not None:
            outputs = [o.to(self.precast) for o in outputs]
        if self.cfg is None:
            value = outputs[0]
        else:
            if self.cfg == "batched":
                halves = outputs[0].chunk(2)
                uncond, cond = halves[self.uncond_index], halves[self.cond_index]
            else:
                uncond, cond = outputs[self.uncond_index], outputs[self.cond_index]
            value = uncond + self.guidance_scale * (cond - uncond)
            if self.cfg_renorm:  # Lumina2Pipeline's cfg_normalization, op for op
                value = value * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(value, dim=-1, keepdim=True))
        if self.sign < 0:
            value = -value
        if self.frames is not None:
            f, h, w, drop = self.frames
            value = value.reshape(value.shape[0], f, h, w, -1).permute(0, 4, 1, 2, 3)[:, :, drop:]
        return value.to(self.out_dtype)

    def describe(self) -> str:
        if self.user is not None:
            return "user output_transform"
        parts = []
        if self.token_cut is not None:
            parts.append(f"first {self.token_cut} tokens")
        if self.precast is not None:
            parts.append(f"cast to {self.precast}")
        if self.cfg is not None:
            parts.append(f"CFG ({self.cfg}, guidance_scale={self.guidance_scale}"
                         f"{', rescaled to the cond norm' if self.cfg_renorm else ''})")
        if self.sign < 0:
            parts.append("negated")
        if self.frames is not None:
            parts.append(f"unpacked to {self.frames[0]} frames, first {self.frames[3]} dropped")
        parts.append(f"as {self.out_dtype}")
        return ", ".join(parts) if len(parts) > 1 else f"identity ({parts[0]})"


def _scale_candidates(estimate: float) -> List[float]:
    """Guidance scales to try for a least-squares estimate: the short decimals users type first."""
    out = []
    for digits in range(0, 7):
        out.append(round(estimate, digits))
    out.append(estimate)
    seen, unique = set(), []
    for v in out:
        if v not in seen and math.isfinite(v):
            seen.add(v)
            unique.append(v)
    return unique


def _frames_options(o: torch.Tensor, m: torch.Tensor) -> List[Optional[Tuple[int, int, int, int]]]:
    if o.dim() != 3 or m.dim() != 5 or o.shape[2] != m.shape[1]:
        return [None]
    h, w = int(m.shape[3]), int(m.shape[4])
    tokens = int(o.shape[1])
    if tokens % (h * w):
        return [None]
    f = tokens // (h * w)
    drop = f - int(m.shape[2])
    return [(f, h, w, drop)] if drop >= 0 else [None]


def detect_transform(outputs: Sequence[torch.Tensor], model_output: torch.Tensor) -> Optional[OutputTransform]:
    """The first ``OutputTransform`` (in the order of the class doc) that turns ``outputs`` (the step's
    model calls, in call order) into ``model_output`` bit for bit, or None."""
    outputs = [o.detach() for o in outputs]
    m = model_output.detach()
    n = len(outputs)
    if n == 0 or n > 2:
        return None
    o0 = outputs[0]
    structures: List[Tuple[Optional[str], int, int]] = []
    if n == 1:
        structures.append((None, 0, 1))
        if o0.dim() >= 1 and o0.shape[0] == 2 * m.shape[0]:
            structures += [("batched", 0, 1), ("batched", 1, 0)]
    elif outputs[0].shape == outputs[1].shape:
        structures += [("split", 1, 0), ("split", 0, 1)]
    cuts: List[Optional[int]] = [None]
    if o0.dim() == 3 and m.dim() == 3 and o0.shape[1] > m.shape[1]:
        cuts.append(int(m.shape[1]))
    precasts: List[Optional[torch.dtype]] = [None]
    for dt in (torch.float32, m.dtype):
        if dt != o0.dtype and dt not in precasts:
            precasts.append(dt)
    for cut in cuts:
        cut_outputs = [o[:, :cut] for o in outputs] if cut is not None else outputs
        for frames in _frames_options(cut_outputs[0], m):
            for sign in (1, -1):
                for precast in precasts:
                    for cfg, ui, ci in structures:
                        for renorm in ((False,) if cfg is None else (False, True)):
                            base = OutputTransform(out_dtype=m.dtype, token_cut=cut, precast=precast, cfg=cfg,
                                                   uncond_index=ui, cond_index=ci, cfg_renorm=renorm, sign=sign,
                                                   frames=frames)
                            if cfg is None:
                                if reproduces(base, outputs, m):
                                    return base
                                continue
                            for scale in _estimate_scales(base, cut_outputs, m):
                                t = OutputTransform(out_dtype=m.dtype, token_cut=cut, precast=precast, cfg=cfg,
                                                    guidance_scale=scale, uncond_index=ui, cond_index=ci,
                                                    cfg_renorm=renorm, sign=sign, frames=frames)
                                if reproduces(t, outputs, m):
                                    return t
    return None


def reproduces(t: OutputTransform, outputs: Sequence[torch.Tensor], m: torch.Tensor) -> bool:
    """Whether ``t`` turns ``outputs`` into ``m`` bit for bit (one that cannot apply to them does not)."""
    try:
        value = t.apply(outputs)
    except (RuntimeError, ValueError):
        return False
    return bitwise_equal(value, m)


def _estimate_scales(base: OutputTransform, outputs: Sequence[torch.Tensor], m: torch.Tensor) -> List[float]:
    """Least-squares guidance scale g in m = post(u) + g (post(c) - post(u)) (the post-ops are linear and
    exact, so they are applied to u and c first), in float64. With ``cfg_renorm`` only the direction of
    each row survives: g makes u + g (c - u) parallel to m's rows (linear in g once projected off m)."""
    if base.cfg == "batched":
        halves = outputs[0].chunk(2)
        u, c = halves[base.uncond_index], halves[base.cond_index]
    else:
        u, c = outputs[base.uncond_index], outputs[base.cond_index]
    if base.cfg_renorm:
        if base.frames is not None or u.shape != m.shape:
            return []
        target = m.double() * base.sign
        unit = target / target.norm(dim=-1, keepdim=True)
        u, d = u.double(), c.double() - u.double()
        pu = u - (u * unit).sum(-1, keepdim=True) * unit
        pd = d - (d * unit).sum(-1, keepdim=True) * unit
        denom = float((pd * pd).sum())
        if not denom > 0:
            return []
        estimate = -float((pu * pd).sum()) / denom
        return _scale_candidates(estimate) if math.isfinite(estimate) else []
    post = OutputTransform(out_dtype=torch.float64, sign=base.sign, frames=base.frames)
    try:
        pu, pc = post.apply([u.double()]), post.apply([c.double()])
    except RuntimeError:
        return []
    if pu.shape != m.shape:
        return []
    d = pc - pu
    denom = float((d * d).sum())
    if not denom > 0:
        return []
    estimate = float(((m.double() - pu) * d).sum()) / denom
    return _scale_candidates(estimate) if math.isfinite(estimate) else []


__all__ = ["OutputTransform", "UserTransform", "bitwise_equal", "detect_transform", "reproduces"]
