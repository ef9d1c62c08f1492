"""Exclusive locks on folders and cache entries that several processes may write (a run folder, an SFT
base, a generated task split), and atomic rewrites of the files inside them.

A lock is ``fcntl.flock`` on a file beside what it guards: the kernel releases it when its process ends,
however it ends (SIGKILL, a crash, a reboot), so a lock left behind never blocks anyone. The lock file
holds the holder's PID and host, for the message a refused process prints.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".lock"


class FolderInUse(RuntimeError):
    """Another live process holds the lock; the message names the folder and that process."""


def _holder(handle) -> str:
    handle.seek(0)
    text = handle.read().strip()
    return f"process {text}" if text else "another process"


def _claim(handle) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()} on {socket.gethostname()}")
    handle.flush()


@contextlib.contextmanager
def exclusive(path: Path, *, wait: bool) -> Iterator[None]:
    """Hold the lock file ``path`` (created if missing) for the block. ``wait=False``: raise FolderInUse at
    once if another process holds it; ``wait=True``: block until it is free."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise FolderInUse(f"{path.parent} is in use by {_holder(handle)} (lock {path.name}); "
                              "wait for it to end, or use another folder") from None
        try:
            _claim(handle)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_folder_lock(folder: Path) -> contextlib.AbstractContextManager[None]:
    """One writer per run folder: a second process on the same folder is refused at once."""
    return exclusive(Path(folder) / LOCK_FILE, wait=False)


def cache_dir() -> Path:
    """The project's cache (generated puzzle sets, simulator bases, fetched models, composed verl configs):
    $VCPO_CACHE_DIR, else ~/.cache/vcpo."""
    return Path(os.environ.get("VCPO_CACHE_DIR") or Path.home() / ".cache" / "vcpo")


def cache_entry_lock(entry: Path) -> contextlib.AbstractContextManager[None]:
    """One builder per cache entry (``entry``: the folder or file it will become): a second builder waits,
    then finds the entry built."""
    entry = Path(entry)
    return exclusive(entry.parent / f".{entry.name}.lock", wait=True)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path``'s content with ``text`` so that a crash leaves the old file or the new, never half."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(text)
    except OSError as error:  # a full disk, say: nothing half-written is left, and the file is named
        partial.unlink(missing_ok=True)
        raise OSError(error.errno, f"{error.strerror or error} while writing {path}") from None
    partial.replace(path)
