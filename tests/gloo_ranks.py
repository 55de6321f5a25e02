"""Runs a check in several CPU processes joined by a gloo process group, as sequence parallelism
runs: the one harness of the SP tests (test_distributed.py, test_per_token_distributed.py,
test_losses_distributed.py). ``backend="nccl"`` joins them with NCCL instead, rank r on cuda:r (the GPU
check's variant)."""
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from interpreter_launches import patch_each_launch_once


def _worker(rank, world, port, check, backend="gloo"):
    torch.set_num_threads(1)
    patch_each_launch_once()  # conftest.py's, in this spawned rank too
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        check(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(check, world, deadline_s=180, backend="gloo"):
    """``check(rank, world)`` in ``world`` spawned processes (a module-level function, so that it can be
    sent to them); fails the test if a rank fails or they have not all finished within ``deadline_s``."""
    ctx = mp.start_processes(_worker, args=(world, _free_port(), check, backend), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{world} SP ranks did not finish within {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
