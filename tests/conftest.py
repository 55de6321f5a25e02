import os

import torch

# Without a GPU the Triton kernels run through Triton's interpreter, which must be switched on
# before any @triton.jit function is defined, i.e. before flowrl.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
