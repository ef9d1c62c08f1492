"""This process's resident memory (Linux /proc), as the CPU memory benchmarks read it: reset the high-water mark,
run the step, read the peak above the resident memory before it. Measure in a fresh process started with
``MEASURING_ENV``, under which glibc hands a freed tensor back at once, so that the resident set follows the live
tensors. Time the other way, in a process started with ``CACHING_ENV``: glibc keeps freed memory for the next
allocation, as CUDA's caching allocator does, where by default it gives large freed chunks (above 32 MiB) and the
heap's free top back to the kernel, and the next step page-faults them afresh."""

from __future__ import annotations

from pathlib import Path

MEASURING_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "1"}
CACHING_ENV = {"MALLOC_MMAP_THRESHOLD_": str(16 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Resets the high-water mark (VmHWM) to the resident memory now, and returns that (VmRSS) in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")
