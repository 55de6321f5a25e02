"""The compile of one specialization for a real target (``compile_specialization``), the reading of
its cubin (cuobjdump's resources, nvdisasm's SASS: ``cubin_text``, ``disassemble``, ``sass_count``)
and ``check``, the whole list compiled and analyzed in parallel."""
from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Dict, List, Sequence

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flowrl.backends import _triton_ops
from flowrl.contract import Mode, NoiseSource
from flowrl.kernels import loss as loss_kernels
from flowrl.kernels import step as step_kernels
from flowrl.kernels import token as token_kernels

from .launches import ARCHS, STORAGES, Specialization
from .roofline import bytes_per_element, hot_specializations, is_hot, roofline_target, sass_fields
from .steps import specializations


def compile_specialization(spec: Specialization, arch: int = 90, kernel=None):
    """Compile ``spec`` for sm_{arch} with the launch options the backend uses (no FMA contraction);
    returns Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``). ``kernel``:
    a @triton.jit function (default: flowrl.kernels.step's kernel named ``spec.kernel``)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the AOT compile needs real @triton.jit functions: unset TRITON_INTERPRET")
    if kernel is None:  # the step kernels, then flowrl.losses' (kernels/loss.py)
        kernel = (getattr(step_kernels, spec.kernel, None) or getattr(loss_kernels, spec.kernel, None)
                  or getattr(token_kernels, spec.kernel))
    signature = dict(spec.signature)
    for name in spec.constexprs:
        signature[name] = "constexpr"
    signature = {name: signature[name] for name in kernel.arg_names}  # in argument order
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in spec.aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=dict(spec.constexprs), attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    cx = spec.constexprs
    philox = cx.get("NOISE") == NoiseSource.PHILOX.value  # a step kernel's rollout drawing Philox noise
    cap = _triton_ops.register_cap(cx.get("TILES", 1), Mode(cx["MODE"]) if philox else None,
                       4 if spec.signature.get("x_ptr") == "*fp32" else 2)
    options = backend.parse_options({"num_warps": spec.num_warps, "enable_fp_fusion": False, **cap})
    return triton.compile(source, target=target, options=options.__dict__)


def _tool(name: str) -> str:
    """The path of a CUDA tool the triton wheel ships (ptxas, cuobjdump, nvdisasm)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_BRANCH = re.compile(r"\bBRA\b.*\b0x([0-9a-f]+)\s*$")


def cubin_text(cubin: bytes) -> bytes:
    """The machine code of a one-kernel cubin: its ``.text.<kernel>`` section (ELF64 section headers)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    strings = headers[names][4]
    texts = [cubin[offset:offset + size] for name, _, _, _, offset, size in headers
             if cubin[strings + name:cubin.index(b"\0", strings + name)].startswith(b".text.")]
    if len(texts) != 1:
        raise ValueError(f"expected one .text section in the cubin, found {len(texts)}")
    return texts[0]


def disassemble(texts: Sequence[bytes], arch: int = 90) -> List[str]:
    """The nvdisasm listing of each machine-code section (``cubin_text``), all from one nvdisasm call:
    its start-up (~0.7 s, tables it builds) is most of one kernel's disassembly. The sections go in
    concatenated as a raw SM{arch} instruction stream (128-bit instructions, branches PC-relative, so
    each decodes as in its cubin); the listing is split back at their offsets, and its branch targets
    are addresses in the concatenation (``sass_count`` compares them to the branch's own)."""
    if not texts:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "text.bin")
        with open(path, "wb") as f:
            f.write(b"".join(texts))
        listing = subprocess.run([_tool("nvdisasm"), "-b", "SM90a" if arch == 90 else f"SM{arch}", path],
                                 capture_output=True, text=True, check=True).stdout
    ends, start = [], 0
    for text in texts:
        start += len(text)
        ends.append(start)
    parts, k = [[] for _ in texts], 0
    for line in listing.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        while int(m.group(1), 16) >= ends[k]:
            k += 1
        parts[k].append(line)
    return ["\n".join(part) for part in parts]


def sass_count(listing: str):
    """(instructions, runtime loops) of a kernel's listing (``disassemble``). Instructions: every
    instruction but the NOP padding and the self-branch after the final EXIT. A runtime loop is a
    branch to an earlier instruction (the self-branch excepted); with none, every instruction runs at
    most once per thread, so the count times the threads is an upper bound of the dynamic count (it
    includes the rarely taken slow paths of IEEE division and square root)."""
    count, loops = 0, 0
    for line in listing.splitlines():
        m = _INSTRUCTION.match(line)
        if not m or m.group(2).startswith("NOP"):
            continue
        count += 1
        target = _BRANCH.search(m.group(2))
        if target:
            at, to = int(m.group(1), 16), int(target.group(1), 16)
            if to == at:  # BRA to itself: the trap after EXIT
                count -= 1
            elif to < at:
                loops += 1
    return count, loops


