"""Wire format: SGLang tensor envelopes, the safetensors container, RolloutTrajectory I/O.

flowrl encodes and decodes the container through the ``safetensors`` library; the tests also build
payloads with the library directly (as SGLang does) and by hand (malformed headers). Malformed payloads
must raise ValueError naming where they are, never anything else; hypothesis fuzzes that.
"""
import base64
import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from flowrl.data import serialization as S
from flowrl.data.trajectory import FORMAT, RolloutTrajectory

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


def _random(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def sglang_envelope(t: torch.Tensor) -> dict:
    """What SGLang's server sends, built with the safetensors library (independent of flowrl)."""
    raw = st_save({"t": t.detach().contiguous().cpu()})
    return {"__tensor__": True, "data": base64.b64encode(raw).decode("ascii"), "shape": list(t.shape), "dtype": str(t.dtype)}


def _over_json(obj):
    return json.loads(json.dumps(obj))


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (7,), (2, 3, 5)], ids=str)
def test_round_trip_bit_exact(dtype, shape):
    t = _random(shape, dtype)
    back = S.from_wire(_over_json(S.to_wire(t)))
    assert _bits_equal(back, t)


def test_round_trip_special_float_bits():
    # NaN payloads, signed zeros, infinities and subnormals survive bit for bit
    bits = torch.tensor([0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001], dtype=torch.int64)
    t = bits.to(torch.int32).view(torch.float32)
    assert _bits_equal(S.from_wire(_over_json(S.to_wire(t))), t)
    h = torch.tensor([0x7E01, 0x8000 - 0x10000, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    assert _bits_equal(S.from_wire(_over_json(S.to_wire(h))), h)


def test_non_contiguous_and_grad_tensors():
    base = _random((6, 8, 4), torch.bfloat16)
    views = [base.transpose(0, 2), base[:, ::3], base[1:, 2:, 1], base.expand(2, 6, 8, 4)]
    for v in views:
        assert not v.is_contiguous()
        assert _bits_equal(S.from_wire(_over_json(S.to_wire(v))), v.contiguous())
    leaf = torch.randn(3, requires_grad=True)
    back = S.from_wire(S.to_wire(leaf * 2))
    assert not back.requires_grad and torch.equal(back, (leaf * 2).detach())


def test_nested_structures_and_numpy():
    frames = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    obj = {
        "latents": _random((2, 3, 4), torch.bfloat16),
        "meta": {"steps": (1, 2, 3), "name": "x", "flag": True, "none": None, "pi": 3.25},
        "videos": [frames, frames[:, ::2].transpose(0, 3, 1, 2)],
        "big_endian": np.arange(5, dtype=">f4"),
        "scalar": np.float32(1.5),
    }
    back = S.from_wire(_over_json(S.to_wire(obj)))
    assert _bits_equal(back["latents"], obj["latents"])
    assert back["meta"] == {"steps": [1, 2, 3], "name": "x", "flag": True, "none": None, "pi": 3.25}
    assert np.array_equal(back["videos"][0].numpy(), frames)
    assert np.array_equal(back["videos"][1].numpy(), frames[:, ::2].transpose(0, 3, 1, 2))
    assert back["big_endian"].dtype == torch.float32 and np.array_equal(back["big_endian"].numpy(), np.arange(5.0))
    assert back["scalar"] == 1.5


def test_dumps_loads():
    t = _random((3, 2), torch.float16)
    assert _bits_equal(S.loads(S.dumps({"t": [t]}))["t"][0], t)
    with pytest.raises(ValueError):
        S.dumps({"x": float("nan")})  # NaN outside a tensor is not JSON
    with pytest.raises(ValueError, match="invalid JSON"):
        S.loads('{"a": ')
    with pytest.raises(ValueError, match="max_bytes"):
        S.loads(S.dumps(t), max_bytes=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_property(dtype, shape, seed):
    t = _random(tuple(shape), dtype, seed)
    env = S.to_wire(t)
    assert _bits_equal(S.from_wire(_over_json(env)), t)
    # the safetensors library reads what flowrl writes, and flowrl reads what the library writes
    assert _bits_equal(st_load(base64.b64decode(env["data"]))["t"], t)
    assert _bits_equal(S.from_wire(sglang_envelope(t)), t)


# ------------------------------------------------------------------------------ SGLang interoperability


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_raw_bytes_envelopes_as_the_released_servers_send_them(dtype):
    """sglang 0.5.20-0.5.23 ``_maybe_serialize``: ``data`` is ``safetensors.torch.save``'s bytes, and a
    msgpack client receives ``bytes`` (bytearray and memoryview too); ``raw_bytes=True`` writes them."""
    t = _random((3, 5), dtype)
    raw = {"__tensor__": True, "data": st_save({"t": t.contiguous()}), "shape": [3, 5], "dtype": str(t.dtype)}
    for data in (raw["data"], bytearray(raw["data"]), memoryview(raw["data"])):
        assert _bits_equal(S.from_wire(dict(raw, data=data)), t)
    env = S.to_wire({"x": [t]}, raw_bytes=True)["x"][0]
    assert isinstance(env["data"], bytes) and _bits_equal(st_load(env["data"])["t"], t)
    assert _bits_equal(S.from_wire(env), t)
    with pytest.raises(ValueError, match="exceeds max_bytes"):
        S.from_wire(raw, max_bytes=len(raw["data"]) - 1)
    with pytest.raises(TypeError, match="raw_bytes must be a bool"):
        S.to_wire(t, raw_bytes="yes")


def test_decodes_sglang_response():
    latents = _random((2, 5, 16, 8), torch.bfloat16)
    log_probs = _random((2, 4), torch.float32)
    frames = torch.from_numpy(np.random.default_rng(0).integers(0, 255, (2, 3, 8, 8, 3), dtype=np.uint8))
    response = _over_json({
        "trajectory_latents": sglang_envelope(latents),
        "rollout_log_probs": sglang_envelope(log_probs),
        "frames": [sglang_envelope(f) for f in frames],
        "meta": {"seed": 3, "timesteps": sglang_envelope(torch.tensor([1000.0, 750.0, 500.0, 250.0]))},
    })
    out = S.from_wire(response)
    assert _bits_equal(out["trajectory_latents"], latents)
    assert _bits_equal(out["rollout_log_probs"], log_probs)
    assert all(_bits_equal(a, b) for a, b in zip(out["frames"], frames))
    assert out["meta"]["seed"] == 3


def test_library_reads_multi_tensor_files(tmp_path):
    from safetensors import safe_open

    tensors = {"a": _random((3, 4), torch.bfloat16), "b": _random((), torch.int64), "c": _random((0, 2), torch.bool)}
    path = tmp_path / "x.safetensors"
    S.save_safetensors(path, tensors, {"k": "v"})
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"k": "v"}
        for name, t in tensors.items():
            assert _bits_equal(f.get_tensor(name), t)
    loaded, meta = S.load_safetensors(path)
    assert meta == {"k": "v"} and all(_bits_equal(loaded[k], tensors[k]) for k in tensors)


def test_bare_dtype_names_accepted():
    env = sglang_envelope(_random((4,), torch.uint8))
    env["dtype"] = "uint8"  # numpy-style name, as a numpy-side sender would write it
    assert S.from_wire(env).dtype == torch.uint8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors():
    t = _random((4, 5), torch.bfloat16).cuda()[:, ::2]
    env = _over_json(S.to_wire({"t": t}))
    back = S.from_wire(env)["t"]
    assert back.device.type == "cpu" and _bits_equal(back, t.cpu())
    on_gpu = S.from_wire(env, device="cuda")["t"]
    assert on_gpu.is_cuda and torch.equal(on_gpu, t)


# ---------------------------------------------------------------------------------- malformed payloads


def _st_bytes(header: dict, body: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + body


def _env(blob: bytes, shape=(2,), dtype="torch.float32") -> dict:
    return {"__tensor__": True, "data": base64.b64encode(blob).decode(), "shape": list(shape), "dtype": dtype}


GOOD = sglang_envelope(torch.tensor([1.0, 2.0]))
F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
BODY = struct.pack("<2f", 1.0, 2.0)
# what the library itself rejects (offsets, byte counts) comes back as a ValueError naming where it is
REJECTED = "^obj: the safetensors library rejected the data: "


def _duplicate_entry_bytes() -> bytes:
    entry = json.dumps(F32)
    head = f'{{"t": {entry}, "t": {entry}}}'.encode()  # well-formed twice: the library alone accepts it
    return struct.pack("<Q", len(head)) + head + BODY

MALFORMED = {
    "not base64": (dict(GOOD, data="@@@@"), "base64"),
    "bad padding": (dict(GOOD, data=GOOD["data"][:-1]), "base64"),
    "non-ascii data": (dict(GOOD, data="é" * 8), "base64"),
    "data neither bytes nor text": (dict(GOOD, data=12), "safetensors bytes .a msgpack body. or their base64 text"),
    "short blob": (_env(b"\x01\x02"), "too short"),
    "header too long": (_env(struct.pack("<Q", 1 << 40)), "exceeds the limit"),
    "header past end": (_env(struct.pack("<Q", 100) + b"{}"), "runs past the end"),
    "header not json": (_env(struct.pack("<Q", 3) + b"{x}"), "invalid safetensors header"),
    "header not utf8": (_env(struct.pack("<Q", 2) + b"\xff\xfe"), "invalid safetensors header"),
    "header is a list": (_env(_st_bytes([1])), "JSON object"),
    "header NaN": (_env(struct.pack("<Q", 14) + b'{"t": NaN}    '), "non-finite"),
    "duplicate key": (_env(struct.pack("<Q", 17) + b'{"t": 1, "t": 2} '), "duplicate key"),
    "duplicate valid entry": (_env(_duplicate_entry_bytes()), "duplicate key"),
    "header dtype": (_env(_st_bytes({"t": dict(F32, dtype="F8_E4M3")}, BODY)), "not allowed"),
    # dtypes the library reads but flowrl refuses
    "header dtype U16": (_env(_st_bytes({"t": dict(F32, dtype="U16", shape=[4])}, BODY)), "'U16' is not allowed"),
    "header dtype C64": (_env(_st_bytes({"t": dict(F32, dtype="C64", shape=[1])}, BODY)), "'C64' is not allowed"),
    "header extra field": (_env(_st_bytes({"t": dict(F32, x=1)}, BODY)), "exactly dtype"),
    "too many dims": (_env(_st_bytes({"t": dict(F32, shape=[1] * 33 + [2])}, BODY)), "at most 32"),
    "negative dim": (_env(_st_bytes({"t": dict(F32, shape=[-2])}, BODY)), "non-negative"),
    "bool dim": (_env(_st_bytes({"t": dict(F32, shape=[True, 2])}, BODY)), "non-negative"),
    "huge shape": (_env(_st_bytes({"t": dict(F32, shape=[1 << 62, 1 << 62])}, BODY)), REJECTED),
    "offsets vs shape": (_env(_st_bytes({"t": dict(F32, data_offsets=[0, 4])}, BODY)), REJECTED),
    "offsets reversed": (_env(_st_bytes({"t": dict(F32, data_offsets=[8, 0])}, BODY)), REJECTED),
    "offsets not ints": (_env(_st_bytes({"t": dict(F32, data_offsets=[0.0, 8])}, BODY)), REJECTED),
    "trailing bytes": (_env(_st_bytes({"t": F32}, BODY + b"xx")), REJECTED),
    "gap": (_env(_st_bytes({"t": dict(F32, data_offsets=[2, 10])}, b"\0\0" + BODY)), REJECTED),
    "metadata not strings": (_env(_st_bytes({"__metadata__": {"a": 1}, "t": F32}, BODY)), "__metadata__"),
    "wrong tensor name": (_env(_st_bytes({"x": F32}, BODY)), "exactly one tensor named 't'"),
    "two tensors": (_env(st_save({"t": torch.zeros(2), "u": torch.zeros(1)})), "exactly one tensor"),
    "envelope dtype disagrees": (dict(GOOD, dtype="torch.float16"), "disagrees"),
    "envelope shape disagrees": (dict(GOOD, shape=[1, 2]), "disagrees"),
    "envelope dtype unknown": (dict(GOOD, dtype="torch.complex64"), "not allowed"),
    "envelope dtype object": (dict(GOOD, dtype="object"), "not allowed"),
    "envelope shape not list": (dict(GOOD, shape="2"), "shape"),
    "tensor flag false": (dict(GOOD, __tensor__=False), "must be true"),
    "tensor flag string": (dict(GOOD, __tensor__="yes"), "must be true"),
    "missing key": ({k: v for k, v in GOOD.items() if k != "shape"}, "missing \\['shape'\\]"),
    "extra key": (dict(GOOD, pickle="cos\nsystem"), "unexpected \\['pickle'\\]"),
    "not json value": ({"a": {1, 2}}, "not a JSON value"),
    "bytes leaf": ([b"abc"], "not a JSON value"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_payloads_raise_value_error(name):
    payload, message = MALFORMED[name]
    with pytest.raises(ValueError, match=message):
        S.from_wire(payload)


@pytest.mark.parametrize("name", sorted(n for n, (p, _) in MALFORMED.items()
                                        if isinstance(p, dict) and isinstance(p.get("data"), str)
                                        and "base64" not in MALFORMED[n][1]))
def test_malformed_payloads_are_refused_the_same_as_raw_bytes(name):
    """The released servers' msgpack body carries the same safetensors bytes unencoded: every check
    that holds for base64 text holds for them."""
    payload, message = MALFORMED[name]
    raw = dict(payload, data=base64.b64decode(payload["data"]))
    with pytest.raises(ValueError, match=message):
        S.from_wire(raw)


def test_bool_bytes_other_than_0_1_rejected():
    header = {"t": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}
    assert S.from_wire(_env(_st_bytes(header, b"\x00\x01\x01"), (3,), "torch.bool")).tolist() == [False, True, True]
    with pytest.raises(ValueError, match="bool data"):
        S.from_wire(_env(_st_bytes(header, b"\x00\x01\x02"), (3,), "torch.bool"))


def test_library_rejections_name_where():
    bad = _env(_st_bytes({"t": dict(F32, data_offsets=[0, 4])}, BODY))
    with pytest.raises(ValueError, match=r"^obj\['rollout'\]\[1\]: the safetensors library rejected the data"):
        S.from_wire({"rollout": [GOOD, bad]})
    with pytest.raises(ValueError, match=r"^envelope: the safetensors library rejected the data"):
        S.decode_tensor(bad)


def test_container_metadata_round_trip():
    tensors = {"a": _random((2, 3), torch.bfloat16), "b": _random((4,), torch.bool)}
    loaded, meta = S.decode_safetensors(S.encode_safetensors(tensors, {"k": "v", "format": "x/1"}))
    assert meta == {"k": "v", "format": "x/1"}
    assert all(_bits_equal(loaded[k], tensors[k]) for k in tensors)
    # metadata written by the library itself comes back too; no metadata reads as {}
    assert S.decode_safetensors(st_save(tensors, metadata={"k": "w"}))[1] == {"k": "w"}
    assert S.decode_safetensors(st_save(tensors))[1] == {}
    with pytest.raises(TypeError, match="metadata must map str to str"):
        S.encode_safetensors(tensors, {"k": 1})
    with pytest.raises(ValueError, match="tensor names"):
        S.encode_safetensors({"__metadata__": torch.zeros(1)})
    with pytest.raises(TypeError, match="tensor 'a' must be a torch.Tensor"):
        S.encode_safetensors({"a": [1.0]})


def test_container_tensors_sharing_memory(tmp_path):
    # the library refuses tensors that overlap in memory; flowrl copies the second one instead
    base = _random((4, 5), torch.float32)
    tensors = {"a": base, "same": base, "row": base[1], "cols": base[:, 1:]}
    for loaded, _ in (S.decode_safetensors(S.encode_safetensors(tensors)),
                      (S.save_safetensors(tmp_path / "s", tensors), S.load_safetensors(tmp_path / "s"))[1]):
        assert set(loaded) == set(tensors)
        assert all(_bits_equal(loaded[k], tensors[k].contiguous()) for k in tensors)


def test_loaded_tensors_are_writable():
    t = S.from_wire(S.to_wire(torch.arange(4.0)))
    t.add_(1)  # backed by its own writable memory, not the payload's bytes
    assert t.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_size_limit():
    t = torch.zeros(1000)
    env = S.to_wire([t, t])
    assert len(S.from_wire(env, max_bytes=10_000)) == 2
    with pytest.raises(ValueError, match="max_bytes"):
        S.from_wire(env, max_bytes=4_100)  # the limit is on the whole payload, not per tensor
    with pytest.raises(ValueError, match="max_bytes"):
        S.decode_tensor(env[0], max_bytes=100)
    with pytest.raises(ValueError, match="max_bytes must be"):
        S.from_wire(env, max_bytes=-1)


def test_depth_limit():
    deep = current = {}
    for _ in range(S.MAX_DEPTH + 5):
        current["a"] = {}
        current = current["a"]
    with pytest.raises(ValueError, match="nesting deeper"):
        S.from_wire(deep)
    cyclic = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="nesting deeper"):
        S.to_wire(cyclic)


def test_encode_errors():
    with pytest.raises(TypeError, match="complex"):
        S.to_wire({"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="keys must be strings"):
        S.to_wire({1: torch.zeros(1)})
    with pytest.raises(ValueError, match="reserved"):
        S.to_wire({"__tensor__": 1})
    with pytest.raises(TypeError, match="set"):
        S.to_wire({"s": {1}})
    with pytest.raises(TypeError, match="numpy dtype"):
        S.to_wire(np.array(["a"], dtype=object))


# mutations of valid payloads: flipped, inserted, deleted and truncated bytes / characters
_VALID_BLOB = base64.b64decode(S.to_wire(_random((3, 5), torch.bfloat16))["data"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0, 10_000), st.integers(0, 255)),
           min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, len(_VALID_BLOB))),
    shape=st.sampled_from([[3, 5], [5, 3], [15], [3, 5, 1]]),
    dtype=st.sampled_from(["torch.bfloat16", "torch.float16", "torch.int16", "torch.bool", "torch.uint8"]),
)
def test_fuzz_mutated_safetensors_bytes(edits, cut, shape, dtype):
    blob = bytearray(_VALID_BLOB)
    for op, pos, byte in edits:
        pos %= len(blob) + 1
        if op == "flip" and pos < len(blob):
            blob[pos] ^= byte or 1
        elif op == "insert":
            blob.insert(pos, byte)
        elif op == "delete" and pos < len(blob):
            del blob[pos]
    if cut is not None:
        blob = blob[:cut]
    _decode_or_value_error(_env(bytes(blob), shape, dtype), max_bytes=1 << 16)


json_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8))
json_values = st.recursive(
    json_leaves,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=4)),
    max_leaves=20,
)
envelopes = st.fixed_dictionaries(
    {"__tensor__": st.one_of(st.just(True), json_leaves)},
    optional={
        "data": st.one_of(st.text(alphabet="ABCDEFGHabcdefgh0123456789+/=", max_size=64), json_values,
                          st.just(GOOD["data"])),
        "shape": st.one_of(st.lists(st.integers(-2, 4), max_size=3), json_values),
        "dtype": st.one_of(st.sampled_from(["torch.float32", "torch.bfloat16", "float32", "F32", "torch.int8"]),
                           json_values),
        "extra": json_values,
    },
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.recursive(st.one_of(json_values, envelopes),
                            lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=4), kids, max_size=3)),
                            max_leaves=8))
