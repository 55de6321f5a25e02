"""Wire format for rollouts: SGLang's JSON tensor envelope over a hand-written safetensors container.

SGLang's ``POST /rollout/generate`` sends every tensor (and numpy array) as

    {"__tensor__": true, "data": "<base64 of safetensors bytes, tensor under key 't'>",
     "shape": [...], "dtype": "torch.bfloat16"}

nested anywhere inside dicts and lists. ``to_wire`` / ``from_wire`` encode and decode such structures.

The safetensors container (8-byte little-endian header length, a JSON header, then the raw
little-endian bytes of each tensor) is written and parsed here by hand rather than through the
``safetensors`` package: the format is tiny, and owning the parser lets decoding check every field
of a payload that came from the network instead of trusting a parser's error behaviour. Decoding
never unpickles, takes dtypes from an allowlist, checks the shape against the byte count, bounds the
header and the total decoded size (``DEFAULT_MAX_BYTES`` or ``max_bytes=``), and raises ``ValueError``
saying what is wrong for any malformed payload.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import os
import struct
import sys
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import numpy as np
import torch

# Largest total of decoded bytes one ``from_wire`` / ``load_safetensors`` call accepts by default
# (2 GiB: a long video rollout's latents in bf16 fit; a hostile payload cannot ask for more).
DEFAULT_MAX_BYTES = 2 << 30
# Largest safetensors JSON header accepted: a header describes a handful of tensors, never megabytes.
MAX_HEADER_BYTES = 1 << 20
# Deepest nesting of dicts/lists ``from_wire`` / ``to_wire`` walk (guards against stack exhaustion).
MAX_DEPTH = 64
MAX_NDIM = 32

TENSOR_KEY = "t"  # the key SGLang stores the tensor under inside each envelope's safetensors bytes
ENVELOPE_KEYS = frozenset({"__tensor__", "data", "shape", "dtype"})

# allowlist: torch dtype <-> safetensors dtype tag
_ST_DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_ST = {tag: dt for dt, tag in _ST_DTYPES.items()}
# envelope dtype names: torch's str(dtype) as SGLang writes it, and the bare (numpy-style) names
_FROM_NAME = {str(dt): dt for dt in _ST_DTYPES}
_FROM_NAME.update({str(dt).replace("torch.", ""): dt for dt in _ST_DTYPES})

Path = Union[str, "os.PathLike[str]"]


def _require_little_endian() -> None:
    # safetensors stores little-endian bytes; this module copies raw memory both ways
    if sys.byteorder != "little":
        raise RuntimeError("flowrl.serialization supports little-endian hosts only")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_encodable(t: torch.Tensor, where: str) -> None:
    if t.dtype not in _ST_DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in _ST_DTYPES)
        raise TypeError(f"{where}: dtype {t.dtype} cannot be sent on the wire; allowed: {allowed}")
    if t.layout != torch.strided:
        raise TypeError(f"{where}: only dense (strided) tensors can be sent on the wire; got layout {t.layout}")


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as contiguous little-endian bytes, from any device or memory layout."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------------------------
# safetensors container


def encode_safetensors(tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """Serialize ``tensors`` (name -> tensor) and optional string ``metadata`` to safetensors bytes,
    readable by the ``safetensors`` library. Tensors may live on any device and be non-contiguous."""
    _require_little_endian()
    header: Dict[str, Any] = {}
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"metadata must map str to str; got {k!r}: {type(v).__name__}")
        header["__metadata__"] = dict(metadata)
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor names must be strings other than '__metadata__'; got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r} must be a torch.Tensor; got {type(t).__name__}")
        _check_encodable(t, f"tensor {name!r}")
        raw = _raw_bytes(t)
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # pad so the data starts 8-byte aligned, as the library does
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name} in header")


def _unique_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r} in header")
        out[k] = v
    return out


def _parse_header(head: bytes) -> Tuple[Dict[str, dict], Dict[str, str]]:
    """Validate a safetensors JSON header: returns (name -> (dtype, shape, (begin, end)), metadata)."""
    try:
        text = head.decode("utf-8")
        parsed = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"invalid safetensors header: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"invalid safetensors header: expected a JSON object, got {type(parsed).__name__}")
    metadata = parsed.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("invalid safetensors header: __metadata__ must map strings to strings")
    entries = {}
    for name, info in parsed.items():
        where = f"safetensors header entry {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{where} must be an object with exactly dtype, shape, data_offsets")
        dtype = _FROM_ST.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"{where}: dtype {info['dtype']!r} is not allowed; allowed: {', '.join(_FROM_ST)}")
        shape = _check_shape(info["shape"], where)
        offsets = info["data_offsets"]
        if (
            not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end; got {offsets!r}")
        nbytes = math.prod(shape) * _itemsize(dtype)
        if offsets[1] - offsets[0] != nbytes:
            raise ValueError(
                f"{where}: shape {shape} of {info['dtype']} needs {nbytes} bytes but data_offsets "
                f"span {offsets[1] - offsets[0]}"
            )
        entries[name] = (dtype, shape, (offsets[0], offsets[1]))
    return entries, metadata


def _check_shape(shape, where: str) -> list:
    if (
        not isinstance(shape, list) or len(shape) > MAX_NDIM
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ValueError(f"{where}: shape must be a list of at most {MAX_NDIM} non-negative integers; got {shape!r}")
    return shape


def _check_layout(entries: Dict[str, tuple], data_len: int) -> None:
    """The tensors' byte ranges must tile the data section exactly: no gaps, overlaps or trailing bytes."""
    end = 0
    for name, (_, _, (begin, stop)) in sorted(entries.items(), key=lambda kv: kv[1][2]):
        if begin != end:
            raise ValueError(f"safetensors data of {name!r} starts at byte {begin}, expected {end} (gap or overlap)")
        end = stop
    if end != data_len:
        raise ValueError(f"safetensors data section holds {data_len} bytes but the header describes {end}")


