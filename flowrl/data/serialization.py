"""Wire format for rollouts: SGLang's JSON tensor envelope over the safetensors container.

SGLang's ``POST /rollout/generate`` sends every tensor (and numpy array) as

    {"__tensor__": true, "data": <safetensors bytes, tensor under key 't'>,
     "shape": [...], "dtype": "torch.bfloat16"}

nested anywhere inside dicts and lists. The released servers (sglang 0.5.20 to 0.5.23,
entrypoints/post_training/utils.py ``_maybe_serialize``) put the raw bytes in ``data`` and send the body
as msgpack, which hands a client ``bytes``; the JSON form (the pull requests' commits, and flowrl's own
JSON files) carries the same bytes as base64 text. ``from_wire`` reads both; ``to_wire`` writes base64
text (JSON-safe) or, with ``raw_bytes=True``, the raw bytes (msgpack-safe). ``to_wire`` / ``from_wire``
encode and decode such structures.

The container (8-byte little-endian header length, a JSON header, the raw tensor bytes) is written and
parsed by the ``safetensors`` library. Payloads come from the network, so decoding adds flowrl's own
checks around it: the size (``DEFAULT_MAX_BYTES`` or ``max_bytes=``) and the header length are bounded
before anything is allocated, the header's dtypes must be on an allowlist and its shapes at most
``MAX_NDIM``-dimensional, bool bytes must be 0 or 1, and the envelope's shape and dtype must match the
data. Decoding never unpickles, and every malformed payload, including one the library rejects,
raises ``ValueError`` naming where it is.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import struct
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import numpy as np
import safetensors
import safetensors.torch
import torch

# Largest total of decoded bytes one ``from_wire`` / ``load_safetensors`` call accepts by default
# (2 GiB: a long video rollout's latents in bf16 fit; a hostile payload cannot ask for more).
DEFAULT_MAX_BYTES = 2 << 30
# Largest safetensors JSON header accepted: a header describes a handful of tensors, never megabytes
# (the library's own limit is 100 MB).
MAX_HEADER_BYTES = 1 << 20
# Deepest nesting of dicts/lists ``from_wire`` / ``to_wire`` walk (guards against stack exhaustion).
MAX_DEPTH = 64
MAX_NDIM = 32

TENSOR_KEY = "t"  # the key SGLang stores the tensor under inside each envelope's safetensors bytes
ENVELOPE_KEYS = frozenset({"__tensor__", "data", "shape", "dtype"})

# allowlist: torch dtype <-> safetensors dtype tag. The library knows more (float8, uint16-64,
# complex); those are refused on both sides so a payload cannot smuggle in a dtype training never expects.
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
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}

Path = Union[str, "os.PathLike[str]"]


def _check_encodable(t: torch.Tensor, where: str) -> None:
    if t.dtype not in _ST_DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in _ST_DTYPES)
        raise TypeError(f"{where}: dtype {t.dtype} cannot be sent on the wire; allowed: {allowed}")
    if t.layout != torch.strided:
        raise TypeError(f"{where}: only dense (strided) tensors can be sent on the wire; got layout {t.layout}")


def _check_shape(shape, where: str) -> list:
    if (
        not isinstance(shape, list) or len(shape) > MAX_NDIM
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ValueError(f"{where}: shape must be a list of at most {MAX_NDIM} non-negative integers; got {shape!r}")
    return shape


# ---------------------------------------------------------------------------------------------------
# safetensors container


def _prepare_for_library(tensors: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Check names and tensors, and hand the library what it requires: detached, dense, contiguous
    CPU tensors that share no memory with each other (it refuses overlapping storage)."""
    prepared = {}
    storages = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor names must be strings other than '__metadata__'; got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r} must be a torch.Tensor; got {type(t).__name__}")
        _check_encodable(t, f"tensor {name!r}")
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            storage = t.untyped_storage().data_ptr()
            if storage in storages:
                t = t.clone()  # e.g. the same tensor under two names, or a view of another one
            storages.add(t.untyped_storage().data_ptr())
        prepared[name] = t
    return prepared