def test_fuzz_json_structures(payload):
    _decode_or_value_error(payload, max_bytes=1 << 16)


def _decode_or_value_error(payload, max_bytes):
    try:
        out = S.from_wire(payload, max_bytes=max_bytes)
    except ValueError:
        return
    # anything accepted must re-encode to an equivalent payload
    again = S.from_wire(S.to_wire(out))
    assert type(again) is type(out)


# ------------------------------------------------------------------------------------ RolloutTrajectory


def _trajectory(batch=4, steps=3, sde_steps=True):
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float32)
    return RolloutTrajectory(
        latents=_random((batch, steps + 1, 2, 4, 4), torch.bfloat16),
        log_probs=_random((batch, steps), torch.float32),
        timesteps=sigmas[:-1] * 1000,
        sigmas=sigmas,
        latent_step_indices=torch.arange(steps + 1),
        mode="cps",
        noise_level=0.1 + 0.2,  # a float whose repr needs all digits
        log_prob_kind="sq_err",
        reduction="sum",
        sde_steps=torch.tensor([0, 1]) if sde_steps else None,
    )


def _same_trajectory(a: RolloutTrajectory, b: RolloutTrajectory):
    for name in ("latents", "log_probs", "timesteps", "sigmas", "latent_step_indices"):
        assert _bits_equal(getattr(a, name), getattr(b, name)), name
    assert (a.sde_steps is None) == (b.sde_steps is None)
    if a.sde_steps is not None:
        assert torch.equal(a.sde_steps, b.sde_steps)
    assert (a.mode, a.noise_level, a.log_prob_kind, a.reduction) == (b.mode, b.noise_level, b.log_prob_kind, b.reduction)


