"""What produced a run: the code (git commit, uncommitted changes), the machine (CPU, the floating-point
kernels torch dispatches to), the threads, the library versions, and when (UTC).

A fixed-seed simulator run is deterministic on one CPU type and may end elsewhere on another: the CPU's
vector width selects torch's kernels (``torch.backends.cpu.get_cpu_capability()``), and MKL and oneDNN
choose theirs by CPU unless the environment pins them (``KERNEL_ENV``). Recording both lets a reader
tell a re-run that should match exactly from one that should only fall inside its arm's spread.
"""

from __future__ import annotations

import datetime
import json
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


def output_record(started: str) -> dict:
    """What produced an output being written now: the code (``code_state``), when its work started (``started``) and
    finished (now, UTC), and the CPU."""
    return {**code_state(), "start": started, "finish": utc_now(), "cpu": cpu_name()}


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


# -- what a committed table keeps of what produced it ----------------------------------------------------------------
# Every row of a committed row file and every committed statistics file records these (by any of the names writers use;
# a time's "end" only as text, since a study row's ``end`` is its accuracy), or declares, in ``not_recorded``, the ones
# it lacks with what git history shows instead: {"fields": [...], "git_shows": ...}.
RECORDED = {"commit": ("commit",), "dirty": ("dirty",), "start": ("start", "started"), "finish": ("finish", "finished", "end"),
            "cpu": ("cpu",)}
# the objects of a record where writers keep them, beside its top level
RECORD_PARTS = ("provenance", "machine")


def recorded_fields(record: dict) -> set[str]:
    """The RECORDED fields ``record`` holds a value for, at its top level or in one of its RECORD_PARTS."""
    places = [record, *(record[part] for part in RECORD_PARTS if isinstance(record.get(part), dict))]
    return {field for field, names in RECORDED.items()
            if any(place.get(name) is not None and (name != "end" or isinstance(place[name], str)) for place in places for name in names)}


def declared_fields(record: dict) -> set[str]:
    """The fields ``record`` declares not recorded, with what git shows instead (``not_recorded``, at its top level or
    in its provenance object)."""
    declared = set()
    for place in (record, record.get("provenance")):
        note = place.get("not_recorded") if isinstance(place, dict) else None
        if isinstance(note, dict) and note.get("git_shows"):
            declared |= set(note.get("fields", ()))
    return declared


def unrecorded(record: dict) -> list[str]:
    """The RECORDED fields ``record`` neither records nor declares, in RECORDED's order."""
    known = recorded_fields(record) | declared_fields(record)
    return [field for field in RECORDED if field not in known]


def provenance_records(document: dict | list) -> list[dict]:
    """The records a committed table file keeps its provenance in: a row file's (a list's) every row; in a statistics
    file, every object that declares fields not recorded or whose ``provenance`` object records or declares one, else
    every object holding a ``commit``, else its top level."""
    if isinstance(document, list):
        return document
    objects, stack = [], [document]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            objects.append(value)
            stack.extend(inner for key, inner in value.items() if key != "not_recorded")  # git's commits, not records
        elif isinstance(value, list):
            stack.extend(value)
    kept = {id(value["provenance"]) for value in objects if isinstance(value.get("provenance"), dict)}  # part of a record
    origins = [value for value in objects if id(value) not in kept and ("not_recorded" in value or (
        isinstance(origin := value.get("provenance"), dict) and (recorded_fields(origin) or "not_recorded" in origin)))]
    return origins or [value for value in objects if value.get("commit") is not None] or [document]


