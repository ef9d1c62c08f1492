"""What a composed GPU run imports for its attention, cross-entropy and weight sync (vcpo.launch.gpu_packages), and a
real launch refusing, in one line naming the package, a run whose import fails; the dry run does not ask."""

from __future__ import annotations

import pytest

import vcpo.launch.__main__ as launcher
from vcpo.launch import compose, gpu_packages, make_run, strategy_of
from vcpo.launch.gpu_packages import needed_modules

MEGATRON = ["actor_rollout_ref.actor.strategy=megatron"]


def modules(task: str, method: str, *overrides: str, lag: int | None = None) -> list[str]:
    run = make_run(task, method, lag, strategy=strategy_of(overrides))
    return [module for module, _, _ in needed_modules(compose(run, list(overrides)))]


@pytest.mark.parametrize("method, overrides, lag, expected", [
    ("vcpo", [], None, ["flash_attn", "flash_attn.ops.triton.cross_entropy", "cupy"]),  # FSDP2, lag 10: nccl sync
    ("sync", [], None, ["flash_attn", "flash_attn.ops.triton.cross_entropy"]),  # lag 0: colocated, no weight transport
    ("vcpo", ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa"], 0,
     ["flash_attn.ops.triton.cross_entropy"]),
    ("vcpo", MEGATRON, 0, []),  # OPOB's local layers: megatron's own attention and cross-entropy
    ("tis_ess", MEGATRON, 0, ["transformer_engine.pytorch", "flash_attn"]),  # megatron's default Transformer Engine
])
def test_what_each_composed_run_imports(method, overrides, lag, expected):
    assert modules("math", method, *overrides, lag=lag) == expected


def launch_argv(tmp_path) -> list[str]:
    for split in ("math/train", "math500/test", "math/test"):
        (tmp_path / split).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f"{split}.parquet").write_bytes(b"")
    return ["--task", "math", "--method", "vcpo", "--gpus", "8", "--data-dir", str(tmp_path), "--output-dir", str(tmp_path),
            "--gpu-memory-gb", "141"]


def test_a_launch_refuses_a_run_whose_cross_entropy_does_not_import(tmp_path, monkeypatch, capsys):
    def import_module(name):
        if name == "flash_attn.ops.triton.cross_entropy":
            raise ImportError("undefined symbol: _ZN3c10")  # a flash-attn built against another torch

    monkeypatch.setattr(gpu_packages, "import_module", import_module)
    started = []
    monkeypatch.setattr(launcher.subprocess, "call", lambda command, env: started.append(command) or 0)
    argv = launch_argv(tmp_path)
    assert launcher.main(argv) == 2 and started == []
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == ("error: flash-attn is not importable (flash_attn.ops.triton.cross_entropy: ImportError: undefined "
                     "symbol: _ZN3c10), and verl's log-prob cross-entropy (without it, a log-softmax holding the logits "
                     "twice) needs it; pip install -e '.[gpu]'")
    assert launcher.main([*argv, "--dry-run"]) == 0  # the dry run, on a laptop, does not ask

    monkeypatch.setattr(gpu_packages, "import_module", lambda name: None)
    assert launcher.main(argv) == 0 and len(started) == 1