@pytest.mark.parametrize("sde_steps", [True, False])
def test_trajectory_wire_and_file_round_trip(tmp_path, sde_steps):
    traj = _trajectory(sde_steps=sde_steps)
    _same_trajectory(RolloutTrajectory.from_wire(_over_json(traj.to_wire())), traj)
    path = tmp_path / "traj.safetensors"
    traj.save(path)
    _same_trajectory(RolloutTrajectory.load(path), traj)
    with open(path, "rb") as f:
        meta = st_load(f.read())  # the library reads the file too
    assert _bits_equal(meta["latents"], traj.latents)


def test_trajectory_split_never_slices_the_schedule():
    # T + 1 == B: sigmas' and latent_step_indices' length equals the batch size; timesteps' (T) too for B = T
    for batch, steps in [(4, 3), (3, 3)]:
        traj = _trajectory(batch=batch, steps=steps)
        parts = traj.split()
        assert len(parts) == batch
        for i, p in enumerate(parts):
            assert p.batch_size == 1
            assert torch.equal(p.latents, traj.latents[i:i + 1]) and torch.equal(p.log_probs, traj.log_probs[i:i + 1])
            assert p.sigmas is traj.sigmas and p.timesteps is traj.timesteps
            assert p.latent_step_indices is traj.latent_step_indices and p.sde_steps is traj.sde_steps
            assert (p.mode, p.noise_level) == (traj.mode, traj.noise_level)
            _same_trajectory(RolloutTrajectory.from_wire(_over_json(p.to_wire())), p)


