"""The denoising environment of a rollout: what the model received at every step, and what the pipeline
did to the model's output before ``scheduler.step``.

``scheduler.rollout(..., model=pipe.transformer)`` (``flowrl.rollout.recorder.RolloutRecorder``) hooks that
module for the length of the ``with`` block (forward pre/post hooks with kwargs, removed on exit, also on
an exception). Every call's arguments are bound to ``forward``'s parameter names and stored; a tensor
that did not change since the previous step (the same object at the same version, or the same bits at
the same argument) is stored once and shared. The calls made before step ``j`` belong to step ``j``.
``model=(pipe.transformer, pipe.transformer_2)`` hooks each module of the tuple (Wan 2.2 A14B's two
experts) and records which one each call went to (``traj.model_indices(j)``).

At each step the recorder compares the calls' outputs with the ``model_output`` that reached ``step``
and finds the ``OutputTransform`` that reproduces it bit for bit: identity, classifier-free guidance
(a batched call's halves or two split calls, with its guidance scale, optionally rescaled to the cond
output's norm as Lumina2's ``cfg_normalization``), a sign flip (Lumina2), a token
cut (Flux Kontext, Flux2 reference-image tokens), unpacking tokens to frames and dropping the leading
ones (LTX image-to-video), casts before or after, or the user's ``output_transform``. Where none does,
the step gets no transform, the rollout ends with one warning naming the steps, and
``step_model_output`` on such a step raises.

The transforms and their detection (``OutputTransform``, ``detect_transform``, ``bitwise_equal``) live in
``flowrl.data._output_transform`` and are re-exported here; this module records the calls.
"""
from __future__ import annotations

import functools
import inspect
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ._output_transform import OutputTransform, UserTransform, bitwise_equal, detect_transform, reproduces
from .debug import DebugTensorRecorder


def first_tensor(output: Any, where: str = "model output") -> torch.Tensor:
    """The prediction in what a diffusers model returns: a tensor, a tuple ``(sample, ...)``
    (``return_dict=False``) or an output dataclass (its first field)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(output, dict) and output:  # diffusers' BaseOutput is an OrderedDict
        value = next(iter(output.values()))
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"{where} must be a tensor, a tuple starting with one, or a model output dataclass; "
                    f"got {type(output).__name__}")


# ---------------------------------------------------------------------------------------------------
# recording the calls


class _TensorStore:
    """Stores tensors once: the same object at the same version, or the same bits as the previous
    step's tensor at the same argument, is not stored again."""

    def __init__(self, device: Optional[torch.device], host=None):
        self.device = device
        # rollout(store='cpu'): copies go to the host through the rollout's StepStore (pinned, non-blocking)
        self.host = host if host is not None and host.on_host else None
        self._by_id: Dict[int, Tuple[Any, int, torch.Tensor]] = {}
        self._by_key: Dict[Tuple, torch.Tensor] = {}

    def put(self, t: torch.Tensor, key: Tuple) -> torch.Tensor:
        hit = self._by_id.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            stored = hit[2]
        else:
            prev = self._by_key.get(key)
            if prev is not None and self.host is not None:
                self.host.sync()  # the previous copy has landed before the host compares with it
            if prev is not None and bitwise_equal(prev, t.detach()):
                stored = prev
            elif self.host is not None:
                stored = self.host.keep(t)
            else:
                stored = t.detach().to(device=self.device or t.device, copy=True)
            try:
                self._by_id[id(t)] = (weakref.ref(t), t._version, stored)
            except TypeError:  # a tensor subclass without weakref support: no identity shortcut
                pass
        self._by_key[key] = stored
        return stored

    def prune(self) -> None:
        self._by_id = {k: v for k, v in self._by_id.items() if v[0]() is not None}


