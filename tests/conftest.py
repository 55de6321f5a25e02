import os

import torch

# Without a GPU the Triton kernels run through Triton's interpreter, which must be switched on
# before any @triton.jit function is defined, i.e. before flowrl.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tests use small tensors: on a small, shared CPU, torch's worker threads only stall each
    # other (seen: a 0.5 s test taking 16 s). Results do not depend on it (fixed reduction order).
    torch.set_num_threads(1)
