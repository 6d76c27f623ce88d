"""Shared fixtures. Real-model tests are marked ``real_model``; they fetch the model into the cache
(``tsspec pull``) on first use, so a clean machine needs nothing by hand."""

from __future__ import annotations

import pytest


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