def _store_value(value: Any, store: _TensorStore, key: Tuple) -> Any:
    if isinstance(value, torch.Tensor):
        return store.put(value, key)
    if isinstance(value, dict):
        return {k: _store_value(v, store, key + (k,)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_store_value(v, store, key + (i,)) for i, v in enumerate(value)]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # a namedtuple keeps its type
    return value


def _to_device(value: Any, device) -> Any:
    if isinstance(value, torch.Tensor):
        return value if device is None else value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value


def _walk_tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk_tensors(v)


@dataclass
class StepRecord:
    """One loop step: its model calls' kwargs and the transform from their outputs to ``model_output``."""

    calls: List[Dict[str, Any]]
    module_indices: List[int]  # per call: the index of its module in rollout(model=...)'s modules
    transform: Optional[OutputTransform]
    why_not: Optional[str] = None  # when transform is None


class DenoisingEnv:
    """The recorded model calls of one rollout, per loop step (``traj.denoising_env``)."""

    def __init__(self, steps: List[StepRecord], module_name: str):
        self.steps = steps
        self.module_name = module_name

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def _step(self, j: int) -> StepRecord:
        if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < len(self.steps):
            raise ValueError(f"step must be an int in [0, {len(self.steps) - 1}]; got {j!r}")
        return self.steps[j]

    def model_calls(self, j: int, device=None) -> List[Dict[str, Any]]:
        """The kwargs of each call step ``j`` made, in call order (tensors on ``device`` if given)."""
        return [_to_device(dict(call), device) for call in self._step(j).calls]

    def model_indices(self, j: int) -> List[int]:
        """Per call of step ``j`` (in ``model_calls`` order), the index of the module it went to in
        ``rollout(model=...)``'s modules (always 0 for one module): ``models[i](**kw)`` replays it."""
        return list(self._step(j).module_indices)

    def model_inputs(self, j: int, device=None) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
        """Step ``j``'s call kwargs: one dict when the step made one call (``model(**inputs)`` replays
        it), else a list of dicts in call order (split CFG)."""
        calls = self.model_calls(j, device)
        return calls[0] if len(calls) == 1 else calls

    def transform(self, j: int) -> OutputTransform:
        record = self._step(j)
        if record.transform is None:
            raise ValueError(
                f"step {j}: the rollout could not tell how the pipeline turned the {self.module_name} output(s) into "
                f"the model_output that reached scheduler.step ({record.why_not}); pass "
                "output_transform=callable(outputs) -> model_output to the rollout"
            )
        return record.transform

    def step_model_output(self, j: int, raw_output: Any) -> torch.Tensor:
        """Turn replayed output(s) of step ``j``'s call(s) (one output or a list, as the module returns
        them) into the velocity the step used, with the recorded transform: the ``model_output`` that
        ``step`` received (negated on a per-token step, whose velocity is ``-model_output``)."""
        t = self.transform(j)
        # a list holds one output per call (diffusers models return tuples or dataclasses, never lists)
        if isinstance(raw_output, list):
            outputs = [first_tensor(o, f"raw_output[{i}]") for i, o in enumerate(raw_output)]
        else:
            outputs = [first_tensor(raw_output, "raw_output")]
        expected = len(self.steps[j].calls)
        if t.user is None and len(outputs) != expected:
            raise ValueError(f"step {j} made {expected} model call(s); step_model_output got {len(outputs)} output(s)")
        return t.apply(outputs)

    def nbytes(self) -> int:
        """Bytes held by the recorded tensors (each stored tensor counted once)."""
        seen, total = set(), 0
        for record in self.steps:
            for call in record.calls:
                for t in _walk_tensors(call):
                    storage = t.untyped_storage()
                    key = (storage.data_ptr(), t.device)
                    if key not in seen:
                        seen.add(key)
                        total += storage.nbytes()
        return total


def _modules_of(model) -> Tuple[torch.nn.Module, ...]:
    """``model=``'s modules: one module, or a non-empty tuple/list of distinct modules none of which
    contains another (a call of an inner module would be recorded twice)."""
    if not isinstance(model, (tuple, list)):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (e.g. pipe.transformer) or a tuple/list of them; "
                            f"got {type(model).__name__}")
        return (model,)
    if not model:
        raise ValueError("model must be a torch.nn.Module or a non-empty tuple/list of them; got an empty "
                         f"{type(model).__name__}")
    for i, m in enumerate(model):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"model[{i}] must be a torch.nn.Module (e.g. pipe.transformer_2); got {type(m).__name__}")
    for i, outer in enumerate(model):
        for k, inner in enumerate(model):
            if k != i and any(sub is inner for sub in outer.modules()):
                what = f"is model[{i}]" if inner is outer else f"is a submodule of model[{i}]"
                raise ValueError(f"model[{k}] {what}: each call would be recorded twice; pass each module once")
    return tuple(model)


