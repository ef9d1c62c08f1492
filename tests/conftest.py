"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from vcpo.verl_contract import select_cpu_platform

FIXTURE_DATA = Path(__file__).parent / "fixtures" / "data"

# Tests that run verl in this process (the engine tests) run it on the CPU platform, as the launcher's
# workers do. verl resolves its platform once, when it is first imported: import it here with the
# platform selected, then restore the environment, so that subprocesses (simulator runs, the launcher)
# start as they would outside the tests. (The engine tests are CPU tests, on a GPU machine too.)
if importlib.util.find_spec("verl") is not None:
    _environment = dict(os.environ)
    select_cpu_platform()
    import verl  # noqa: E402,F401

    os.environ.clear()
    os.environ.update(_environment)

# pytest -n N runs N workers on the machine's cores: torch's default of a thread per core in each would oversubscribe
# them. (Subprocesses choose their own threads, as outside the tests.)
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@dataclass(frozen=True)
class BenchmarkData:
    """Where the benchmark files are: the full set (``real``) or this project's 20-row fixtures."""

    root: Path
    real: bool

    def file(self, benchmark: str) -> Path:
        return self.root / benchmark / "test.jsonl"


@pytest.fixture(scope="session")
def benchmark_data() -> BenchmarkData:
    """The folder named by ``VCPO_SHARED_DATA`` (CI sets it to shared/data), else tests/fixtures/data."""
    shared = os.environ.get("VCPO_SHARED_DATA")
    if not shared:
        return BenchmarkData(FIXTURE_DATA, real=False)
    if not Path(shared).is_dir():
        raise FileNotFoundError(f"VCPO_SHARED_DATA={shared} is not a folder")
    return BenchmarkData(Path(shared), real=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 checkpoint with a locally trained tokenizer (vcpo.local_models), saved once per session."""
    from vcpo.local_models import save_random_model

    return save_random_model(tmp_path_factory.mktemp("tiny-model"), vocab_size=320, hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A one-rank gloo group in this process, for engines built in it (the verl engine tests)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield


@pytest.fixture
def listener():
    """A TCP server on the caller's loopback that counts the connections it accepts."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def accept_loop():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_loop, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()