def _bad_wire(**changes):
    wire = _over_json(_trajectory().to_wire())
    for k, v in changes.items():
        if v is KeyError:
            del wire[k]
        else:
            wire[k] = v
    return wire


@pytest.mark.parametrize("changes, message", [
    (dict(format="other/1"), "format"),
    (dict(mode=KeyError), "missing keys"),
    (dict(extra=1), "unexpected keys"),
    (dict(mode="euler"), "mode"),
    (dict(noise_level="0.3"), "noise_level"),
    (dict(noise_level=2.0), "noise_level"),
    (dict(reduction="max"), "reduction"),
    (dict(latents=[1, 2]), "latents must be a tensor envelope"),
    (dict(log_probs=S.to_wire(torch.zeros(4, 2))), "log_probs"),
    (dict(log_probs=S.to_wire(torch.zeros(4, 3, dtype=torch.float16))), "log_probs"),
    (dict(sigmas=S.to_wire(torch.tensor([1.0, 0.6, 0.7, 0.0]))), "decreasing"),
    (dict(sigmas=S.to_wire(torch.tensor([1.0, 0.6, 0.3, 0.0]).half())), "sigmas"),
    (dict(timesteps=S.to_wire(torch.zeros(5))), "timesteps"),
    (dict(latent_step_indices=S.to_wire(torch.tensor([0, 1, 2, 9]))), "latent_step_indices"),
    (dict(latent_step_indices=S.to_wire(torch.tensor([0, 1, 2]))), "latent_step_indices"),
    (dict(sde_steps=S.to_wire(torch.tensor([0.0]))), "sde_steps"),
    (dict(sde_steps=S.to_wire(torch.tensor([3]))), "sde_steps"),
    (dict(token_sigmas=S.to_wire(torch.zeros(4, 3, 1, 1))), "token_sigmas"),
    (dict(token_sigmas=S.to_wire(torch.full((4, 3, 1, 1, 1), 2.0))), r"token_sigmas must lie in \[0, 1\]"),
    (dict(frozen=S.to_wire(torch.zeros(4, 1, 1, 1))), "frozen must be bool"),
    (dict(counts=S.to_wire(torch.zeros(4, 2))), "counts"),
    (dict(streams=[]), "streams must be null or a list of at least 2"),
    (dict(token_sigmas=KeyError), "missing keys"),
])
def test_trajectory_from_wire_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        RolloutTrajectory.from_wire(_bad_wire(**changes))


