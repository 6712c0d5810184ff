import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Triton kernels run on the CPU through the interpreter where there is no GPU. Set before any
# test module imports triton-decorated code.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (run `-m cuda` on the GPU machine)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine: pytest -m cuda)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
