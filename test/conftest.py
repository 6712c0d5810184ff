import os

import torch

# Triton kernels run on the CPU through the interpreter where there is no GPU. Set before any
# test module imports triton-decorated code.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