def test_trajectory_load_rejects(tmp_path):
    traj = _trajectory()
    path = tmp_path / "t.safetensors"
    traj.save(path)
    blob = path.read_bytes()
    (tmp_path / "cut").write_bytes(blob[:-3])
    with pytest.raises(ValueError, match=r"cut: safetensors data is truncated: its header describes \d+ bytes, there are"):
        RolloutTrajectory.load(tmp_path / "cut")
    with pytest.raises(ValueError, match="max_bytes"):
        RolloutTrajectory.load(path, max_bytes=100)
    S.save_safetensors(tmp_path / "other", {"latents": traj.latents}, {"format": "x"})
    with pytest.raises(ValueError, match="format"):
        RolloutTrajectory.load(tmp_path / "other")
    S.save_safetensors(tmp_path / "missing", {"latents": traj.latents}, {"format": FORMAT, "mode": "sde",
                       "noise_level": "0.7", "log_prob": "gaussian", "reduction": "mean"})
    with pytest.raises(ValueError, match="tensors must be"):
        RolloutTrajectory.load(tmp_path / "missing")
    tensors = traj._tensors()
    S.save_safetensors(tmp_path / "nl", tensors, {"format": FORMAT, "mode": "sde", "noise_level": "abc",
                       "log_prob": "gaussian", "reduction": "mean"})
    with pytest.raises(ValueError, match="noise_level"):
        RolloutTrajectory.load(tmp_path / "nl")


