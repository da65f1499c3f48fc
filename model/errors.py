"""Errors raised while loading checkpoints; each names the file and what is wrong."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """A checkpoint could not be loaded. The message names the file and the problem."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