class ModelCallRecorder:
    """Hooks ``module`` (or each of a tuple of modules) for one rollout: records each call's kwargs,
    module index and output; at each scheduler step the pending calls become that step's and their
    output transform is found."""

    def __init__(self, module: Union[torch.nn.Module, Sequence[torch.nn.Module]], *, env_device=None,
                 output_transform: Optional[UserTransform] = None, host=None):
        self.modules = _modules_of(module)
        if output_transform is not None and not callable(output_transform):
            raise TypeError(f"output_transform must be callable(outputs: list of tensors) -> tensor; got "
                            f"{type(output_transform).__name__}")
        self.module_name = " / ".join(dict.fromkeys(type(m).__name__ for m in self.modules))
        self.device = torch.device(env_device) if env_device is not None else None
        self.user = output_transform
        self._signatures = [inspect.signature(m.forward) for m in self.modules]
        self._handles: List[Any] = []
        self._store = _TensorStore(self.device, host)
        self._pending: List[Dict[str, Any]] = []
        self._pending_modules: List[int] = []
        self._pending_outputs: List[torch.Tensor] = []
        self._steps: List[StepRecord] = []
        self._last: Optional[OutputTransform] = None

    # hooks ------------------------------------------------------------------------------------
    def attach(self) -> None:
        self._handles = []
        for index, module in enumerate(self.modules):
            self._handles += [
                module.register_forward_pre_hook(functools.partial(self._pre_hook, index), with_kwargs=True),
                module.register_forward_hook(self._post_hook, with_kwargs=True),
            ]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _bind(self, module, signature, args, kwargs) -> Dict[str, Any]:
        if not args:
            return dict(kwargs)
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"cannot name the positional arguments of {type(module).__name__}.forward: {exc}") from None
        out = {}
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                raise TypeError(f"{type(module).__name__}.forward takes *{name}: its calls cannot be replayed as "
                                "kwargs")
            else:
                out[name] = value
        return out

    def _pre_hook(self, module_index, module, args, kwargs):
        index = len(self._pending)
        call = self._bind(module, self._signatures[module_index], args, kwargs)
        self._pending.append({k: _store_value(v, self._store, (index, k)) for k, v in call.items()})
        self._pending_modules.append(module_index)
        return None

    def _post_hook(self, module, args, kwargs, output):
        try:
            self._pending_outputs.append(first_tensor(output, f"{type(module).__name__} output").detach())
        except TypeError:
            self._pending_outputs.append(None)
        return None

    # steps ------------------------------------------------------------------------------------
    def on_step(self, model_output: torch.Tensor) -> None:
        calls, outputs, modules = self._pending, self._pending_outputs, self._pending_modules
        self._pending, self._pending_outputs, self._pending_modules = [], [], []
        self._store.prune()
        transform, why = None, None
        if not calls:
            why = "the model was not called before this step"
        elif any(o is None for o in outputs):
            why = "a call returned no tensor"
        elif self.user is not None:
            try:
                ok = bitwise_equal(self.user(list(outputs)).to(model_output.dtype), model_output.detach())
            except Exception as exc:  # the user's code: report, never crash the rollout
                ok, why = False, f"output_transform raised {type(exc).__name__}: {exc}"
            if ok:
                transform = OutputTransform(out_dtype=model_output.dtype, user=self.user)
            else:
                why = why or "output_transform did not reproduce the model_output bit for bit"
        else:
            last = self._last
            if last is not None and last.num_calls == len(outputs) and reproduces(last, outputs, model_output):
                transform = self._last
            else:
                transform = detect_transform(outputs, model_output)
            if transform is None:
                why = (f"{len(outputs)} call(s) with output shape(s) {[tuple(o.shape) for o in outputs]} -> "
                       f"model_output {tuple(model_output.shape)}: no identity, CFG, sign, token-cut or frames "
                       "transform reproduces it")
        if transform is not None:
            self._last = transform
        self._steps.append(StepRecord(calls, modules, transform, why))

    def finish(self) -> DenoisingEnv:
        """The recorded environment; warns once when some step's transform is unknown or calls were
        made after the last step."""
        problems = [j for j, s in enumerate(self._steps) if s.transform is None]
        name = self.module_name
        if problems:
            first = self._steps[problems[0]]
            warnings.warn(
                f"flowrl rollout: for {len(problems)} of {len(self._steps)} steps (steps {problems[:8]}"
                f"{'...' if len(problems) > 8 else ''}) the recorder could not tell how the pipeline turned the "
                f"{name} output(s) into the model_output given to scheduler.step (step {problems[0]}: "
                f"{first.why_not}); traj.step_model_output raises on those steps. Pass output_transform= to the "
                "rollout."
            )
        if self._pending:
            warnings.warn(f"flowrl rollout: {len(self._pending)} call(s) of {name} after the last scheduler step "
                          "belong to no step and were dropped")
            self._pending, self._pending_outputs, self._pending_modules = [], [], []
        return DenoisingEnv(self._steps, name)