def _check_metadata(metadata: Optional[Mapping[str, str]]) -> Optional[Dict[str, str]]:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must map str to str; got {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str; got {k!r}: {type(v).__name__}")
    return dict(metadata)


def encode_safetensors(tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """Serialize ``tensors`` (name -> tensor) and optional string ``metadata`` to safetensors bytes
    with the ``safetensors`` library. Tensors may live on any device and be non-contiguous."""
    prepared = _prepare_for_library(tensors)
    return safetensors.torch.save(prepared, metadata=_check_metadata(metadata))


def save_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write a safetensors file with the library (atomically: a temporary file renamed into place)."""
    prepared = _prepare_for_library(tensors)
    metadata = _check_metadata(metadata)
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        safetensors.torch.save_file(prepared, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name} in JSON")


def _unique_keys(pairs):
    # the library keeps the last of duplicate keys; a header that says two things is refused instead
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r} in header")
        out[k] = v
    return out


def _looks_like(prefix: bytes) -> str:
    """What a file whose first 8 bytes are no safetensors header length probably is, for the message."""
    head = prefix.lstrip()
    if head[:1] in (b"{", b"["):
        return "not a safetensors file (it starts like JSON text)"
    if prefix[:1] == b"\x80":
        return "not a safetensors file (it starts like a Python pickle, e.g. torch.save's)"
    if prefix[:2] == b"PK":
        return "not a safetensors file (it starts like a zip archive, e.g. torch.save's)"
    return "not a safetensors file, or a damaged one"


def _header_length(prefix: bytes, total: int, max_bytes: int) -> int:
    """The container's header length, bounded before anything is allocated for the header or data."""
    if len(prefix) < 8:
        raise ValueError(f"safetensors data too short: {len(prefix)} bytes, need at least 8 for the header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"safetensors header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes: "
                         f"{_looks_like(prefix)}")
    if 8 + n > total:
        raise ValueError(f"safetensors header length {n} runs past the end of the data ({total} bytes)")
    if total > max_bytes:
        raise ValueError(f"safetensors data of {total} bytes exceeds max_bytes = {max_bytes}")
    return n


def _read_header(head: bytes) -> Tuple[Dict[str, Tuple[torch.dtype, list]], Dict[str, str], Optional[int]]:
    """What the header promises, checked against flowrl's allowlist before the library allocates:
    returns (name -> (dtype, shape), metadata, the largest data offset it names, None if one is not an
    int). Offsets and byte counts are checked by the library, except that the data reaches that end (a
    truncated file is named as such); the metadata is read here because the library's bytes API does not
    return it."""
    try:
        header = json.loads(head.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"invalid safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError(f"invalid safetensors header: expected a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("invalid safetensors header: __metadata__ must map strings to strings")
    promised, end = {}, 0
    for name, info in header.items():
        where = f"safetensors header entry {name!r}"
        if not isinstance(info, dict) or set(info) != _ENTRY_KEYS:
            raise ValueError(f"{where} must be an object with exactly dtype, shape, data_offsets")
        dtype = _FROM_ST.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"{where}: dtype {info['dtype']!r} is not allowed; allowed: {', '.join(_FROM_ST)}")
        promised[name] = (dtype, _check_shape(info["shape"], where))
        offsets = info["data_offsets"]
        ok = isinstance(offsets, list) and len(offsets) == 2 and type(offsets[1]) is int
        end = max(end, offsets[1]) if ok and end is not None else None
    return promised, metadata, end


def decode_safetensors(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Parse safetensors ``data`` strictly with the library: returns (name -> CPU tensor, metadata).
    Any malformed input raises ``ValueError``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes; got {type(data).__name__}")
    data = bytes(data)
    n = _header_length(data[:8], len(data), max_bytes)
    promised, metadata, end = _read_header(data[8:8 + n])
    if end is not None and 8 + n + end > len(data):  # other disagreements: the library's own message
        raise ValueError(f"safetensors data is truncated: its header describes {8 + n + end} bytes, there are "
                         f"{len(data)}")
    try:
        tensors = safetensors.torch.load(data)
    except (safetensors.SafetensorError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"the safetensors library rejected the data: {exc}") from None
    # the library parsed the same header; this guards the allowlist against any parser difference
    found = {name: (t.dtype, list(t.shape)) for name, t in tensors.items()}
    if found != promised:
        raise ValueError(f"safetensors data holds {found} but its header promised {promised}")
    for name, t in tensors.items():
        if t.dtype == torch.bool and t.numel() and bool((t.view(torch.uint8) > 1).any()):
            raise ValueError(f"tensor {name!r}: bool data holds bytes other than 0 and 1")
    return tensors, metadata


def load_safetensors(path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Read a safetensors file as strictly as ``decode_safetensors``; the size is checked before the
    data is read."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _header_length(f.read(8), size, max_bytes)
            f.seek(0)
            blob = f.read(size)
        if len(blob) != size:
            raise ValueError("file changed while being read")
        return decode_safetensors(blob, max_bytes=max_bytes)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


# ---------------------------------------------------------------------------------------------------
# JSON envelope


def encode_tensor(t: Union[torch.Tensor, np.ndarray], *, raw_bytes: bool = False) -> Dict[str, Any]:
    """One tensor (or numpy array) -> SGLang's ``{"__tensor__": true, ...}`` envelope; ``data`` is
    base64 text, or with ``raw_bytes=True`` the safetensors bytes themselves (the released servers')."""
    if isinstance(t, np.ndarray):
        t = _from_numpy(t, "array")
    _check_encodable(t, "tensor")
    blob = encode_safetensors({TENSOR_KEY: t})
    return {
        "__tensor__": True,
        "data": blob if raw_bytes else base64.b64encode(blob).decode("ascii"),
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


def to_wire(obj: Any, *, raw_bytes: bool = False) -> Any:
    """Encode tensors and numpy arrays nested in dicts/lists/tuples (tuples become lists) into
    envelopes: JSON-safe (base64 ``data``), or with ``raw_bytes=True`` msgpack-safe with the raw bytes
    in ``data``, as the released SGLang servers send them. Strings, numbers, bools and None pass
    through; numpy scalars become Python numbers. Tensors may be on any device, non-contiguous, empty
    or 0-d; they are detached."""
    if not isinstance(raw_bytes, bool):
        raise TypeError(f"raw_bytes must be a bool; got {type(raw_bytes).__name__}")
    return _encode(obj, "obj", 0, raw_bytes)


def _encode(obj: Any, where: str, depth: int, raw_bytes: bool = False) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nesting deeper than {MAX_DEPTH} levels (a cycle?)")
    if isinstance(obj, torch.Tensor):
        _check_encodable(obj, where)
        return encode_tensor(obj, raw_bytes=raw_bytes)
    if isinstance(obj, np.ndarray):
        return encode_tensor(_from_numpy(obj, where), raw_bytes=raw_bytes)
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
            out[k] = _encode(v, f"{where}[{k!r}]", depth + 1, raw_bytes)
        return out
    if isinstance(obj, (list, tuple)):
        return [_encode(v, f"{where}[{i}]", depth + 1, raw_bytes) for i, v in enumerate(obj)]
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
    if isinstance(data, (bytes, bytearray, memoryview)):  # the released servers' msgpack body: raw bytes
        blob = bytes(data)
        budget.take(len(blob), where)
    elif isinstance(data, str):  # JSON: base64 text
        # bound the decoded size before decoding: base64 expands 3 bytes to 4 characters
        budget.take(len(data) // 4 * 3, where)
        try:
            blob = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{where}: data is not valid base64: {exc}") from None
    else:
        raise ValueError(f"{where}: data must be safetensors bytes (a msgpack body) or their base64 text (JSON); "
                         f"got {type(data).__name__}")
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
    if obj is None or isinstance(obj, (bool, int, float, str)):
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
