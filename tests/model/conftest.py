"""Fixtures shared by the model tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """LAMINA_CACHE_DIR in a temporary folder: the GGUF conversion cache of one test."""
    d = tmp_path / "lamina-cache"
    monkeypatch.setenv("LAMINA_CACHE_DIR", str(d))
    return d
