"""A run folder, the one place its format is written down: file names, "finished", the metric names
several modules read, and the one reader of ``metrics.jsonl``.

    <run>/config.json      the resolved settings and the run's provenance (simulator); launch.json (verl)
    <run>/metrics.jsonl    one JSON object per optimizer step: the simulator's flat {"step", **metrics}, or
                           verl's file logger's {"step", "data": {...}}; evaluations add lines
    <run>/checkpoint.pt    the simulator's resume state (checkpoint.prev.pt: the one before it)
    <run>/checkpoints/     verl's (global_step_N/, latest_checkpointed_iteration.txt); while verl resumes a run,
                           metrics.resumed.jsonl holds the steps before it (verl's file logger starts its file anew)
    <run>/final/           the final model; final/eval.json is written last, so it marks a finished run

Where a folder sits (``RUNS/<task>/<method>/lag<k>/seed<s>``) is ``vcpo.recipes.run_path``'s.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from vcpo.core.ratios import SEQ_ESS_RATIO  # noqa: F401 (re-exported: readers of runs take every name from here)
from vcpo.locks import write_atomic

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_FILE = "checkpoint.pt"
PREVIOUS_CHECKPOINT_FILE = "checkpoint.prev.pt"  # the one before: a damaged latest one resumes from it
FINAL_DIR = "final"
FINAL_EVAL = f"{FINAL_DIR}/eval.json"
TRAIN_LOG = "train.log"  # a runner's record of the training's output, beside its files

# what verl's trainer saves under a run folder (trainer.default_local_dir): global_step_N/actor/huggingface
VERL_CHECKPOINTS = "checkpoints"
VERL_LATEST_STEP = "latest_checkpointed_iteration.txt"
# the metrics of the steps a resumed verl run does not redo, set aside while it runs: verl's file logger opens
# metrics.jsonl with "wb" (verl/utils/tracking.py, FileLogger), so the relaunch would erase them
METRICS_BEFORE_RESUME = "metrics.resumed.jsonl"
# the Hugging Face weights of a checkpoint's actor: FSDP's engine writes them beside its shards, Megatron's under model/
VERL_HF_WEIGHTS = (("actor", "huggingface"), ("actor", "model", "huggingface"))

# metric names read by more than the module that logs them (verl's names; SEQ_ESS_RATIO is vcpo.core's)
VAL_ACCURACY = "val/accuracy"
TEST_ACCURACY = "test/accuracy"
LR_SCALE = "actor/lr_scale"
EFFECTIVE_LR = "actor/effective_lr"
STALENESS = "training/off_policy/trajectory_staleness"  # verl's, per step: /max, /mean, /min over the batch
STEP_SECONDS = "timing_s/step"  # verl's


# verl logs held-out accuracy per data source as val-core/<data_source>/acc/mean@<n>.
VERL_ACCURACY = re.compile(r"^val-core/.+/acc/mean@\d+$")
VERL_ACTOR_PREFIX = "actor/"


def flat_record(record: dict) -> dict:
    """One metrics line as ``{"step", **metrics}``; verl's first ``val-core/*/acc/mean@*`` is the accuracy,
    and its ``actor/rollout_corr/*`` (verl's trainer prefixes the actor's metrics) are ``rollout_corr/*``,
    the names the simulator logs and the figures draw."""
    flat = {"step": int(record["step"]), **record.get("data", {})} if "data" in record else dict(record)
    flat["step"] = int(flat["step"])
    for key in [key for key in flat if key.startswith(VERL_ACTOR_PREFIX + "rollout_corr/")]:
        flat.setdefault(key.removeprefix(VERL_ACTOR_PREFIX), flat[key])
    if VAL_ACCURACY not in flat:
        accuracy = next((value for key, value in flat.items() if VERL_ACCURACY.match(key)), None)
        if accuracy is not None:
            flat[VAL_ACCURACY] = accuracy
    return flat


def verl_hf_checkpoint(folder: str | Path) -> Path | None:
    """The Hugging Face weights of the last checkpoint verl saved, from a run folder, its ``checkpoints`` folder or one
    ``global_step_N`` folder; None when ``folder`` holds none."""
    folder = Path(folder)
    if (folder / VERL_CHECKPOINTS).is_dir():
        folder = folder / VERL_CHECKPOINTS
    if (folder / VERL_LATEST_STEP).is_file():
        folder = folder / f"global_step_{(folder / VERL_LATEST_STEP).read_text().strip()}"
    return next((folder.joinpath(*parts) for parts in VERL_HF_WEIGHTS if (folder.joinpath(*parts) / CONFIG_FILE).is_file()),
                None)


SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def weights_dtype(folder: Path) -> str | None:
    """The dtype of the floating-point tensors of a Hugging Face folder's safetensors files (their headers only);
    None when they have none or more than one, or a header cannot be read (a file a killed save cut short)."""
    dtypes = set()
    for path in Path(folder).glob("*.safetensors"):
        try:
            with open(path, "rb") as handle:
                header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
            dtypes |= {SAFETENSORS_DTYPES[entry["dtype"]] for name, entry in header.items()
                       if name != "__metadata__" and entry["dtype"] in SAFETENSORS_DTYPES}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
    return dtypes.pop() if len(dtypes) == 1 else None


def label_checkpoint_dtypes(run: str | Path) -> list[Path]:
    """Make each verl checkpoint's Hugging Face ``config.json`` say the dtype its weights have (verl saves the config
    with bfloat16 whatever the weights are: float32 on CPU); returns the configs changed. A checkpoint a killed run cut
    short (weights or config that cannot be read) is left as it is: the launcher calls this however its run ended."""
    changed = []
    for weights in sorted(path for parts in VERL_HF_WEIGHTS
                          for path in (Path(run) / VERL_CHECKPOINTS).glob(f"global_step_*/{'/'.join(parts)}")):
        config_file, dtype = weights / CONFIG_FILE, weights_dtype(weights)
        if dtype is None or not config_file.is_file():
            continue
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(config, dict):
            continue
        if config.get("dtype", config.get("torch_dtype")) != dtype:
            config.update({key: dtype for key in ("dtype", "torch_dtype") if key in config} or {"dtype": dtype})
            config_file.write_text(json.dumps(config, indent=2) + "\n")
            changed.append(config_file)
    return changed


