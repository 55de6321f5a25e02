"""Command line: ``python -m flowrl demo [flags]`` (the main job) and ``python -m flowrl info``."""
from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "demo"
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(argv)
    if command == "info":
        import torch

        import flowrl

        print(f"flowrl {flowrl.__version__}, torch {torch.__version__}, backends: {', '.join(flowrl.available_backends())}, "
              f"CUDA: {'yes' if torch.cuda.is_available() else 'no'}, reduction chunk: {flowrl.CHUNK_SIZE} elements")
        return 0
    print("usage: python -m flowrl {demo,info} [flags]  (python -m flowrl demo --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
