"""A study's runs, scheduled by Snakemake (``runs.smk`` beside this file), as the reproduction's are.

``run_all`` takes the study folder (one runner per folder: a second is refused at once), checks that the
design's configs read, and hands Snakemake the runs not archived yet, in the design's order (phase, seed,
arm) as priorities. Snakemake builds each SFT base once, trains each run when the runs it reads are
archived (one torch thread per job, ``--jobs`` at a time) and archives it; an interrupted run resumes from
its checkpoint, and an archived run counts as done on any machine (its training inputs are not there, and
Snakemake does not rebuild what a present output no longer needs). Snakemake dies with the runner, and every
training with it (``vcpo.lifetimes``), however the runner dies; a restarted runner waits for a run still
writing its folder instead of counting it failed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from vcpo.lifetimes import run_jobs_with_snakemake
from vcpo.locks import LOCK_FILE, FolderInUse, exclusive, run_folder_lock, write_atomic
from vcpo.runs import FINAL_EVAL, is_finished, train_logged
from vcpo.sim.config import load_config_file
from vcpo.studies.design import Arm, Design, command_line, run_folder, run_settings, sim_task

SNAKEFILE = Path(__file__).with_name("runs.smk")
PLAN_FILE = ".study.json"  # in the study folder: what the runner handed Snakemake


def pending_runs(design: Design, archive: Path, phases: list[int] | None) -> list[tuple[Arm, int]]:
    """The runs not archived yet, phase by phase, seed by seed, in the design's arm order."""
    arms = [arm for arm in design.arms if phases is None or arm.phase in phases]
    order = sorted(((arm.phase, seed, index, arm) for index, arm in enumerate(arms) for seed in design.seeds_of(arm.task)),
                   key=lambda t: t[:3])
    return [(arm, seed) for _, seed, _, arm in order if not is_finished(run_folder(archive, arm, seed))]


def sources(design: Design, arm: Arm, seed: int, archive: Path) -> list[Path]:
    """The archived runs a run reads before it starts (``lr_scale_from``, ``lr_from_mean_scale_of``)."""
    folders = []
    if arm.lr_scale_from:
        folders.append(run_folder(archive, design.arm(arm.task, arm.lr_scale_from), seed))
    if arm.lr_from_mean_scale_of:
        source = design.arm(arm.task, arm.lr_from_mean_scale_of)
        folders += [run_folder(archive, source, s) for s in design.seeds_of(arm.task)]
    return [folder / FINAL_EVAL for folder in folders]


def base_marker(design: Design, arm: Arm, seed: int, root: Path) -> Path | None:
    """The file the SFT-base job writes (the base's path), or None where the design names the base itself."""
    return None if "base" in design.settings[arm.task] else Path(root) / "bases" / f"{sim_task(design, arm)}-seed{seed}.txt"


def wait_for_an_earlier_writer(folder: Path) -> None:
    """A run still going in ``folder`` (started by a runner that was killed before its children died with it)
    is waited for, then resumed or found finished, not reported as a failure."""
    try:
        with run_folder_lock(folder):
            return
    except FolderInUse as busy:
        print(f"waiting: {busy}", flush=True)
    with exclusive(Path(folder) / LOCK_FILE, wait=True):
        return


def train(design: Design, arm: Arm, seed: int, root: Path, archive: Path) -> None:
    """One run (Snakemake's ``train`` job): its command, one torch thread, its log in its folder."""
    out = run_folder(root, arm, seed)
    settings = run_settings(design, arm, seed, archive)
    if settings is None:
        raise RuntimeError(f"{arm.task}/{arm.name} seed {seed}: the runs it reads are not archived")
    out.mkdir(parents=True, exist_ok=True)
    wait_for_an_earlier_writer(out)
    started = time.time()
    train_logged(command_line(design, arm, settings, str(out)), out)
    print(f"done: {arm.task}/{arm.name} seed {seed} in {time.time() - started:.0f} s", flush=True)


def design_from_plan(plan: dict) -> Design:
    fields = dict(plan["design"])
    return Design(**{**fields, "arms": [Arm(**arm) for arm in fields["arms"]]})


def run_all(design: Design, root: Path, jobs: int, phases: list[int] | None, archive: Path) -> int:
    """Every unarchived run of ``phases`` (all: None) through Snakemake, under the study folder's lock.
    Returns the number of runs left unarchived (failed, or waiting for runs that failed)."""
    root, archive = Path(root).resolve(), Path(archive).resolve()
    with run_folder_lock(root):
        pending = pending_runs(design, archive, phases)
        print(f"study: {len(pending)} runs to do, {jobs} at a time, under {root}", flush=True)
        unreadable = set()
        for task in {arm.task for arm, _ in pending}:
            try:
                load_config_file(design.configs[task])
            except Exception as error:  # a design whose config cannot be read: say so, run nothing of it
                unreadable.add(task)
                print(f"failed: planning: {error}", file=sys.stderr)
        planned = [(arm, seed) for arm, seed in pending if arm.task not in unreadable]
        if planned:
            plan = {"design": dataclasses.asdict(design), "runs": str(root), "archive": str(archive),
                    "pending": [[arm.task, arm.name, seed] for arm, seed in planned]}
            write_atomic(root / PLAN_FILE, json.dumps(plan))
            run_jobs_with_snakemake(SNAKEFILE, root / PLAN_FILE, jobs)
        left = [(arm, seed) for arm, seed in pending if not is_finished(run_folder(archive, arm, seed))]
        for arm, seed in left:
            print(f"not run: {arm.task}/{arm.name} seed {seed} (its config, its training or the runs it reads failed; the same "
                  "command resumes what is left)", file=sys.stderr)
        return len(unreadable) + len(left)