def train_logged(command: list[str], run: str | Path) -> None:
    """``command`` (a training of ``run``) with its output appended to the run's ``TRAIN_LOG``; CalledProcessError
    when it fails."""
    with open(Path(run) / TRAIN_LOG, "a") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)


def is_finished(run: str | Path) -> bool:
    return (Path(run) / FINAL_EVAL).exists()


class RunFileProblem(ValueError):
    """A run's file that cannot be what it should be (damaged, cut, missing keys): one sentence naming it."""


class MetricsProblem(RunFileProblem):
    """What a metrics file holds that cannot be one run's record of each step once."""


def exit_with(main) -> None:
    """``sys.exit(main())`` for a command that reads runs' files: a damaged archive or table ends it with one line
    naming the file, not a traceback."""
    try:
        sys.exit(main())
    except RunFileProblem as problem:
        sys.exit(f"error: {problem}")


def read_json(path: str | Path, keys: tuple[str, ...] = ()) -> dict:
    """The JSON object in ``path``, with ``keys``; RunFileProblem naming the file when it is not one."""
    try:
        content = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunFileProblem(f"{path} cannot be read as JSON ({type(error).__name__}: {error})") from None
    if not isinstance(content, dict):
        raise RunFileProblem(f"{path} holds a JSON {type(content).__name__}, not an object")
    if missing := [key for key in keys if key not in content]:
        raise RunFileProblem(f"{path} lacks {', '.join(missing)}")
    return content


def final_eval(run: str | Path) -> dict:
    return read_json(Path(run) / FINAL_EVAL, (TEST_ACCURACY,))


def missing_steps(records: list[dict], steps: int) -> list[int]:
    """The optimizer steps 0..steps-1 that no record of ``records`` (a run's metrics, flat) logs."""
    ran = {int(record["step"]) for record in records if LR_SCALE in record}
    return [step for step in range(steps) if step not in ran]


def complete_records(path: Path) -> tuple[list[tuple[str, dict]], str]:
    """(line, record) of every complete line of a ``metrics.jsonl``, and its unterminated tail ('' if none:
    a write cut short leaves one). A complete line that is not a record with a step raises MetricsProblem
    naming the file and line."""
    *complete, torn = Path(path).read_text().split("\n")
    records = []
    for number, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise MetricsProblem(f"{path} line {number} cannot be read as a metrics record") from None
        records.append((line, record))
    return records, torn


