"""Kernels run on the GPU when there is one, else on the CPU under the Triton interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any module defining a @triton.jit kernel is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