# ---------------------------------------------------------------------------------------------------
# RolloutRecorder's hooks call these (model=, env_device=, output_transform=, debug=)


def check_env_options(model, env_device, output_transform, debug):
    """Check RolloutRecorder's model=, env_device=, output_transform=, debug= once, at construction."""
    if model is None and (env_device is not None or output_transform is not None):
        raise ValueError("env_device and output_transform need model= (the module(s) whose calls to record)")
    if model is not None:
        ModelCallRecorder(model, env_device=env_device, output_transform=output_transform)  # checks the arguments
        model = tuple(model) if isinstance(model, list) else model  # a later change to the user's list does not leak in
    if debug not in (None, False, True) and not isinstance(debug, (str, os.PathLike)):
        raise TypeError(f"debug must be None, False, True or a file path; got {debug!r}")
    return model, env_device, output_transform, debug


def start_env(options, host=None):
    """A rollout's model-call recorder (hooks attached) and debug recorder, per ``with`` block
    (``host``: the rollout's ``flowrl.data.trajectory_store.StepStore``, which keeps their tensors)."""
    model, env_device, output_transform, debug = options
    env = None
    if model is not None:
        env = ModelCallRecorder(model, env_device=env_device, output_transform=output_transform, host=host)
        env.attach()
    return env, (DebugTensorRecorder(debug, host) if debug not in (None, False) else None)


def finish_env(env, debug, completed: bool):
    """Remove the hooks (always); on a completed loop, the environment (with its one warning) and the
    debug tensors (written to their file)."""
    if env is not None:
        env.detach()
    if not completed:
        return None, None
    return (env.finish() if env is not None and env._steps else None,
            debug.finish() if debug is not None and debug._rows else None)


# ---------------------------------------------------------------------------------------------------
# RolloutTrajectory's replay methods delegate here


def env_of(traj) -> DenoisingEnv:
    env = getattr(traj, "denoising_env", None)
    if env is None:
        raise ValueError("this trajectory has no denoising environment: record it with "
                         "scheduler.rollout(..., model=pipe.transformer)")
    if not isinstance(env, DenoisingEnv):
        raise TypeError(f"traj.denoising_env must be a flowrl DenoisingEnv; got {type(env).__name__} (an SGLang "
                        "denoising_env dict holds the pipeline's kwargs, not per-step calls)")
    return env


__all__ = ["OutputTransform", "DenoisingEnv", "ModelCallRecorder", "StepRecord", "detect_transform",
           "bitwise_equal", "first_tensor"]