def sass_of(compiled):
    """(instructions, runtime loops) of a compiled kernel (``sass_count``), for its target's arch."""
    return sass_count(disassemble([cubin_text(compiled.asm["cubin"])], compiled.metadata.target.arch)[0])


def analyze(compiled, spec: Specialization, sass: bool = False) -> Dict[str, object]:
    """Registers, spills, shared memory (cuobjdump's resource usage of the cubin), the global loads and
    stores in the PTX and how many are 128-bit (the latents' vectorized accesses; the per-sample
    scalars are narrower), barriers in the PTX, the minimum bytes moved per element
    (``bytes_per_element``), and with ``sass`` the SASS instructions per element of the program
    (``sass_of``) and the roofline bound (``sass_fields``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    widths = {"ld": [], "st": []}
    for kind, vec, bits in _GLOBAL_ACCESS.findall(compiled.asm["ptx"]):
        widths[kind].append(int(vec or 1) * int(bits))
    wide = {kind: sum(w == 128 for w in ws) for kind, ws in widths.items()}
    row = {
        "registers": int(fields.get("REG", 0)), "spill_bytes": int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0)),
        "shared_bytes": int(compiled.metadata.shared), "loads": len(widths["ld"]), "loads_128": wide["ld"],
        "stores": len(widths["st"]), "stores_128": wide["st"],
        "barriers": len(re.findall(r"\b(?:bar|barrier)\.sync\b", compiled.asm["ptx"])),
        "bytes_per_element": bytes_per_element(spec), "target": roofline_target(spec),
    }
    row.update(sass_fields(spec, *(sass_of(compiled) if sass else (None, None))))
    return row


def _run_one(job):
    """One specialization compiled and analyzed; where its SASS is to be counted, its machine code
    rides along (``_text``) for ``check``'s batched disassembly."""
    spec, storage, arch, sass = job
    row = {"kernel": spec.kernel, "storage": storage, "arch": f"sm_{arch}", "triton": triton.__version__,
           "label": spec.label, "num_warps": spec.num_warps}
    try:
        compiled = compile_specialization(spec, arch)
        row.update(analyze(compiled, spec))
        if sass:
            row["_text"] = cubin_text(compiled.asm["cubin"])
    except Exception as exc:  # report every failure, then fail the run
        lines = str(exc).strip().splitlines()
        row.update(ok=False, error=f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:500])
    return row


def _count_sass(work, rows, jobs):
    """The SASS fields of the rows whose machine code rode along, disassembled in ``jobs`` batches per
    arch (``disassemble``: one nvdisasm start-up per batch, not per kernel), run side by side."""
    batches = []
    for arch in sorted({job[2] for job in work}):
        todo = [k for k, (job, row) in enumerate(zip(work, rows)) if job[2] == arch and "_text" in row]
        size = max(1, -(-len(todo) // max(1, jobs)))
        batches += [(arch, todo[i:i + size]) for i in range(0, len(todo), size)]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        listings = pool.map(lambda b: disassemble([rows[k].pop("_text") for k in b[1]], b[0]), batches)
        for (_, ks), parts in zip(batches, listings):
            for k, listing in zip(ks, parts):
                rows[k].update(sass_fields(work[k][0], *sass_count(listing)))


def _verdict(row):
    """ok, or the error: a compile failure (already set), register spills, runtime loops."""
    if "ok" in row:
        return row
    row["ok"] = row["spill_bytes"] == 0 and not row["loops"]
    if row["spill_bytes"]:
        row["error"] = f"{row['spill_bytes']} bytes of local memory (register spills)"
    elif row["loops"]:
        row["error"] = f"{row['loops']} runtime loops (backward branches): SASS per element is not a dynamic count"
    return row


def check(archs: Sequence[int] = ARCHS, storages: Sequence[str] = STORAGES, quick: bool = False,
          jobs: int = 1, sass: bool = False, hot: bool = False, match: Sequence[str] = (),
          sass_hot: bool = False, spot_archs: Sequence[int] = ()) -> List[Dict[str, object]]:
    """Compile and analyze every specialization (``hot``: the hot ones only, ``hot_specializations``;
    ``match``: only those whose "kernel: label" contains one of the substrings); one result dict per
    (specialization, storage, arch). ``sass``: count the SASS of each; ``sass_hot``: of the hot ones
    on sm_90 only (the roofline's rows, from the same compile as the rest: tests/kernels/test_compile.py);
    ``spot_archs``: the archs of ``archs`` compiled for a spot check only, the hot bf16 specializations."""
    work = [(spec, storage, arch, sass or (sass_hot and arch == 90 and is_hot(spec)))
            for arch in archs for storage in storages if arch not in spot_archs or storage == "bf16"
            for spec in (hot_specializations(storage) if hot or arch in spot_archs
                         else specializations(storage, quick))
            if not match or any(m in f"{spec.kernel}: {spec.label}" for m in match)]
    if jobs <= 1:
        rows = [_run_one(job) for job in work]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            rows = list(pool.map(_run_one, work, chunksize=4))
    _count_sass(work, rows, jobs)
    return [_verdict(row) for row in rows]
