"""Every committed row, statistics and log file under tables/ records what produced it (commit, dirty, start, finish,
CPU) or declares what it does not record with what git history shows instead (vcpo.provenance.unrecorded): a JSON
file in its own records; a file that cannot hold one (a markdown row table, a log) in its folder's provenance.json,
whose recorded values its text states and whose declarations are what git shows; the rules that find a file's
records, on hand-made cases."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
from pathlib import Path

import pytest

from vcpo.provenance import (
    FOLDER_RECORD,
    RECORDED,
    file_records,
    git_additions,
    git_changes,
    provenance_records,
    recorded_fields,
    unrecorded,
)

ROOT = Path(__file__).resolve().parents[1]
# Not row or statistics files of their own: a study's archive of run folders (each run's row in runs.jsonl carries its
# provenance) and a run's per-step metrics (its row or result file beside them carries it).
RUN_RECORDS = ("/runs/", "/metrics/", "/metrics_")
ROW_FILES = (".json", ".jsonl", ".jsonl.gz")
IMAGES = (".png", ".svg", ".pdf", ".jpg")


def committed_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "tables"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [name for name in listed if not any(part in name for part in RUN_RECORDS)]


def committed_tables() -> list[str]:
    return [name for name in committed_files() if name.endswith(ROW_FILES)]


def needing_a_folder_record(names: list[str]) -> list[str]:
    """Of committed files under tables/, those whose provenance their folder's provenance.json keeps: every one that is
    neither a JSON row or statistics file (which holds its own), nor a figure, nor a markdown file in a folder with a
    row or statistics file (the report written from it, as a study's summary.md or task_choice.md)."""
    with_rows = {Path(name).parent for name in names if name.endswith(ROW_FILES) and Path(name).name != FOLDER_RECORD}
    return [name for name in names if not name.endswith(ROW_FILES + IMAGES)
            and not (name.endswith(".md") and Path(name).parent in with_rows)]


def committed_text_tables() -> list[str]:
    return needing_a_folder_record(committed_files())


def misstated(record: dict, text: str) -> list[str]:
    """The RECORDED fields ``record`` holds (not declared) whose value ``text`` does not state: a commit by its first
    7 characters, a tree's state as 'dirty: True', '(dirty', 'dirty tree' or 'uncommitted' (else 'dirty: False' or
    '(clean)'), a time by its date and its hour and minute, the CPU by its name."""
    wrong = []
    stated_fields = recorded_fields(record) - set(record.get("not_recorded", {}).get("fields", ()))
    for field in (field for field in RECORDED if field in stated_fields):
        value = next(record[name] for name in RECORDED[field] if record.get(name) is not None)
        if field == "commit":
            stated = str(value)[:7] in text
        elif field == "dirty":
            stated = bool(re.search(r"dirty: True|\(dirty|dirty tree|uncommitted" if value else r"dirty: False|\(clean\)", text))
        elif field in ("start", "finish"):
            stated = str(value)[:10] in text and str(value)[11:16] in text
        else:
            stated = str(value) in text
        if not stated:
            wrong.append(field)
    return wrong


def read_table(name: str) -> dict | list:
    path = ROOT / name
    text = gzip.decompress(path.read_bytes()).decode() if name.endswith(".gz") else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()] if ".jsonl" in name else json.loads(text)


def covered_by_folder(name: str) -> bool:
    """A file beside a provenance.json that records the whole folder's run (its samples, labels and audit)."""
    beside = (ROOT / name).parent / "provenance.json"
    return beside.exists() and (ROOT / name) != beside and not unrecorded(json.loads(beside.read_text()))


@pytest.mark.parametrize("name", committed_tables())
def test_every_committed_table_records_or_declares_its_provenance(name):
    if covered_by_folder(name):
        return
    records = provenance_records(read_table(name))
    gaps = [(index, missing) for index, record in enumerate(records) if (missing := unrecorded(record))]
    assert records and not gaps, f"{name}: records without (or declaring) these fields: {gaps[:3]}"


