"""What produced a run: the code (git commit, uncommitted changes), the machine (CPU, the floating-point
kernels torch dispatches to), the threads, the library versions, and when (UTC).

A fixed-seed simulator run is deterministic on one CPU type and may end elsewhere on another: the CPU's
vector width selects torch's kernels (``torch.backends.cpu.get_cpu_capability()``), and MKL and oneDNN
choose theirs by CPU unless the environment pins them (``KERNEL_ENV``). Recording both lets a reader
tell a re-run that should match exactly from one that should only fall inside its arm's spread.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import vcpo

# environment variables that pin the floating-point kernels (unset: each library picks by CPU)
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_versions() -> dict[str, str]:
    import torch
    import transformers
    import verl

    return {"python": platform.python_version(), "vcpo": vcpo.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "verl": verl.__version__}


def code_state(package_dir: Path | None = None) -> dict:
    """``commit`` (HEAD of the git checkout holding the vcpo package) and ``dirty`` (tracked files differ
    from it); both None where the package is not in a git checkout (an installed wheel)."""
    package_dir = Path(package_dir or Path(vcpo.__file__).parent)

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(package_dir), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def is_committed(path: Path) -> bool:
    """Whether ``path`` is tracked by its git checkout and identical to its copy at HEAD."""
    path = Path(path).resolve()
    if not path.exists():
        return False
    folder = path.parent

    def git_ok(*args: str) -> bool:
        try:
            return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    return git_ok("ls-files", "--error-unmatch", path.name) and git_ok("diff", "--quiet", "HEAD", "--", path.name)


def machine_state() -> dict:
    """The CPU, the kernels torch dispatches to, the pinning environment and the threads, as of now."""
    import torch

    return {
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_env": {name: os.environ.get(name) for name in KERNEL_ENV},
        "torch_threads": torch.get_num_threads(),
    }
