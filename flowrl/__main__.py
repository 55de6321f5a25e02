"""Command line: ``python -m flowrl demo [flags]`` (the main job), ``python -m flowrl example [flags]``
(a GRPO training run on a tiny diffusers transformer) and ``python -m flowrl info``."""
from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "demo"
    # each command imports only its own app (lazy: the example's run needs diffusers, `info` neither app)
    if command == "demo":
        from .apps.demo import main as demo_main

        return demo_main(argv)
    if command == "example":
        from .apps.example import main as example_main

        return example_main(argv)
    if command == "info":
        import torch

        import flowrl

        print(f"flowrl {flowrl.__version__}, torch {torch.__version__}, backends: {', '.join(flowrl.available_backends())}, "
              f"CUDA: {'yes' if torch.cuda.is_available() else 'no'}, reduction chunk: {flowrl.CHUNK_SIZE} elements")
        return 0
    # "{demo,info}" stays as it was (tests/apps/test_demo.py matches it); the example command is named after it
    print("usage: python -m flowrl {demo,info} [flags]  (python -m flowrl demo --help)\n"
          "       python -m flowrl example [flags]  (a GRPO training run; python -m flowrl example --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
