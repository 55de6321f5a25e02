"""docs/kernels.md's tables: the per-kernel summary (``markdown``) and the roofline table
(``roofline_markdown``) of a run's rows, read back (``markdown_rows``) and rewritten between their
markers for both triton versions (``update_docs``, the CLI's ``--update-docs``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Sequence

from .compile import check


def summarize(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per (kernel, arch): specializations, failures, and the range of each measured quantity."""
    groups: Dict[tuple, List[Dict[str, object]]] = {}
    for row in rows:
        groups.setdefault((row["kernel"], row["arch"], row["triton"]), []).append(row)
    out = []
    for (kernel, arch, version), members in sorted(groups.items()):
        good = [r for r in members if "registers" in r]

        def span(key):
            values = [r[key] for r in good if r[key] is not None]
            return (min(values), max(values)) if values else (None, None)
        out.append({"kernel": kernel, "arch": arch, "triton": version, "compiled": len(good),
                    "failed": sum(not r["ok"] for r in members), "registers": span("registers"),
                    "spill_bytes": span("spill_bytes"), "shared_bytes": span("shared_bytes"),
                    "loads_128": span("loads_128"), "loads": span("loads"), "stores_128": span("stores_128"),
                    "stores": span("stores"),
                    "barriers": span("barriers"), "sass_per_element": span("sass_per_element"),
                    "bytes_per_element": span("bytes_per_element"), "bound": span("bound")})
    return out


def markdown(rows: List[Dict[str, object]]) -> str:
    """The per-kernel table of docs/kernels.md."""
    def fmt(pair):
        lo, hi = pair
        return "-" if lo is None else (f"{lo}" if lo == hi else f"{lo}-{hi}")
    lines = ["| kernel | target | triton | compiled | failed | registers | spill B | shared B | 128-bit loads (of) "
             "| 128-bit stores (of) | barriers | SASS / element | bytes / element | bound |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in summarize(rows):
        lines.append(f"| `{s['kernel']}` | {s['arch']} | {s['triton']} | {s['compiled']} | {s['failed']} | "
                     f"{fmt(s['registers'])} | {fmt(s['spill_bytes'])} | {fmt(s['shared_bytes'])} | "
                     f"{fmt(s['loads_128'])} ({fmt(s['loads'])}) | {fmt(s['stores_128'])} ({fmt(s['stores'])}) | "
                     f"{fmt(s['barriers'])} | "
                     f"{fmt(s['sass_per_element'])} | {fmt(s['bytes_per_element'])} | {fmt(s['bound'])} |")
    return "\n".join(lines)


def roofline_markdown(rows: List[Dict[str, object]], storage: str = "bf16", arch: str = "sm_90") -> str:
    """The hot specializations of ``storage`` on ``arch``, one line each, a column pair per triton
    version: SASS per element and the bound (fraction of copy bandwidth), against the target."""
    rows = [r for r in rows if r["storage"] == storage and r["arch"] == arch and r.get("target") is not None]
    versions = sorted({r["triton"] for r in rows})
    by = {(r["kernel"], r["label"], r["triton"]): r for r in rows}
    keys = sorted({(r["kernel"], r["label"]) for r in rows})
    head = "| kernel | specialization | bytes / element | " + " | ".join(
        f"SASS / element ({v}) | bound ({v})" for v in versions) + " | target |"
    lines = [head, "|" + " --- |" * (4 + 2 * len(versions))]
    for kernel, label in keys:
        cells = []
        first = by[(kernel, label, versions[0])]
        for v in versions:
            r = by.get((kernel, label, v), {})
            bound = r.get("bound")
            mark = "" if bound is None or bound >= first["target"] else " (below)"
            cells += [f"{r.get('sass_per_element')}", f"{bound}{mark}"]
        lines.append(f"| `{kernel}` | {label} | {first['bytes_per_element']} | " + " | ".join(cells)
                     + f" | {first['target']} |")
    return "\n".join(lines)


TABLE_START, TABLE_END = "<!-- aot-table:start -->", "<!-- aot-table:end -->"
ROOFLINE_START, ROOFLINE_END = "<!-- roofline-table:start -->", "<!-- roofline-table:end -->"


def markdown_rows(text: str, start: str, end: str) -> List[Dict[str, str]]:
    """The rows of the markdown table between the markers ``start`` and ``end`` of ``text`` (the tables
    ``update_docs`` writes), each {column heading: cell}; empty without the markers."""
    if start not in text or end not in text:
        return []
    lines = [ln for ln in text.split(start, 1)[1].split(end, 1)[0].strip().splitlines() if ln.startswith("|")]

    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]
    head = cells(lines[0]) if lines else []
    return [dict(zip(head, cells(line))) for line in lines[2:]]


def triton36_path() -> str:
    """Where ./run installs triton 3.6.0: <checkout>/.venv/triton-3.6 (this file is
    <checkout>/flowrl/tools/aot/tables.py in the editable install), or FLOWRL_TRITON36."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    return os.environ.get("FLOWRL_TRITON36", os.path.join(root, ".venv", "triton-3.6"))


def _replace_between(text: str, start: str, end: str, body: str) -> str:
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def update_docs(path: str, archs: Sequence[int], jobs: int) -> int:
    """Rows for the installed triton (here) and triton 3.6.0 (a subprocess with its wheel first on
    PYTHONPATH), with the hot specializations' SASS counts on sm_90 (tests/kernels/test_compile.py's run); the
    summary and the roofline table replace the text between their markers in ``path``."""
    rows = check(archs, jobs=jobs, sass_hot=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (triton36_path(), os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-m", "flowrl.tools.aot", "--json", "--sass-hot", "--jobs", str(jobs),
                          "--arch", *map(str, archs)], env=env, capture_output=True, text=True)
    if not res.stdout.strip():
        print(res.stderr[-3000:], file=sys.stderr)
        return 1
    old_rows = json.loads(res.stdout.strip().splitlines()[-1])
    if {row["triton"] for row in old_rows} != {"3.6.0"}:
        raise RuntimeError(f"expected triton 3.6.0 from {triton36_path()}; got {sorted({r['triton'] for r in old_rows})}")
    rows += old_rows
    with open(path) as f:
        text = f.read()
    if TABLE_START not in text or TABLE_END not in text:
        raise ValueError(f"{path} has no {TABLE_START} ... {TABLE_END} markers")
    text = _replace_between(text, TABLE_START, TABLE_END, markdown(rows))
    if ROOFLINE_START in text:
        text = _replace_between(text, ROOFLINE_START, ROOFLINE_END, roofline_markdown(rows))
    with open(path, "w") as f:
        f.write(text)
    failed = [row for row in rows if not row["ok"]]
    print(f"{len(rows)} specializations, {len(failed)} failed; table written to {path}")
    return 1 if failed else 0