def test_a_damaged_trajectory_file_is_refused_naming_what_is_damaged(tmp_path):
    """Files carry a checksum of every tensor and of the metadata (format /3): one flipped byte in a
    tensor, or an edited setting, is refused by name; files that are no trajectory say what they look like."""
    import pickle
    from flowrl.data.trajectory import FILE_FORMAT

    traj = _trajectory()
    path = tmp_path / "t.safetensors"
    traj.save(path)
    blob = path.read_bytes()
    tensors, metadata = S.load_safetensors(path)
    assert metadata["format"] == FILE_FORMAT and "checksums" in metadata
    header = struct.unpack("<Q", blob[:8])[0]
    offsets = json.loads(blob[8:8 + header])
    for name in ("latents", "log_probs", "sigmas"):
        start = 8 + header + offsets[name]["data_offsets"][0]
        damaged = bytearray(blob)
        damaged[start + 1] ^= 0x10
        (tmp_path / "d").write_bytes(bytes(damaged))
        with pytest.raises(ValueError, match=f"damaged: tensor '{name}' does not match its checksum"):
            RolloutTrajectory.load(tmp_path / "d")
    value = repr(traj.noise_level)  # edited in place: the same length, so the file stays well-formed
    edited = blob.replace(f'"noise_level":"{value}"'.encode(),
                          f'"noise_level":"{value[:-1]}{(int(value[-1]) + 1) % 10}"'.encode())
    assert edited != blob
    (tmp_path / "e").write_bytes(edited)
    with pytest.raises(ValueError, match="damaged: the metadata .* does not match its checksum"):
        RolloutTrajectory.load(tmp_path / "e")
    torch.save({"latents": traj.latents}, tmp_path / "saved.pt")  # torch.save's zip archive
    for kind, data in (("JSON text", json.dumps({"latents": [1, 2]}).encode()),
                       ("a Python pickle", pickle.dumps({"latents": [1.0]})),
                       ("a zip archive", (tmp_path / "saved.pt").read_bytes())):
        (tmp_path / "x").write_bytes(data)
        with pytest.raises(ValueError, match=f"not a readable flowrl trajectory file: .*it starts like {kind}"):
            RolloutTrajectory.load(tmp_path / "x")
    # a file written before checksums (format /2) still loads
    S.save_safetensors(tmp_path / "v2", traj._tensors(), {"format": FORMAT, "mode": traj.mode, "noise_level":
                       repr(traj.noise_level), "log_prob": traj.log_prob_kind, "reduction": traj.reduction})
    assert torch.equal(RolloutTrajectory.load(tmp_path / "v2").latents, traj.latents)



