"""Kernels run on the GPU when there is one, else on the CPU under the Triton interpreter; what the kernel tests share."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any module defining a @triton.jit kernel is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # under pytest-xdist (-n), each worker's torch takes its share of the cores: a thread per core in every
    # worker would run workers x cores threads on the cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_configure(config):
    # pytest-xdist (--dist load) hands a worker a run of consecutive tests: the long ones, ordered first below, would
    # all go to the first worker. One test at a time spreads them (xdist's own advice for a few slow tests).
    if config.pluginmanager.hasplugin("xdist") and config.getoption("maxschedchunk", None) is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(items):
    """The tests marked ``long`` first (in their order), so that no worker starts one while the others run out of
    tests (they came after most of the suite: with them first, the core suite on two workers and cold caches took 19
    min instead of 30-31, 2026-12-05)."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def assert_few_flipped(per_tile: torch.Tensor) -> None:
    """Kernel and reference quantized the same tiles alike (relative error ``per_tile`` of each record's read-back)
    but where the normalisation's choice of iterate went the other way in a near tie: one record in 16 at most (at
    most one in these tests' runs, 0.016 off on the GPU; under the interpreter none, 6e-5 at most), and that one
    still close: a near tie's iterates are alike, so 0.05 is 3x the flip seen, and below the 4-bit keys' own error
    (~0.08) that a tile quantized wrongly would show."""
    far = int((per_tile > 1e-3).sum())
    print(f"per_tile max {per_tile.max():.4f} far {far} of {per_tile.numel()}")  # captured: shown with -rA
    assert far <= max(1, per_tile.numel() // 16), f"{far} of {per_tile.numel()} quantized tiles differ beyond rounding"
    assert per_tile.max() < 0.05, f"a quantized tile differs by {per_tile.max():.3f}"
