"""Shared fixtures. Real-model tests are marked ``real_model``; they fetch the model into the cache
(``tsspec pull``) on first use, so a clean machine needs nothing by hand."""

from __future__ import annotations

import os

import pytest
import torch

# Threads for the real-model modules (TSSPEC_TEST_THREADS, default 1). Results do not depend on it,
# but on a loaded machine OpenMP oversubscription makes multi-threaded runs up to ~40x slower.
REAL_MODEL_THREADS = int(os.environ.get("TSSPEC_TEST_THREADS", "1"))


@pytest.fixture(scope="module")
def real_model_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(REAL_MODEL_THREADS)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def real_model_path():
    """``real_model_path(name) -> Path`` of a known real model, pulled into the cache if missing."""
    from tsspec.hub import ensure_model

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = ensure_model(name)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def one_thread():
    """Tiny products gain nothing from threads (and only noise on a shared machine): one thread
    for the module, then back. Batch invariance is tested at 1 and 2 threads in test_weights*."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    """The full fuzz corpus (``fuzz``) runs only when asked for with ``-m fuzz``; the default run
    has its seeded subset (tests/test_fuzz.py)."""
    if "fuzz" in (config.option.markexpr or ""):
        return
    keep = [i for i in items if i.get_closest_marker("fuzz") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("fuzz") is not None])
        items[:] = keep
