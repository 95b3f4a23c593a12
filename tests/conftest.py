"""`@pytest.mark.gpu` tests run only where CUDA is available (never in CI here: they are skipped)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return  # torch is imported only when a GPU test was collected
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
        for item in gpu_items:
            item.add_marker(skip)
