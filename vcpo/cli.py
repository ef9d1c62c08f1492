"""Argument checks the command-line entry points share (the simulator, the evaluation, the scripts that write tables)."""

from __future__ import annotations

import os
from collections.abc import Mapping
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


def snakemake_state_problem(folder: Path | None = None) -> str | None:
    """Why Snakemake cannot keep its state (``.snakemake``) in ``folder`` (default: the working folder, where it keeps
    it), or None; tried by making that folder, since a read-only mount refuses even root, whom os.access lets by."""
    state = (Path.cwd() if folder is None else Path(folder)) / ".snakemake"
    try:
        state.mkdir(exist_ok=True)
    except OSError as error:
        return (f"Snakemake keeps its state in {state}, which cannot be made ({error.strerror or error}): "
                "run from a writable folder")
    return None


def shrink_problem(table: Path, recorded: Mapping[str, int], new: Mapping[str, int], remedy: str, rows: str = "rows",
                   unit: str = "rows") -> str | None:
    """Why writing ``new`` over the table file ``table`` would lose what it holds (None: it would not), in one line that
    ends with ``remedy`` (how to write elsewhere). ``recorded`` and ``new`` map each of the table's ``rows`` to its size
    in ``unit`` (the problems a row was evaluated on, the rounds it was measured in: 1 where a row has no size); a row
    dropped, or one of fewer ``unit``, is a loss: committed tables are replaced only by runs that did as much."""
    if missing := [name for name in recorded if name not in new]:
        named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return f"{table} holds {rows} {named} that this run lacks: nothing written; {remedy}"
    for name, size in recorded.items():
        if new[name] < size:
            return f"{table} has {name} over {size} {unit} and this run would have {new[name]}: nothing written; {remedy}"
    return None