@pytest.mark.parametrize("name", committed_text_tables())
def test_every_committed_log_and_markdown_table_has_its_record_in_its_folders_provenance_json(name):
    path = ROOT / name
    holder = path.parent / FOLDER_RECORD
    hint = (f"transcribe into {holder.relative_to(ROOT)}'s \"files\" what {path.name} states of its commit, tree, start, "
            f"finish and CPU, then `python -m vcpo.provenance declare-files {name}` declares the rest from git")
    assert holder.exists(), f"{name}: no {FOLDER_RECORD} beside it: {hint}"
    document = json.loads(holder.read_text())
    if not unrecorded(document):  # the whole folder's run
        return
    entry = document.get("files", {}).get(path.name)
    assert entry is not None, f"{name}: not in {FOLDER_RECORD}: {hint}"
    records = file_records(entry)
    gaps = [(index, missing) for index, record in enumerate(records) if (missing := unrecorded(record))]
    assert records and not gaps, f"{name}: records without (or declaring) these fields: {gaps[:3]}"
    for index, record in enumerate(records):  # what it records is what its text (or the file it names) states
        source = path.parent / record.get("source", path.name)
        assert (wrong := misstated(record, source.read_text())) == [], f"{name}, record {index}: {source.name} does not state {wrong}"


def folder_records() -> list[Path]:
    return sorted((ROOT / "tables").rglob(FOLDER_RECORD))


@pytest.mark.parametrize("holder", folder_records(), ids=lambda path: str(path.relative_to(ROOT)))
def test_a_folders_provenance_json_names_committed_files_and_declares_what_git_shows(holder):
    """Each file a folder's provenance.json names is committed there; each declaration's commits are the ones that first
    added it and last changed it (the file changed since: declare it again)."""
    committed = set(committed_files())
    for name, entry in json.loads(holder.read_text()).get("files", {}).items():
        path = holder.parent / name
        assert str(path.relative_to(ROOT)) in committed, f"{holder.relative_to(ROOT)} names {name}, which is not committed there"
        changes, added = git_changes(path), git_additions(path).get(str(path.resolve()))
        for record in file_records(entry):
            shows = record.get("not_recorded", {}).get("git_shows")
            if shows and changes and added:  # (a clone without the history cannot tell)
                assert shows["added"] == added, (name, shows["added"], added)
                assert shows["last_changed"] == changes[-1], f"{name} changed in {changes[-1]['commit'][:12]} since: declare it again"


def test_which_files_keep_their_provenance_in_their_folders_record():
    names = ["tables/s/runs.jsonl", "tables/s/stats.json", "tables/s/summary.md", "tables/s/report.md", "tables/s/lr.png",
             "tables/s/metrics/run.jsonl.gz", "tables/m/cells_runs.md", "tables/m/map.png", "tables/m/provenance.json",
             "tables/e/check.json", "tables/e/overhead.log", "tables/e/profile.txt"]
    # a study's reports beside its rows (a runner's summary.md or report.md) need none; a markdown table without rows
    # beside it, a log and any other data file do
    assert needing_a_folder_record(names) == ["tables/m/cells_runs.md", "tables/e/overhead.log", "tables/e/profile.txt"]
    log = "# started 2026-11-29T02:36 UTC, commit 71a399c\ncommit cae00f5 (dirty: True), AMD EPYC, finished 2026-11-29T02:42:21+00:00"
    record = {"commit": "cae00f518c35", "dirty": True, "start": "2026-11-29T02:36+00:00", "finish": "2026-11-29T02:42:21+00:00", "cpu": "AMD EPYC"}
    assert misstated(record, log) == []
    assert misstated({**record, "commit": "0b6f089dd8ae", "dirty": False, "finish": "2026-11-29T02:43:00+00:00"}, log) == [
        "commit", "dirty", "finish"]
    declared = {"not_recorded": {"fields": list(RECORDED), "git_shows": {"added": {"commit": "c"}}}}
    assert unrecorded(declared) == [] and misstated(declared, "") == []


