"""Argument checks the command-line entry points share (the simulator, the evaluation)."""

from __future__ import annotations

import os
from pathlib import Path


def output_folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot be an output folder (its nearest existing ancestor is a file, or not
    writable), or None: checked before any work, so a bad folder is not found after a run."""
    existing = next((parent for parent in (path, *path.parents) if parent.exists()), None)
    if existing is not None and not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if existing is not None and not os.access(existing, os.W_OK):
        return f"{existing} is not writable"
    return None
