"""Every committed row and statistics file under tables/ records what produced it (commit, dirty, start, finish, CPU)
or declares what it does not record with what git history shows instead (vcpo.provenance.unrecorded); the rules
that find a file's records, on hand-made cases."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import pytest

from vcpo.provenance import provenance_records, unrecorded

ROOT = Path(__file__).resolve().parents[1]
# Not row or statistics files of their own: a study's archive of run folders (each run's row in runs.jsonl carries its
# provenance) and a run's per-step metrics (its row or result file beside them carries it).
RUN_RECORDS = ("/runs/", "/metrics/", "/metrics_")


def committed_tables() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "tables"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [name for name in listed if name.endswith((".json", ".jsonl", ".jsonl.gz"))
            and not any(part in name for part in RUN_RECORDS)]


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