def _tensor_from_bytes(buf, dtype: torch.dtype, shape: list, name: str) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    if dtype == torch.bool and bool((t > 1).any()):
        raise ValueError(f"tensor {name!r}: bool data holds bytes other than 0 and 1")
    return t.view(dtype).reshape(shape)


def _header_length(prefix: bytes, total: int, max_bytes: int) -> int:
    if len(prefix) < 8:
        raise ValueError(f"safetensors data too short: {len(prefix)} bytes, need at least 8 for the header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"safetensors header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    if 8 + n > total:
        raise ValueError(f"safetensors header length {n} runs past the end of the data ({total} bytes)")
    if total > max_bytes:
        raise ValueError(f"safetensors data of {total} bytes exceeds max_bytes = {max_bytes}")
    return n


def decode_safetensors(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Parse safetensors ``data`` strictly: returns (name -> CPU tensor, metadata). Any malformed input
    raises ``ValueError``."""
    _require_little_endian()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes; got {type(data).__name__}")
    data = memoryview(data)
    n = _header_length(bytes(data[:8]), len(data), max_bytes)
    entries, metadata = _parse_header(bytes(data[8:8 + n]))
    body = data[8 + n:]
    _check_layout(entries, len(body))
    tensors = {name: _tensor_from_bytes(body[b:e], dt, shape, name) for name, (dt, shape, (b, e)) in entries.items()}
    return tensors, metadata


def save_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write a safetensors file (atomically: a temporary file renamed into place)."""
    blob = encode_safetensors(tensors, metadata)
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)


def load_safetensors(path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Read a safetensors file strictly; the size is checked before the data is read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        _header_length(f.read(8), size, max_bytes)  # size checks before reading the whole file
        f.seek(0)
        blob = f.read(size)
    if len(blob) != size:
        raise ValueError(f"{os.fspath(path)}: file changed while being read")
    return decode_safetensors(blob, max_bytes=max_bytes)


# ---------------------------------------------------------------------------------------------------
# JSON envelope


def encode_tensor(t: Union[torch.Tensor, np.ndarray]) -> Dict[str, Any]:
    """One tensor (or numpy array) -> SGLang's ``{"__tensor__": true, ...}`` envelope."""
    if isinstance(t, np.ndarray):
        t = _from_numpy(t, "array")
    _check_encodable(t, "tensor")
    blob = encode_safetensors({TENSOR_KEY: t})
    return {
        "__tensor__": True,
        "data": base64.b64encode(blob).decode("ascii"),
        "shape": list(t.shape),
        "dtype": str(t.dtype),
    }


def _from_numpy(a: np.ndarray, where: str) -> torch.Tensor:
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(np.ascontiguousarray(a))
    except TypeError:
        raise TypeError(f"{where}: numpy dtype {a.dtype} cannot be sent on the wire") from None


def to_wire(obj: Any) -> Any:
    """Encode tensors and numpy arrays nested in dicts/lists/tuples (tuples become lists) into
    JSON-safe envelopes. Strings, numbers, bools and None pass through; numpy scalars become Python
    numbers. Tensors may be on any device, non-contiguous, empty or 0-d; they are detached."""
    return _encode(obj, "obj", 0)


def _encode(obj: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nesting deeper than {MAX_DEPTH} levels (a cycle?)")
    if isinstance(obj, torch.Tensor):
        _check_encodable(obj, where)
        return encode_tensor(obj)
    if isinstance(obj, np.ndarray):
        return encode_tensor(_from_numpy(obj, where))
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict keys must be strings for JSON; got {k!r}")
            if k == "__tensor__":
                raise ValueError(f"{where}: the key '__tensor__' is reserved for tensor envelopes")
            out[k] = _encode(v, f"{where}[{k!r}]", depth + 1)
        return out
    if isinstance(obj, (list, tuple)):
        return [_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
    raise TypeError(f"{where}: cannot encode {type(obj).__name__} on the wire")


class _Budget:
    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a non-negative int; got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.left = max_bytes

    def take(self, n: int, where: str) -> None:
        if n > self.left:
            raise ValueError(
                f"{where}: payload exceeds max_bytes = {self.max_bytes} "
                f"({n} more bytes with {self.left} left); pass a larger max_bytes to accept it"
            )
        self.left -= n


def decode_tensor(env: Any, *, max_bytes: int = DEFAULT_MAX_BYTES, device=None) -> torch.Tensor:
    """One ``{"__tensor__": true, ...}`` envelope -> tensor, validated strictly."""
    return _decode_envelope(env, "envelope", _Budget(max_bytes), device)


def _decode_envelope(env: Any, where: str, budget: _Budget, device) -> torch.Tensor:
    if not isinstance(env, dict):
        raise ValueError(f"{where}: a tensor envelope must be an object; got {type(env).__name__}")
    if env.get("__tensor__") is not True:
        raise ValueError(f"{where}: '__tensor__' must be true; got {env.get('__tensor__')!r}")
    if set(env) != ENVELOPE_KEYS:
        missing = sorted(ENVELOPE_KEYS - set(env))
        extra = sorted(set(env) - ENVELOPE_KEYS)
        raise ValueError(f"{where}: tensor envelope keys must be {sorted(ENVELOPE_KEYS)}; missing {missing}, unexpected {extra}")
    dtype_name, shape, data = env["dtype"], env["shape"], env["data"]
    dtype = _FROM_NAME.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ValueError(f"{where}: dtype {dtype_name!r} is not allowed; allowed: {', '.join(sorted(_FROM_NAME))}")
    shape = _check_shape(shape, where)
    if not isinstance(data, str):
        raise ValueError(f"{where}: data must be a base64 string; got {type(data).__name__}")
    # bound the decoded size before decoding: base64 expands 3 bytes to 4 characters
    budget.take(len(data) // 4 * 3, where)
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: data is not valid base64: {exc}") from None
    try:
        tensors, _ = decode_safetensors(blob, max_bytes=budget.max_bytes)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if set(tensors) != {TENSOR_KEY}:
        raise ValueError(f"{where}: safetensors data must hold exactly one tensor named {TENSOR_KEY!r}; got {sorted(tensors)}")
    t = tensors[TENSOR_KEY]
    if t.dtype != dtype:
        raise ValueError(f"{where}: envelope dtype {dtype_name} disagrees with the data's {t.dtype}")
    if list(t.shape) != shape:
        raise ValueError(f"{where}: envelope shape {shape} disagrees with the data's {list(t.shape)}")
    return t if device is None else t.to(device)


def from_wire(obj: Any, *, max_bytes: int = DEFAULT_MAX_BYTES, device=None) -> Any:
    """Decode a parsed JSON structure: every ``{"__tensor__": true, ...}`` envelope becomes a tensor
    (on the CPU, or on ``device``), dicts and lists are walked, JSON scalars pass through.

    Strict, because payloads come from the network: the total decoded size is bounded by
    ``max_bytes``; anything malformed raises ``ValueError`` naming where it is (e.g.
    ``obj['latents']: ...``). Never unpickles."""
    return _decode(obj, "obj", 0, _Budget(max_bytes), device)


def _decode(obj: Any, where: str, depth: int, budget: _Budget, device) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nesting deeper than {MAX_DEPTH} levels")
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return _decode_envelope(obj, where, budget, device)
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: object keys must be strings; got {k!r}")
            out[k] = _decode(v, f"{where}[{k!r}]", depth + 1, budget, device)
        return out
    if isinstance(obj, list):
        return [_decode(v, f"{where}[{i}]", depth + 1, budget, device) for i, v in enumerate(obj)]
    raise ValueError(f"{where}: {type(obj).__name__} is not a JSON value")


def dumps(obj: Any) -> str:
    """``json.dumps(to_wire(obj))``, rejecting NaN/inf floats outside tensors (not valid JSON)."""
    return json.dumps(to_wire(obj), allow_nan=False)


def loads(text: Union[str, bytes], *, max_bytes: int = DEFAULT_MAX_BYTES, device=None) -> Any:
    """Parse JSON ``text`` and ``from_wire`` it; the text's length counts against ``max_bytes``."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise TypeError(f"text must be str or bytes; got {type(text).__name__}")
    if len(text) > max_bytes:
        raise ValueError(f"JSON text of {len(text)} bytes exceeds max_bytes = {max_bytes}")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    return from_wire(obj, max_bytes=max_bytes, device=device)


__all__ = [
    "DEFAULT_MAX_BYTES", "MAX_HEADER_BYTES", "MAX_DEPTH", "to_wire", "from_wire", "encode_tensor", "decode_tensor",
    "encode_safetensors", "decode_safetensors", "save_safetensors", "load_safetensors", "dumps", "loads",
]
