"""Results (bench/run.py): a row of the table (``Row``), the markdown table, an earlier CSV's rows with their
byte columns recomputed (``retabulate``), and the CSV and .md a run writes (``write_results``)."""
from __future__ import annotations

import csv
import math
import os
import re
from dataclasses import asdict, dataclass, fields
from typing import Dict, List, Sequence, Tuple

import torch

from cases import DTYPES
from roofline import set_bytes, set_rates


@dataclass
class Row:
    op: str
    mode: str
    dtype: str
    shape: str
    impl: str
    time_ms: float = math.nan
    gbps: float = math.nan  # over min_bytes
    pct_copy: float = math.nan
    min_b_elem: float = math.nan  # min_bytes / N
    model_b_elem: float = math.nan  # kernel_bytes / N (MODELLED_IMPLS only)
    gbps_model: float = math.nan  # over kernel_bytes
    pct_copy_model: float = math.nan
    x_eager: float = math.nan
    x_compile: float = math.nan
    peak_extra_mib: float = math.nan
    peak_x_eager: float = math.nan
    grad_mib: float = math.nan
    check_err: float = math.nan
    bound_pct: float = math.nan  # the static roofline bound of the op's kernels, % of copy (flowrl-triton)
    note: str = ""


def _fmt(value: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def markdown_table(rows: Sequence[Row]) -> str:
    head = ("| op | mode | dtype | shape | impl | time ms | min B/elem | GB/s | % copy | model B/elem "
            "| GB/s (model) | % copy (model) | static bound % copy | x eager | x compile | peak MiB (x eager) | note |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        peak = "-" if math.isnan(r.peak_extra_mib) else (
            f"{_fmt(r.peak_extra_mib)} ({_fmt(r.peak_x_eager, 2)})" if not math.isnan(r.peak_x_eager)
            else _fmt(r.peak_extra_mib))
        lines.append(
            f"| {r.op} | {r.mode} | {r.dtype} | {r.shape} | {r.impl} | {_fmt(r.time_ms)} | {_fmt(r.min_b_elem, 4)} "
            f"| {_fmt(r.gbps)} | {_fmt(r.pct_copy, 2)} | {_fmt(r.model_b_elem, 4)} | {_fmt(r.gbps_model)} "
            f"| {_fmt(r.pct_copy_model, 2)} | {_fmt(r.bound_pct, 3)} | {_fmt(r.x_eager, 2)} | {_fmt(r.x_compile, 2)} | {peak} | {r.note} |"
        )
    return "\n".join(lines)


def retabulate(csv_path: str) -> Tuple[List[Row], Dict[str, str]]:
    """The rows of a results CSV, their byte columns recomputed from the recorded times with the
    current ``min_bytes`` and ``kernel_bytes`` (the copy bandwidth is the one recorded with them), so
    a table taken under an older byte count reads the same as a new one. Returns (rows, header)."""
    row_fields = {f.name for f in fields(Row)}
    rows: List[Row] = []
    header: Dict[str, str] = {}
    with open(csv_path, newline="") as f:
        for rec in csv.DictReader(f):
            header = {k: v for k, v in rec.items() if k not in row_fields}
            row = Row(**{k: (v if k in ("op", "mode", "dtype", "shape", "impl", "note") else float(v or "nan"))
                         for k, v in rec.items() if k in row_fields})
            shape = [int(d) for d in row.shape.split("x")]
            numel = math.prod(shape)
            set_bytes(row, numel, shape[0], torch.empty((), dtype=DTYPES[row.dtype]).element_size())
            if not math.isnan(row.time_ms):
                # the unrounded copy bandwidth of that run, from its own GB/s and % copy
                copy = 100 * float(rec["gbps"]) / float(rec["pct_copy"])
                set_rates(row, row.time_ms, numel, copy)
            rows.append(row)
    return rows, header


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def write_results(rows: Sequence[Row], header: Dict[str, str], table: str, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    suite = "".join(f"_{name}" for name in dict.fromkeys(header.get(k) for k in ("suite", "tag")) if name)
    stem = _slug(f"{header['machine']}_torch-{header['torch']}_triton-{header['triton']}_{header['date']}{suite}")
    path = os.path.join(out_dir, stem + ".csv")
    names = list(header) + [f.name for f in fields(Row)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in rows:
            writer.writerow({**header, **asdict(r)})
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write("\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n\n" + table + "\n")
    return path
