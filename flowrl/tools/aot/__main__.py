"""The command line: ``python -m flowrl.tools.aot`` (the package's docstring)."""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile

from . import __doc__ as DOC
from .compile import check
from .launches import ARCHS, STORAGES
from .tables import markdown, roofline_markdown, update_docs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowrl.tools.aot", description=DOC.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), help="SM versions (default: 90 80)")
    parser.add_argument("--quick", action="store_true", help="one specialization per kernel and storage dtype")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: all cores)")
    parser.add_argument("--sass", action="store_true", help="also count SASS instructions per element")
    parser.add_argument("--hot", action="store_true", help="only the hot specializations (roofline targets)")
    parser.add_argument("--sass-hot", action="store_true",
                        help="count SASS instructions per element of the hot specializations on sm_90 only")
    parser.add_argument("--spot-arch", type=int, nargs="+", default=[], metavar="ARCH",
                        help="of --arch, the SM versions compiled for the hot bf16 specializations only")
    parser.add_argument("--storage", nargs="+", default=list(STORAGES), choices=STORAGES, help="latent dtypes")
    parser.add_argument("--roofline", action="store_true",
                        help="print the hot specializations' roofline table (implies --sass)")
    parser.add_argument("--match", nargs="+", default=[], metavar="SUBSTRING",
                        help="only the specializations whose 'kernel: label' contains one of these")
    parser.add_argument("--json", action="store_true", help="print every result as one JSON line")
    parser.add_argument("--markdown", action="store_true", help="print the per-kernel summary table")
    parser.add_argument("--update-docs", metavar="PATH", help="rewrite the table in PATH (both triton versions)")
    args = parser.parse_args(argv)
    # fresh: no cached build hides an error; removed at exit (a full run leaves hundreds of MB)
    os.environ["TRITON_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="flowrl-aot-")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    if args.update_docs:
        return update_docs(args.update_docs, args.arch, args.jobs)
    rows = check(args.arch, args.storage, quick=args.quick, jobs=args.jobs, sass=args.sass or args.roofline,
                 hot=args.hot, match=args.match, sass_hot=args.sass_hot, spot_archs=args.spot_arch)
    if args.json:
        print(json.dumps(rows))
    elif args.roofline:
        for storage in args.storage:
            for arch in args.arch:
                print(f"\n{storage}, sm_{arch}:\n" + roofline_markdown(rows, storage, f"sm_{arch}"))
    elif args.markdown:
        print(markdown(rows))
    else:
        for row in rows:
            status = "ok" if row["ok"] else f"FAILED {row['error']}"
            details = "" if "registers" not in row else (
                f" regs {row['registers']} spill {row['spill_bytes']} smem {row['shared_bytes']} "
                f"ld128 {row['loads_128']}/{row['loads']} st128 {row['stores_128']}/{row['stores']} bar {row['barriers']} "
                f"sass/elem {row['sass_per_element']} bytes/elem {row['bytes_per_element']} bound {row['bound']}")
            print(f"{row['kernel']:21s} {row['storage']:4s} {row['arch']} {row['label']:45s} {status}{details}")
        print(markdown(rows), file=sys.stderr)
    failed = [row for row in rows if not row["ok"]]
    if failed:
        print(f"{len(failed)} of {len(rows)} specializations failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