def test_declaring_a_files_record_keeps_what_it_states_and_declares_the_rest_from_git(tmp_path):
    from vcpo.provenance import declare_files

    def commit(name: str, text: str) -> dict:
        (tmp_path / name).write_text(text)
        subprocess.run(["git", "-C", str(tmp_path), "add", name], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", name], check=True)
        return git_changes(tmp_path / name)[-1]

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    first = commit("a.log", "one\n")
    later = commit("a.log", "two\n")
    other = commit("b.md", "| x |\n")
    (tmp_path / FOLDER_RECORD).write_text(json.dumps({"files": {"a.log": {"cpu": "AMD EPYC"}}}))
    assert declare_files([tmp_path / "a.log", tmp_path / "b.md"]) == 2
    files = json.loads((tmp_path / FOLDER_RECORD).read_text())["files"]
    assert files["a.log"]["cpu"] == "AMD EPYC" and files["a.log"]["not_recorded"]["fields"] == ["commit", "dirty", "start", "finish"]
    assert (files["a.log"]["not_recorded"]["git_shows"]["added"], files["a.log"]["not_recorded"]["git_shows"]["last_changed"]) == (first, later)
    assert files["b.md"]["not_recorded"]["git_shows"]["last_changed"] == other and unrecorded(files["b.md"]) == []


def test_a_record_counts_each_field_under_any_writers_name_and_declared_ones():
    assert unrecorded({"commit": "c", "dirty": False, "started": "t0", "finished": "t1", "cpu": "x"}) == []
    assert unrecorded({"provenance": {"commit": "c", "dirty": True, "start": "t0", "end": "t1"}, "machine": {"cpu": "x"}}) == []
    assert unrecorded({"commit": None, "dirty": False, "start": "t0", "end": 0.25, "cpu": "x"}) == ["commit", "finish"]  # a row's end: accuracy
    declared = {"cpu": "x", "not_recorded": {"fields": ["commit", "dirty", "start", "finish"], "git_shows": {"added": "c"}}}
    assert unrecorded(declared) == []
    assert unrecorded({**declared, "not_recorded": {"fields": ["commit"], "git_shows": None}}) == ["commit", "dirty", "start", "finish"]


def test_a_files_records_are_its_rows_its_provenance_holders_or_its_top_level():
    def ids(records: list[dict]) -> set[int]:
        return {id(record) for record in records}

    rows = [{"commit": "a"}, {"commit": "b"}]
    assert provenance_records(rows) == rows
    table = {"rows": {"x": {"provenance": {"commit": "a"}}, "y": {"provenance": {"commit": "b"}}},
             "provenance": {"model": "m"}}  # a provenance object that records none of the fields is no record
    assert ids(provenance_records(table)) == ids(table["rows"].values())
    ladder = {"ladder": [{"commit": "a", "outcome": {"end": 0.1}}], "rate": None}
    assert provenance_records(ladder) == ladder["ladder"]
    plain = {"cpu": "x", "settings": {"a": 1}}
    assert provenance_records(plain) == [plain]
    # a declaration's commits (what git shows) are not records, nor is a record's own provenance object
    declared = {"cpu": "x", "not_recorded": {"fields": ["commit"], "git_shows": {"added": {"commit": "c", "time": "t"}}},
                "timing": {"provenance": {"commit": "c", "not_recorded": {"fields": ["dirty"], "git_shows": {"added": {"commit": "c"}}}}}}
    assert ids(provenance_records(declared)) == {id(declared), id(declared["timing"])}


def test_declaring_from_git_gives_each_row_the_commit_that_first_held_it(tmp_path):
    from vcpo.provenance import declare_from_git

    def commit(document: dict, message: str) -> str:
        (tmp_path / "table.json").write_text(json.dumps(document, indent=1) + "\n")
        subprocess.run(["git", "-C", str(tmp_path), "add", "table.json"], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], check=True)
        return subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    first = commit({"arms": {"a": {"end": 0.1}}}, "one row")
    second = commit({"arms": {"a": {"end": 0.1}, "b": {"end": 0.2}}}, "two rows")
    assert declare_from_git(tmp_path / "table.json", rows_key="arms") == 2
    arms = json.loads((tmp_path / "table.json").read_text())["arms"]
    assert [arms[name]["provenance"]["not_recorded"]["git_shows"]["added"]["commit"] for name in "ab"] == [first, second]
    assert all(unrecorded(arm) == [] and arm["end"] for arm in arms.values())  # declared, the numbers kept
