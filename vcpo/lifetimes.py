"""A process's life tied to another's, so that nothing a runner started outlives it (Linux).

``die_with_parent`` ties a child to the thread that started it (PR_SET_PDEATHSIG); ``die_with`` ties a
process to any other process, however many processes lie between (a study's training under Snakemake's
job processes), through a pidfd; a runner names itself to its descendants in ``DIE_WITH_ENV``.
``run_jobs_with_snakemake`` is how the runners (a study's, a simulator sweep) start Snakemake under both ties.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

DIE_WITH_ENV = "VCPO_DIE_WITH"  # a pid: a simulator run that finds it ends (SIGTERM) when that process ends


def die_with_parent(signum: int) -> None:
    """In a child (e.g. before exec): ``signum`` when the thread that started it ends, however it ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
    except OSError:  # no glibc: the caller's own cleanup is all there is
        pass


def dies_with_this_thread() -> None:
    """A script's ``preexec_fn`` for a child it starts: SIGKILL when the thread that started it ends, however it ends,
    so that nothing a killed script started computes on (or writes) without it."""
    die_with_parent(signal.SIGKILL)


def die_with(pid: int, signum: int = signal.SIGTERM) -> None:
    """``signum`` to this process when process ``pid`` ends (at once if it has ended already)."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signum)
        return

    def watch() -> None:
        select.select([handle], [], [])
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name=f"die-with-{pid}", daemon=True).start()


def die_with_the_named_runner() -> None:
    """``die_with`` the process ``DIE_WITH_ENV`` names, if any."""
    if pid := os.environ.get(DIE_WITH_ENV):
        die_with(int(pid))


def run_jobs_with_snakemake(snakefile: Path, configfile: Path, cores: int) -> None:
    """A runner's jobs (``snakefile``'s ``rules``, set up by ``configfile``), ``cores`` at a time, through Snakemake,
    which dies with this thread and names this process to every training below it, so that both die with the
    runner. Failed jobs do not stop the others; the caller reads what got made."""
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), "--configfile", str(configfile),
               "--cores", str(cores), "--nolock", "--keep-going", "--rerun-incomplete", "--rerun-triggers", "mtime",
               "--quiet", "rules"]
    subprocess.run(command, env={**os.environ, DIE_WITH_ENV: str(os.getpid())}, preexec_fn=lambda: die_with_parent(signal.SIGKILL))
