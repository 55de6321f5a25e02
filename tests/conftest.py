import os
import sys
from pathlib import Path

import pytest
import torch

# The tests mirror the source's layers (tests/ops, backends, kernels, rollout, data, losses, compat,
# apps; tests/repo: the README, docs and packaging). The shared helpers (oracle data, tiny pipelines,
# process-group ranks, the AOT runs, the peers' transcriptions and the shared fixtures: peer_steps,
# peer_losses, loss_cases, trainer_loops) sit here in tests/, on the path for every module; the layer
# folders are on it too (``from peer_steps import ...``).
TESTS = Path(__file__).resolve().parent
for _folder in [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# Without a GPU the Triton kernels run through Triton's interpreter, which must be switched on
# before any @triton.jit function is defined, i.e. before flowrl.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tests use small tensors: on a small, shared CPU, torch's worker threads only stall each
    # other (seen: a 0.5 s test taking 16 s). Results do not depend on it (fixed reduction order).
    torch.set_num_threads(1)


from interpreter_launches import patch_each_launch_once  # noqa: E402 (after TRITON_INTERPRET is set)

patch_each_launch_once()


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected
def pytest_collection_modifyitems(config, items):
    """The tests that read the full AOT compile run (marked ``aot``) run last, and the run starts now in
    the background (tests/aot_runs.py): it keeps every core busy while the rest of the suite runs one
    thread, instead of after it."""
    reads = [item for item in items if item.get_closest_marker("aot")]
    if not reads or config.option.collectonly:
        return
    items[:] = [item for item in items if not item.get_closest_marker("aot")] + reads
    import aot_runs

    if aot_runs.CAN_COMPILE:
        aot_runs.start()  # in a pytest-xdist worker: asks the controller to (below)


def pytest_configure(config):
    """Under pytest-xdist (``-n``), in the controller: the AOT runs are the controller's, once for the
    session, instead of every worker's (tests/aot_runs.py, ``share``)."""
    distributed = config.getoption("dist", "no") != "no" and config.getoption("tx", None)  # as xdist decides
    if distributed and not hasattr(config, "workerinput") and not config.option.collectonly:
        import aot_runs

        aot_runs.share()


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: in its controller, as each worker's collection is in
def pytest_xdist_node_collection_finished(node, ids):
    import aot_runs

    if aot_runs.CAN_COMPILE and aot_runs.wanted():
        aot_runs.start()
