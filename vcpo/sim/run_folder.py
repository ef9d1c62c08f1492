"""A simulator run's folder through its life, in `vcpo.runs`' format: held by one writer (the folder lock) from
before any work to the end of the run, checkpoints written whole and resumed only under the settings they were
written with, the metrics of steps a resume redoes cut, ``config.json`` with the run's provenance (every attempt
listed), W&B beside ``metrics.jsonl``, and the finished mark written last."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from vcpo.cli import output_folder_problem
from vcpo.locks import FolderInUse, run_folder_lock, write_atomic
from vcpo.provenance import code_state, library_versions, machine_state, utc_now
from vcpo.runs import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    FINAL_EVAL,
    METRICS_FILE,
    PREVIOUS_CHECKPOINT_FILE,
    MetricsProblem,
    is_finished,
    metric_records,
)
from vcpo.sim.config import ConfigError, settings_changed
from vcpo.sim.validation import ResolvedRun


class RunFolder:
    """The folder ``config.out`` of the resolved run ``run``, held by this process from construction until ``close()``
    (or the end of a ``with`` block); a checkpoint there of a run with other settings is refused before any work."""

    def __init__(self, run: ResolvedRun):
        self.run = run
        config = run.config
        if config.out is None:
            raise ConfigError("config key 'out': a run needs an output folder (--out DIR)")
        self.out, self.config = Path(config.out), config
        if problem := output_folder_problem(self.out):
            raise ConfigError(f"config key 'out' ({config.out}): {problem}")
        self._lock = contextlib.ExitStack()
        try:
            self._lock.enter_context(run_folder_lock(self.out))
        except FolderInUse as error:
            raise ConfigError(f"config key 'out': {error}") from None
        self.checkpointed_step = 0  # the step of the newest checkpoint (0: none yet, a restart starts over)
        self.recorded: dict = {}  # config.json as start() wrote it
        self.tracker = None
        try:
            # against config.json before any work; the checkpoint's own settings are checked when it is loaded
            recorded = self.out / CONFIG_FILE
            if recorded.exists() and any((self.out / name).exists() for name in (CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE)):
                self._refuse_other_settings(json.loads(recorded.read_text()), self.out)
        except BaseException:
            self.close()  # a refused folder is free at once, not at garbage collection
            raise

    def close(self) -> None:
        self._lock.close()

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def finished(self) -> bool:
        return is_finished(self.out)

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, state: dict) -> None:
        """checkpoint.pt, written whole before it replaces the last one, which becomes checkpoint.prev.pt;
        ``state`` holds the run's ``step`` and whatever continuing it needs."""
        state = {**state, "settings": self.config.recorded()}  # what a resume is checked against, config.json or not
        partial = self.out / f"{CHECKPOINT_FILE}.{os.getpid()}.tmp"
        try:
            torch.save(state, partial)
        except (OSError, RuntimeError) as error:  # torch reports a full disk as "[enforce fail ...] unexpected pos"
            partial.unlink(missing_ok=True)
            free = shutil.disk_usage(self.out).free / 2**20
            raise ConfigError(f"config key 'out': writing {partial} failed ({str(error).splitlines()[0]}) with {free:.0f} MiB "
                              f"free on its filesystem (no space left on device?); the checkpoint of step "
                              f"{self.checkpointed_step} is intact and the same command resumes from it") from None
        current = self.out / CHECKPOINT_FILE
        if current.exists():
            current.replace(self.out / PREVIOUS_CHECKPOINT_FILE)
        partial.replace(current)
        self.checkpointed_step = state["step"]

    def resume(self) -> dict | None:
        """The newest checkpoint's state, the metrics of the steps after it cut (a finished run's all kept); None:
        there is none, and the metrics of an attempt stopped before its first checkpoint are removed."""
        self.out.mkdir(parents=True, exist_ok=True)
        state = self._newest_checkpoint()
        metrics = self.out / METRICS_FILE
        if state is None:
            metrics.unlink(missing_ok=True)
            return None
        self.checkpointed_step = state["step"]
        if metrics.exists() and not self.finished:
            kept = [line for step, line in metric_lines(self.out) if step < state["step"]]
            write_atomic(metrics, "".join(line + "\n" for line in kept))
        return state

    def _newest_checkpoint(self) -> dict | None:
        """The newest readable checkpoint (None: there is none). A damaged one is named in one line, and the
        one before it is used; if none can be read, the error names them and the remedy."""
        for stale in self.out.glob(f"{CHECKPOINT_FILE}.*.tmp"):  # a killed writer's; this run holds the folder lock
            stale.unlink()
        candidates = [path for path in (self.out / CHECKPOINT_FILE, self.out / PREVIOUS_CHECKPOINT_FILE) if path.exists()]
        damaged = []
        for path in candidates:
            try:
                state = torch.load(path, weights_only=False)
            except Exception as error:  # a truncated zip, an empty file, a broken pickle: the file, not the run
                damaged.append(f"{path} is damaged ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'})")
                continue
            if damaged:
                print(f"{damaged[0]}; resuming from {path.name} (step {state['step']})", file=sys.stderr)
            if "settings" in state:  # (checkpoints written before it was recorded have none)
                self._refuse_other_settings(state["settings"], f"{self.out} ({path.name})")
            return state
        if damaged:
            raise ConfigError(f"config key 'out': {'; '.join(damaged)}: delete {' and '.join(p.name for p in candidates)} "
                              f"in {self.out} to start the run over")
        return None

    def _refuse_other_settings(self, recorded: dict, where: Path | str) -> None:
        """A checkpoint is resumed only by a run with the settings ``recorded`` with it (at ``where``)."""
        changed = settings_changed(recorded, self.config)
        if changed:
            raise ConfigError(
                f"{where} holds a checkpoint of a run with other settings ({'; '.join(changed)}): resuming it would "
                "file that run under these settings; use another --out, or delete the folder to start over"
            )

    # -- records ---------------------------------------------------------------------------------
    def start(self, step: int, base: Path) -> None:
        """config.json for an attempt starting at ``step`` on the SFT base ``base``: the resolved settings and the
        provenance of every attempt; and, with ``wandb``, the W&B run."""
        config, run = self.config, self.run
        machine = machine_state()
        now, code = utc_now(), code_state()
        earlier = json.loads((self.out / CONFIG_FILE).read_text()) if step and (self.out / CONFIG_FILE).exists() else {}
        resolved = {
            **config.recorded(),
            "base": str(base),
            "base_lr": run.base_lr,
            "resolved_rollout_dtype": run.rollout_dtype,
            "method_preset": run.method.spec,
            "versions": library_versions(),
            # floating-point kernels differ between CPUs: a fixed-seed run can end elsewhere on another
            **machine,
            # the cores the run holds (threads per process x processes): its wall-clock hours x these are its core-hours
            "cores": min(machine["torch_threads"] * (2 if config.execution == "concurrent" else 1), os.cpu_count() or 1),
            **code,
            # a resumed run keeps its first start; every attempt (start step, time, code) is listed; a finished run
            # started again keeps its end (it has nothing left to do)
            "started": earlier.get("started", now),
            **({"finished": earlier["finished"]} if earlier.get("finished") and self.finished else {}),
            "attempts": [*earlier.get("attempts", []), {"step": step, "started": now, **code, "cpu": machine["cpu"]}],
        }
        self.recorded = resolved
        write_atomic(self.out / CONFIG_FILE, json.dumps(resolved, indent=2, default=str) + "\n")
        if config.wandb:
            from verl.utils.tracking import Tracking

            os.environ.setdefault("WANDB_MODE", "offline")
            # verl's Tracking reads trainer.* (e.g. trainer.wandb_proxy) from the config it logs
            self.tracker = Tracking("vcpo-sim", self.out.name, default_backend=["wandb"], config={"trainer": {}, **resolved})

    def log(self, metrics: dict) -> None:
        with open(self.out / METRICS_FILE, "a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        if self.tracker is not None:
            self.tracker.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step=metrics["step"])

    def finish(self, result: dict) -> None:
        """The final evaluation's ``result`` recorded: its metrics line (if it has a validation accuracy), the end
        time in config.json, and final/eval.json, the finished mark, last."""
        if result.get("val/accuracy") is not None:
            self.log(result)
        write_atomic(self.out / CONFIG_FILE, json.dumps({**self.recorded, "finished": utc_now()}, indent=2, default=str) + "\n")
        write_atomic(self.out / FINAL_EVAL, json.dumps(result) + "\n")

    def stop_tracking(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()


def metric_lines(run: Path) -> list[tuple[int, str]]:
    """(step, line) of a run's ``metrics.jsonl`` (``vcpo.runs.metric_records``: a partial last line, a step
    logged twice), what it leaves out said on stderr; a line that cannot be read is an error naming it."""
    try:
        records = metric_records(run, report=lambda problem: print(problem, file=sys.stderr))
    except MetricsProblem as error:
        raise ConfigError(f"config key 'out': {error}; repair or remove that line, or start the run over in another folder") from None
    return [(int(record["step"]), line) for line, record in records]