def metric_records(run: str | Path, report: Callable[[str], None]) -> list[tuple[str, dict]]:
    """(line, record) of a run's ``metrics.jsonl``, by one rule: a partial last line (a write cut short) is
    left out, and a step logged more than once keeps its first line (the line's step: its "step", both
    backends). Each of the two is passed to ``report`` as one sentence naming the file: the caller decides
    whether it is a warning or an error (raise from ``report``)."""
    path = Path(run) / METRICS_FILE
    records, torn = complete_records(path)
    if torn.strip():
        report(f"{path}: a partial last line is left out ({len(torn)} characters: a write cut short)")
    kept, seen, repeated = [], set(), set()
    for line, record in records:
        step = int(record["step"])
        if step in seen:
            repeated.add(step)
            continue
        seen.add(step)
        kept.append((line, record))
    if repeated:
        report(f"{path}: steps {sorted(repeated)[:5]} are logged more than once (two writers on one folder?); "
               "the first line of each is kept")
    return kept


def verl_checkpointed_step(checkpoints: str | Path) -> int:
    """The step of the checkpoint verl's ``resume_mode=auto`` resumes from in the folder ``checkpoints`` (its
    ``trainer.default_local_dir``): the number its latest-iteration file names; 0 when there is none (verl starts over)."""
    latest = Path(checkpoints) / VERL_LATEST_STEP
    try:
        return int(latest.read_text().strip())
    except (OSError, ValueError):
        return 0


def joined_metric_records(earlier: list[tuple[str, dict]], later: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(line, record) of a verl run's metrics when the ``later`` records (a relaunch's) continue the ``earlier`` ones: the
    earlier records before the later's first step, then the later records. A step both log is one record: verl
    validates at the step it resumes from, so the relaunch's first record may repeat a step the earlier logged; the
    earlier's values are kept and the later's other metrics added. Earlier records after it are steps the relaunch
    redid, and are dropped."""
    if not later:
        return list(earlier)
    first = int(later[0][1]["step"])
    joined = [(line, record) for line, record in earlier if int(record["step"]) < first]
    same = [record for _, record in earlier if int(record["step"]) == first]
    if same:
        merged = {"step": first, "data": {**later[0][1].get("data", {}), **same[0].get("data", {})}}
        joined.append((json.dumps(merged), merged))
    else:
        joined.append(later[0])
    return [*joined, *later[1:]]


def _resumed_history(run: Path) -> list[tuple[str, dict]]:
    """The set-aside records of a resumed verl run joined to those of ``metrics.jsonl`` (either may be absent)."""
    earlier, later = (complete_records(run / name)[0] if (run / name).is_file() else []
                      for name in (METRICS_BEFORE_RESUME, METRICS_FILE))
    return joined_metric_records(earlier, later)


def set_metrics_aside_for_resume(run: str | Path, checkpointed_step: int) -> None:
    """Before verl resumes the run in ``run`` from its checkpoint of ``checkpointed_step`` (0: none, and verl starts
    over): the metrics of the steps up to it move to `METRICS_BEFORE_RESUME`, from which `join_resumed_metrics` joins
    them back. An earlier relaunch's set-aside records (one killed before it joined them) are joined first."""
    run = Path(run)
    history = _resumed_history(run)
    kept = [line for line, record in history if checkpointed_step and int(record["step"]) <= checkpointed_step]
    write_atomic(run / METRICS_BEFORE_RESUME, "".join(line + "\n" for line in kept))
    (run / METRICS_FILE).unlink(missing_ok=True)


def join_resumed_metrics(run: str | Path) -> None:
    """``metrics.jsonl`` of a resumed verl run in ``run`` whole again: the set-aside records of the steps before the
    relaunch, then the relaunch's (`joined_metric_records`); nothing to do when none are set aside."""
    run = Path(run)
    if not (run / METRICS_BEFORE_RESUME).is_file():
        return
    write_atomic(run / METRICS_FILE, "".join(line + "\n" for line, _ in _resumed_history(run)))
    (run / METRICS_BEFORE_RESUME).unlink()
