"""vcpo.resident_memory: the CPU memory benchmarks' peak above the resident memory before a step."""

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json
from vcpo.resident_memory import reset_peak, status_bytes
before = reset_peak()
block = bytearray(b"\\x01") * 64_000_000  # 64 MB, every page written
del block
print(json.dumps({"peak": status_bytes("VmHWM") - before, "after": status_bytes("VmRSS") - before}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("settings", ["measuring", "default", "caching"])
def test_the_peak_is_the_block_and_glibc_returns_it_unless_started_with_the_caching_settings(settings):
    """The peak above the reset is the 64 MB block the probe held. Freed, it leaves the resident set at once under
    MEASURING_ENV and under glibc's default (above its 32 MiB mmap threshold), and stays under CACHING_ENV."""
    from vcpo.resident_memory import CACHING_ENV, MEASURING_ENV

    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env.update({"measuring": MEASURING_ENV, "default": {}, "caching": CACHING_ENV}[settings])
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=120)
    measured = json.loads(done.stdout)
    assert 60e6 <= measured["peak"] <= 72e6  # the 64 MB block, and little else
    if settings == "caching":
        assert measured["after"] >= 60e6  # kept: the next 64 MB reuses these pages, no page faults
    else:
        assert measured["after"] < 4e6  # given back at once


def test_an_unknown_field_is_an_error_that_names_it():
    from vcpo.resident_memory import status_bytes

    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux's /proc")
    with pytest.raises(RuntimeError, match="VmNothing"):
        status_bytes("VmNothing")


def test_the_engine_benchmark_names_the_allocator_settings_it_was_started_with(monkeypatch):
    import importlib.util
    from pathlib import Path

    from vcpo.resident_memory import CACHING_ENV, MEASURING_ENV

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "opob_engine.py"
    spec = importlib.util.spec_from_file_location("opob_engine_benchmark", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    for key in benchmark.ALLOCATOR_KEYS:
        monkeypatch.delenv(key, raising=False)
    assert benchmark.allocator() == "default"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one of the measuring settings alone is none of them
    assert benchmark.allocator() == "custom"
    for name, settings in (("caching", CACHING_ENV), ("measuring", MEASURING_ENV)):
        for key in benchmark.ALLOCATOR_KEYS:
            monkeypatch.delenv(key, raising=False)
        for key, value in settings.items():
            monkeypatch.setenv(key, value)
        assert benchmark.allocator() == name
