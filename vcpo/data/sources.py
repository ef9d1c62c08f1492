"""Raw records from a local file (json, jsonl, parquet) or from the Hugging Face hub, failing fast offline."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vcpo.data.datasets import DatasetSpec

HUB_PROBE_TIMEOUT_S = 3.0
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


class HubUnavailableError(ConnectionError):
    """The hub cannot be reached (or offline mode is on) and no local copy was given."""


def read_local(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a ``.json`` (a list, or JSON lines), ``.jsonl`` or ``.parquet`` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"source file not found: {path}")
    if path.suffix not in LOCAL_SUFFIXES:
        raise ValueError(
            f"source {path}: unsupported file type {path.suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}"
        )
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        records = json.loads(text)
    else:
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"source {path}, line {number}: not a JSON object ({error.msg})") from None
    if not all(isinstance(record, dict) for record in records):
        raise ValueError(f"source {path}: expected JSON objects, one per record")
    return records


def read_hub(task: DatasetSpec, split: str) -> list[dict[str, Any]]:
    """Every record of ``split`` of the task's hub dataset (or the local datasets cache when offline)."""
    if not _offline_mode() and not _hub_reachable():
        raise HubUnavailableError(_unreachable_message(task, split))
    import datasets

    try:
        dataset = datasets.load_dataset(task.hub_id, task.hub_config, split=task.hub_split(split))
    except (ConnectionError, OSError) as error:  # offline mode without a cached copy lands here too
        raise HubUnavailableError(_unreachable_message(task, split)) from error
    return list(dataset)


def _offline_mode() -> bool:
    # What load_dataset itself obeys (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, read when datasets is imported).
    import datasets

    return bool(datasets.config.HF_HUB_OFFLINE)


def _hub_reachable() -> bool:
    """Whether a TCP connection to the hub opens within a few seconds.

    datasets would otherwise retry for half a minute before failing. The probe runs in a daemon
    thread because name resolution ignores socket timeouts.
    """
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    address = (endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80))
    connected: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection(address, timeout=HUB_PROBE_TIMEOUT_S).close()
            connected.append(True)
        except OSError:
            connected.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S)
    return connected == [True]


def _unreachable_message(task: DatasetSpec, split: str) -> str:
    example = f" such as ../shared/data/{task.shared_files[split]}" if split in task.shared_files else ""
    return (
        f"cannot reach the Hugging Face hub for {task.hub_id} (split {split!r}); pass --source PATH "
        f"(source=PATH) to a local copy{example} (json, jsonl or parquet)"
    )