def git_additions(path: Path) -> dict[str, dict]:
    """For every file at or below ``path`` that git history adds: the commit that first added it and its time,
    {its absolute path: {"commit", "time"}}; {} outside a git checkout."""
    path = Path(path).resolve()
    folder = path if path.is_dir() else path.parent
    try:
        root = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                              timeout=30)
        log = subprocess.run(["git", "-C", str(folder), "log", "--reverse", "--diff-filter=A", "--format=@%H %aI",
                              "--name-only", "--", str(path)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if root.returncode != 0 or log.returncode != 0:
        return {}
    added, commit, top = {}, None, Path(root.stdout.strip())
    for line in log.stdout.splitlines():
        if line.startswith("@"):
            sha, time = line[1:].split()
            commit = {"commit": sha, "time": time}
        elif line.strip() and commit is not None:
            added.setdefault(str(top / line.strip()), commit)
    return added


def git_changes(path: Path) -> list[dict]:
    """Every commit that changed ``path``, oldest first: {"commit", "time"}; [] outside a git checkout."""
    path = Path(path).resolve()
    try:
        log = subprocess.run(["git", "-C", str(path.parent), "log", "--reverse", "--format=%H %aI", "--", path.name],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if log.returncode != 0:
        return []
    return [dict(zip(("commit", "time"), line.split(), strict=True)) for line in log.stdout.splitlines() if line.strip()]


def git_show(path: Path, commit: str) -> str:
    """``path`` as ``commit`` holds it."""
    path = Path(path).resolve()
    return subprocess.run(["git", "-C", str(path.parent), "show", f"{commit}:./{path.name}"], capture_output=True,
                          text=True, timeout=60, check=True).stdout


def declare_from_git(path: Path, rows_key: str | None = None) -> int:
    """Add to each provenance record of the committed table ``path`` (a JSON file; with ``rows_key``, each value of its
    object ``rows_key`` counts as a record) the RECORDED fields it lacks, declared, with the commit that first added the
    record (the file, or with ``rows_key`` the row) and the one that last changed the file: the measurement was made
    before the first. The file keeps its layout. Returns how many records were declared."""
    path = Path(path)
    text = path.read_text()
    document = json.loads(text)
    changes = git_changes(path)
    if not changes:
        raise SystemExit(f"{path}: git has no history of it, so there is nothing to declare instead")
    if rows_key:  # each row's own first commit: rows join a table over time
        versions = [(change, json.loads(git_show(path, change["commit"]))[rows_key]) for change in changes]
        records = {name: next(change for change, rows in versions if name in rows) for name in document[rows_key]}
        records = [(document[rows_key][name], added) for name, added in records.items()]
    else:
        records = [(record, changes[0]) for record in provenance_records(document)]
    declared = 0
    for record, added in records:
        missing = unrecorded(record)
        if missing:
            target = record.setdefault("provenance", {}) if rows_key or isinstance(record.get("provenance"), dict) else record
            target["not_recorded"] = {"fields": missing, "git_shows": {
                "added": added, "last_changed": changes[-1],
                "reading": "the commit that added it to this file: what it records was measured before that time"}}
            declared += 1
    indent = None if "\n" not in text.strip() else len(text.splitlines()[1]) - len(text.splitlines()[1].lstrip())
    path.write_text(json.dumps(document, indent=indent, ensure_ascii="\\u" in text) + "\n")
    return declared


# -- what a folder's provenance.json keeps for its files that cannot hold a record (markdown row tables, logs) ------
# One file per table folder, FOLDER_RECORD: a record at its top level is the whole folder's run (every file in it came
# from that run); under "files", each named file's own record (or a list of them, one per run the file holds): the
# RECORDED fields the file states in its own text (or in the committed file its "source" names), transcribed, and
# the rest declared in ``not_recorded`` with what git history shows instead.
FOLDER_RECORD = "provenance.json"
FOLDER_ABOUT = ("What produced each file of this folder that cannot carry a record of its own (a markdown row table, a "
                "log): the fields its text states (or the committed file named as its source), and those it does not "
                "record declared with what git history shows instead (python -m vcpo.provenance declare-files; "
                "tests/test_table_provenance.py checks each).")


def file_records(entry: dict | list) -> list[dict]:
    """The records of one file's entry under "files": one, or one per run the file holds."""
    return entry if isinstance(entry, list) else [entry]


def declare_files(paths: list[Path]) -> int:
    """Give each committed file of ``paths`` an entry in its folder's FOLDER_RECORD (made if missing): the fields an
    existing entry records are kept; the RECORDED fields it lacks are declared with the commit that first added the
    file and the one that last changed it (what it holds was measured before the latter). Returns how many records
    were declared."""
    declared = 0
    for path in paths:
        path = Path(path).resolve()
        changes = git_changes(path)
        if not changes:
            raise SystemExit(f"{path}: git has no history of it, so there is nothing to declare instead")
        added = git_additions(path).get(str(path), changes[0])
        record_path = path.parent / FOLDER_RECORD
        document = json.loads(record_path.read_text()) if record_path.exists() else {"about": FOLDER_ABOUT}
        entry = document.setdefault("files", {}).setdefault(path.name, {})
        for record in file_records(entry):
            missing = unrecorded({key: value for key, value in record.items() if key != "not_recorded"})
            if missing:
                record["not_recorded"] = {"fields": missing, "git_shows": {
                    "added": added, "last_changed": changes[-1],
                    "reading": "the commits that first added the file and last changed it: what it holds was measured "
                               "before the last"}}
                declared += 1
            else:
                record.pop("not_recorded", None)
        document["files"] = dict(sorted(document["files"].items()))
        record_path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    return declared


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vcpo.provenance", description="Declare, in a committed table that "
                                     "lacks them, the provenance fields it does not record, with what git history shows.")
    commands = parser.add_subparsers(dest="command", required=True)
    declare = commands.add_parser("declare", help="add not_recorded to each record of FILE that lacks a field")
    declare.add_argument("files", nargs="+", type=Path)
    declare.add_argument("--rows", help="the key of FILE's object whose values are its rows (each a record)")
    files = commands.add_parser("declare-files", help=f"give each FILE (a markdown table, a log) an entry in its folder's "
                                f"{FOLDER_RECORD}: the fields its entry records kept, the rest declared from git")
    files.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "declare-files":
        print(f"{declare_files(args.files)} records declared")
        return 0
    for path in args.files:
        print(f"{path}: {declare_from_git(path, args.rows)} records declared")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