def _joint_trajectory():
    """A recorded joint rollout (two streams) with a frozen mask and per-token sigmas on the first stream."""
    import copy

    diffusers = pytest.importorskip("diffusers")
    from flowrl.rollout.recorder import rollout

    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    video, audio = torch.randn(2, 6, 4).to(torch.bfloat16), torch.randn(2, 5, 3)
    frozen = torch.zeros(1, 6, 1, dtype=torch.bool)
    frozen[:, 0] = True
    velocities = []
    with rollout(sched, frozen=frozen, generator=torch.Generator().manual_seed(0)) as rec:
        audio_sched = copy.deepcopy(sched)
        audio_sched.set_timesteps(3)
        sched.set_timesteps(3)
        for t in sched.timesteps:
            ptt = torch.full((2, 6), float(t))
            ptt[:, 5] = 0.0  # token 5 at t = 0: held
            velocities.append((torch.sin(video.float()), torch.cos(audio)))
            video = sched.step(-velocities[-1][0], t, video, per_token_timesteps=ptt, return_dict=False)[0]
            audio = audio_sched.step(velocities[-1][1], t, audio, return_dict=False)[0]
    return rec.trajectory(), velocities


def test_trajectory_format_2_round_trips_masks_token_sigmas_and_streams(tmp_path):
    traj, velocities = _joint_trajectory()
    assert traj.frozen is not None and traj.token_sigmas.shape == (2, 3, 6, 1) and traj.num_streams == 2

    def same(a, b):
        _same_trajectory(a, b)
        for name in ("token_sigmas", "frozen", "counts"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None) and (x is None or _bits_equal(x, y)), name
        assert (a.streams is None) == (b.streams is None)
        for sa, sb in zip(a.streams or (), b.streams or ()):
            same(sa, sb)

    wire = _over_json(traj.to_wire())
    assert wire["format"] == "flowrl.RolloutTrajectory/2" and len(wire["streams"]) == 2
    same(RolloutTrajectory.from_wire(wire), traj)
    traj.save(tmp_path / "joint.safetensors")
    loaded = RolloutTrajectory.load(tmp_path / "joint.safetensors")
    same(loaded, traj)
    import flowrl

    for j, v in enumerate(velocities):  # what came back recomputes every step
        assert torch.equal(flowrl.step_log_prob(model_output=v, **loaded.step_inputs(j)), traj.log_probs[:, j])
    for part, whole in zip(traj.split(), (0, 1)):
        same(RolloutTrajectory.from_wire(_over_json(part.to_wire())), part)
        assert torch.equal(part.streams[1].latents, traj.streams[1].latents[whole:whole + 1])


def test_trajectory_format_1_payloads_and_files_still_load(tmp_path):
    traj = _trajectory(sde_steps=True)
    wire = _over_json(traj.to_wire())
    for name in ("token_sigmas", "frozen", "counts", "prev_x0_preds", "streams"):
        del wire[name]
    wire["format"] = "flowrl.RolloutTrajectory/1"
    _same_trajectory(RolloutTrajectory.from_wire(wire), traj)
    metadata = {"format": "flowrl.RolloutTrajectory/1", "mode": traj.mode, "noise_level": repr(float(traj.noise_level)),
                "log_prob": traj.log_prob_kind, "reduction": traj.reduction}
    S.save_safetensors(tmp_path / "v1.safetensors", traj._tensors(), metadata)
    _same_trajectory(RolloutTrajectory.load(tmp_path / "v1.safetensors"), traj)
    wire["token_sigmas"] = None  # /2 keys in a /1 payload are refused
    with pytest.raises(ValueError, match="unexpected keys"):
        RolloutTrajectory.from_wire(wire)
