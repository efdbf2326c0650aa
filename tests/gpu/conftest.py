"""The GPU suite (`pytest -m gpu`, `make test-gpu`): every test here is marked `gpu` and skipped where torch sees no
CUDA device, so a CPU-only run (CI) runs none of them."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    cuda = torch.cuda.is_available()
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (the GPU suite: make test-gpu)"))
