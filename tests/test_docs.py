"""The numbers the README and docs/ quote, each against the committed file it comes from (tables, stats, logs,
benchmark JSON), whatever the sentence around it: a reworded doc passes, a changed digit fails. Claims without a
number (a sign, "in every round", "none alone") are asserted on the data they rest on. Sections: the studies
(docs/studies.md, docs/claims.md, the README's results, the registrations); speed (docs/simulator.md, Table 1 at
smoke scale, the `tir` gap); the engine, its memory and cost, the GPU check, verl's asynchrony and the real model
(docs/per_sequence_gradients.md, docs/verl.md, docs/data_rewards_evaluation.md)."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
from datetime import datetime

import numpy as np
import pytest
from prose_quotes import ROOT, assert_quoted, assert_quotes_are_the_statistics, normalised, section, study_prose

from vcpo.recipes import read_yaml
from vcpo.sim.config import SimConfig
from vcpo.studies.evidence_report import p_value, signed_points
from vcpo.studies.statistics import by_pair, detectable_difference, paired_difference, wilson_interval


def load_json(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def block(path: str, name: str) -> str:
    """The text between <!-- name --> and <!-- /name --> in ``path``, as written (outer blank lines removed)."""
    text = (ROOT / path).read_text()
    return text.split(f"<!-- {name} -->\n", 1)[1].split(f"<!-- /{name} -->", 1)[0].strip()


# ---------------------------------------------------------------------------------------------
# The studies: docs/studies.md, docs/claims.md, the README's results, the registrations
# ---------------------------------------------------------------------------------------------


def load_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / path).read_text().splitlines() if line.strip()]


def evidence_stats() -> dict:
    """The evidence study's committed statistics (tables/evidence/stats.json), which the prose quotes."""
    return load_json("tables/evidence/stats.json")


def evidence_section() -> str:
    """The evidence study's section of docs/studies.md, `normalised`."""
    return study_prose(ROOT, "docs/studies.md", ("## The evidence study", "## The across-lags study"), "evidence")


def bullets_of(path: str, start: str, stop: str) -> list[str]:
    """The part of ``path`` from ``start`` to ``stop`` as its lead paragraph and its top-level bullets, each `normalised`."""
    text = (ROOT / path).read_text()
    begin = text.index(start)
    return [normalised(part) for part in text[begin:text.index(stop, begin)].split("\n- ")]


def stretches(text: str, label: str, stops: tuple[str, ...]) -> list[str]:
    """Each stretch of (normalised) ``text`` from an occurrence of ``label`` to the nearest of ``stops`` after it."""
    label, found, begin = normalised(label), [], text.find(normalised(label))
    while begin != -1:
        ends = [end for end in (text.find(stop, begin + len(label)) for stop in stops) if end != -1]
        found.append(text[begin:min(ends) if ends else len(text)])
        begin = text.find(label, begin + 1)
    return found


def is_quoted(text: str, *numbers: str) -> bool:
    try:
        assert_quoted(text, *numbers)
    except AssertionError:
        return False
    return True


def assert_labelled(text: str, label: str, *numbers: str, stops: tuple[str, ...] = ("]", ";", ". ")) -> None:
    """Some stretch after ``label`` (up to the interval's end, or its clause's) quotes all of ``numbers``: the
    comparison 'A - B' is a - b, not b - a nor another pair's."""
    found = stretches(text, label, stops)
    assert any(is_quoted(stretch, *numbers) for stretch in found), (label, numbers, found)


def assert_counts(text: str, *counts: tuple[int, int]) -> None:
    """Each (k, n) of ``counts`` stands in (normalised) ``text`` as a count: 'k of n', 'k of the n' or 'k/n' ('none'
    for a k of 0)."""
    missing = [(k, n) for k, n in counts
               if not re.search(rf"(?<![\d.])(?:{k}{'|none' if k == 0 else ''})(?: of (?:the )?|/){n}(?!\d|\.\d)", text)]
    assert not missing, f"not counted: {missing}"


def sentence_quoting(text: str, number: str) -> str:
    """The first sentence of (normalised) ``text`` that quotes ``number``."""
    sentences = [s for s in re.split(r"(?<=[.;:])\s+(?=[A-Z(*`])", text) if is_quoted(s, number)]
    assert sentences, f"no sentence quotes {number}"
    return sentences[0]


def interval_quotes(c: dict) -> tuple[str, str, str]:
    """A comparison's mean and interval as signed points, as the prose quotes them (+X [+a, +b])."""
    return signed_points(c["mean"]), signed_points(c["low"]), signed_points(c["high"])


def difference(c: dict) -> tuple[str, ...]:
    """A comparison's mean, interval and Holm p as the claims table quotes them."""
    return (*interval_quotes(c), f"{c['p_holm']:.3f}")


def claims_table() -> dict[int, list[str]]:
    """docs/claims.md's rows by number: the cells (claim, measured, verdict, where a GPU would test it), each `normalised`."""
    rows = {}
    for line in (ROOT / "docs/claims.md").read_text().splitlines():
        if match := re.match(r"\| (\d+) \|", line):
            rows[int(match[1])] = [normalised(cell) for cell in line.strip().strip("|").split(" | ")[1:]]
    return rows


def claims_rows() -> dict[int, str]:
    return {number: " | ".join(cells) for number, cells in claims_table().items()}


def wilson_quote(arm: dict, key: str = "collapse") -> str:
    """An arm's count's 95% Wilson interval as the claims table quotes it: '[11%, 60%]'."""
    return f"[{100 * arm[key + '_low']:.0f}%, {100 * arm[key + '_high']:.0f}%]"


def test_every_claims_verdict_is_the_rules():
    """docs/claims.md's verdict column is vcpo.studies.verdicts' output from the committed statistics, row by row, and a
    claim resting on one timing run says so."""
    from vcpo.studies import readme_results
    from vcpo.studies.verdicts import claim_verdicts

    computed = claim_verdicts(readme_results.committed_statistics())
    written = {number: cells[2] for number, cells in claims_table().items()}
    assert written == computed
    assert "one timing run" in written[6] and "one timing run" in written[7]


def test_the_claims_table_quotes_its_files_numbers():
    """docs/claims.md: every number it quotes is the committed file's, computed here from that file."""
    from vcpo.studies.across_lags_report import common_rate_winners

    evidence = load_json("tables/evidence/stats.json")["tasks"]["countdown"]
    across = load_json("tables/across_lags/stats.json")
    arms, compared = evidence["arms"], by_pair(evidence["comparisons"])
    lr_controls = by_pair(evidence["learning_rate"]["comparisons"])
    confirm = across["tir_confirm"]
    confirmed = confirm["arms"]
    tir_seq_tis, tir_vcpo, tir_sync = (confirmed[a] for a in ("seq_tis_lr5e-4_k8", "vcpo_lr5e-4_k8", "sync_lr5e-4"))
    row = claims_rows()
    assert set(row) == set(range(1, 12))

    seq_tis, sync, vcpo = arms["seq_tis"], arms["sync"], arms["vcpo"]
    tuned = [across["countdown"]["arms"][f"seq_tis_lr5e-5_k{lag}"] for lag in across["countdown"]["lags"]]
    assert_quoted(row[1], f"{100 * seq_tis['end']:.1f}%", f"{100 * sync['end']:.1f}%")
    assert sum(a["collapses"] for a in tuned) == 0  # at its tuned rate seq-TIS collapses in none
    assert_counts(row[1], (seq_tis["collapses"], seq_tis["n"]), (sync["collapses"], sync["n"]), (0, sum(a["n"] for a in tuned)),
                  (tir_seq_tis["collapses"], tir_seq_tis["n"]), (tir_sync["collapses"], tir_sync["n"]))
    assert wilson_quote(seq_tis) in row[1] and wilson_quote(sync) in row[1] and wilson_quote(tir_seq_tis) in row[1]

    best = compared[("vcpo", "seq_tis")]
    assert_quoted(row[2], *difference(best))
    first_lag = across["countdown"]["same_rate"][0]
    assert first_lag["a"] == "vcpo_k12" and first_lag["p_holm"] < 0.05 <= first_lag["sign_p"]  # not confirmed at k = 12
    assert all(c["p_holm"] < 0.05 for c in across["countdown"]["same_rate"])  # above at every lag after Holm
    assert_quoted(row[2], p_value(first_lag["sign_p"]), signed_points(confirm["comparisons"][0]["mean"]))
    assert_counts(row[2], (best["sign_positive"], best["sign_n"]), (vcpo["collapses"], vcpo["n"]), (seq_tis["collapses"], seq_tis["n"]),
                  (first_lag["sign_positive"], first_lag["sign_n"]), (tir_seq_tis["collapses"], tir_seq_tis["n"]),
                  (tir_vcpo["collapses"], tir_vcpo["n"]), (tir_vcpo["holds"], tir_vcpo["n"]),
                  (confirm["comparisons"][0]["sign_positive"], confirm["comparisons"][0]["sign_n"]))
    assert wilson_quote(vcpo) in row[2] and wilson_quote(seq_tis) in row[2] and wilson_quote(tir_vcpo) in row[2]

    against_sync = compared[("vcpo", "sync")]
    assert_quoted(row[3], *difference(against_sync))
    assert against_sync["p_holm"] >= 0.05  # not detected after correction
    assert all(e["verdict"] == "equivalence not shown" for e in across["countdown"]["equivalence"])
    below = confirm["comparisons"][1]
    assert_quoted(row[3], signed_points(below["mean"]), p_value(below["p_holm"]))
    assert_counts(row[3], (below["sign_positive"], below["sign_n"]))
    assert below["sign_p"] >= 0.05  # a sign test does not confirm it

    ablation, step_size = compared[("vcpo", "tis_ess")], compared[("tis_ess", "seq_tis")]
    mean_rate = lr_controls[("vcpo", "seq_tis_vcpo_mean_lr")]
    assert_quoted(row[4], *difference(ablation), *difference(step_size), *difference(mean_rate))
    assert_counts(row[4], (step_size["sign_positive"], step_size["sign_n"]))
    assert ablation["p_holm"] >= 0.05 and step_size["p_holm"] < 0.05 and mean_rate["p_holm"] >= 0.05
    family = len(evidence["comparisons"])
    assert_quoted(row[4], str(family), f"{detectable_difference(100 * ablation['sd'], ablation['n'], 0.05 / family, 0.8):.1f}")

    best_rates = across["countdown"]["best_rates"]
    assert all(len(winners) == 1 for winners in common_rate_winners(best_rates).values())
    assert_quoted(row[5], f"{min(c['p_holm'] for c in across['countdown']['tuned']):.3f}")
    vcpo_48 = next(r for r in best_rates if r["method"] == "vcpo" and r["lag"] == 48)
    only_there = [lr for lr in vcpo_48["ends"] if not all(lr in r["ends"] for r in best_rates if r["method"] == "vcpo")]
    assert only_there == [next(lr for lr in vcpo_48["ends"] if float(lr) == vcpo_48["best_lr"])]  # its best, tested only at 48
    lowest = sum(r["best_lr"] == min(float(lr) for lr in r["ends"]) for r in best_rates)
    assert_counts(row[5], (lowest, len(best_rates)))

    table1 = load_json("tables/tir/table1_smoke.json")["tasks"]
    ratio = {task: table1[task]["async"]["wall_hours"]["mean"] / table1[task]["sync"]["wall_hours"]["mean"] for task in table1}
    times, spread = across["countdown"]["time_to_target"], across["countdown"]["time_ratio_range"]
    assert_quoted(row[6], f"{ratio['simpletir']:.2f}", f"{ratio['countdown']:.2f}", str(table1["countdown"]["async"]["lag"]),
                  f"{min(t['ratio'] for t in times):.2f}", f"{spread['low']:.2f}", f"{spread['high']:.2f}")
    tir = table1["simpletir"]
    assert_counts(row[6], *((tir[arm]["reached"], len(tir[arm]["seeds"])) for arm in ("sync", "async")))
    for folder in ("rounds_tir", GAP_TIR_ALL[0]):
        (timed,) = [arm for arm in load_json(f"tables/async_speed/{folder}/async_speed.json")["tasks"]["tir"]["arms"] if arm["method"] == "vcpo"]
        assert_quoted(row[6], f"{timed['speedup_over_sync']:.2f}x", span(timed["speedup_rounds"], 2))

    log = (ROOT / "tables/opob_engine/two_pass_floor_50m.log").read_text()
    step = {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)\s+[\d.]+\s+([\d.]+)\s", log, re.MULTILINE)}
    overhead = load_json("tables/gpu_check/gpu_check.json")["overhead"]
    gpu, gpu_model = overhead["ratios"]["step_time_ratio"]["opob"], re.match(r"([\d.]+)b,", overhead["setting"])[1]
    params = re.search(r"\(([\d.]+)M params\)", log)[1]
    assert_quoted(row[7], f"{step['opob']:.2f}", f"{step['two_pass']:.2f}", f"{params}M", f"{gpu_model}B", f"{gpu:.2f}")
    dispatched = operator_counts("aten_ops_0.5b.log")["split", None]["dispatched"]
    assert_quoted(row[7], f"{dispatched['opob'] / dispatched['plain']:.2f}x")
    ratios, _ = allocator_runs()
    assert_quoted(row[7], f"{max(max(r) for (_, kept), r in ratios.items() if kept):.2f}")
    measuring = (ROOT / "tables/opob_engine/measuring_G8.log").read_text()
    assert "in 8 groups" in measuring
    peaks = dict(re.findall(r"(\S+) ([\d.]+) C", measuring.split("in float32 copies of the model")[1].splitlines()[0]))
    assert_quoted(row[7], "8", peaks["vcpo"], peaks["plain"])

    gsm8k = load_json("tables/real_model/base_eval.json")["rows"]["gsm8k"]
    assert_quoted(row[8], f"{100 * gsm8k['strict']['mean_at_n']:.1f}%")


def test_the_real_models_claims_rows_are_written_from_its_committed_statistics():
    """docs/claims.md's rows 9-11 are what the lag study's report writes from its committed stats.json (so they move
    with every committed run), and the block sits under the section that explains them."""
    from vcpo.studies.real_model_lag_report import claims_markdown

    before, rest = (ROOT / "docs/claims.md").read_text().split("<!-- real_model_claims -->\n")
    written, _ = rest.split("\n<!-- /real_model_claims -->")
    assert written == claims_markdown(load_json("tables/real_model_lag/stats.json"))
    assert "## On a real pretrained model" in before.split("| 8 |")[1]


def test_the_regime_study_quotes_its_paired_differences_as_computed_from_its_table():
    """The 3-seed comparisons the regime study's write-up (docs/studies.md) states are recomputed from the
    committed outcomes, each after its label (a - b, not b - a)."""
    runs = load_json("tables/regime_study/outcomes.json")["runs"]

    def ends(method):
        return {r["seed"]: r["end"] for r in runs if r["method"] == method and (r["lag"] == 48 or method == "sync")}

    regime = section("docs/studies.md", "## The regime study", "## Stability maps")
    for a, b, label in [("vcpo", "seq_tis_c8", "VCPO - seq-TIS"), ("vcpo", "sync", "VCPO - sync"),
                        ("vcpo", "tis_ess", "VCPO - ESS step only"), ("vcpo", "tis_opob", "VCPO - OPOB only"),
                        ("tis_ess", "seq_tis_c8", "ESS step only - seq-TIS"), ("tis_opob", "seq_tis_c8", "OPOB only - seq-TIS")]:
        first, second = ends(a), ends(b)
        seeds = sorted(first.keys() & second.keys())
        result = paired_difference([first[s] for s in seeds], [second[s] for s in seeds])
        quoted = [f"{100 * result['mean']:+.1f}", f"{100 * result['low']:.1f}", f"{100 * result['high']:.1f}", f"{result['p']:.2g}"]
        if b in ("tis_ess", "tis_opob"):  # the labels of VCPO against its ablations name the ablation's mean end
            quoted.append(f"{np.mean(list(second.values())):.3f}")
        assert_labelled(regime, label, *quoted, stops=(";", ". "))


def test_every_interval_the_prose_quotes_is_in_the_committed_statistics():
    """Every interval and comparison the evidence study's prose quotes is in its committed stats.json."""
    stats = evidence_stats()
    arms = [arm for entry in stats["tasks"].values() for arm in entry["arms"].values()]
    comparisons = []
    for entry in stats["tasks"].values():
        learning_rate = entry.get("learning_rate", {})
        comparisons += (entry["comparisons"] + entry["comparisons_last_quarter"] + learning_rate.get("comparisons", [])
                        + learning_rate.get("tuned_against_tuned", []))
    assert_quotes_are_the_statistics(evidence_section(), arms, comparisons)


def test_the_evidence_studys_counts_and_predictor_in_the_prose_are_the_committed_ones():
    countdown = evidence_stats()["tasks"]["countdown"]
    arms, predictor = countdown["arms"], countdown["predictor"]
    headline = section("docs/studies.md", "**Countdown at lag", "**Does the adaptive step")
    adaptive = section("docs/studies.md", "**Does the adaptive step", "**ESS as an early warning")
    warning = section("docs/studies.md", "**ESS as an early warning", "**How far a row moves")
    spread = section("docs/studies.md", "**How far a row moves", "**Tool use")

    _, lead, *_ = bullets_of("docs/studies.md", "**Countdown at lag", "**Does the adaptive step")
    above = by_pair(countdown["comparisons"])[("vcpo", "seq_tis")]
    assert above["sign_p"] < 0.05 and above["sign_positive"] > above["sign_n"] / 2  # the sign test confirms it
    assert_counts(lead, (above["sign_positive"], above["sign_n"]), (arms["vcpo"]["collapses"], arms["vcpo"]["n"]),
                  (arms["seq_tis"]["collapses"], arms["seq_tis"]["n"]))
    assert_quoted(lead, p_value(above["sign_p"]))
    for name in ("vcpo", "seq_tis"):  # the collapse counts' Wilson intervals, which overlap: no difference shown
        assert f"[{100 * arms[name]['collapse_low']:.0f}%, {100 * arms[name]['collapse_high']:.0f}%]" in lead
    assert arms["seq_tis"]["collapse_low"] < arms["vcpo"]["collapse_high"]

    low, high = predictor["auc_interval"]
    assert_quoted(warning, f"{predictor['auc']:.2f}", "95%", f"{low:.2f}", f"{high:.2f}",
                  str(min(predictor["lead_steps"])), str(max(predictor["lead_steps"])), str(predictor["runs"]))
    assert_counts(warning, (predictor["hits"], predictor["collapsed"]),
                  (predictor["false_alarms"], predictor["runs"] - predictor["collapsed"]))
    for name in ("seq_tis", "tis_opob"):  # each arm's collapse count stands after its end (its interval) and before ")"
        (after_end,) = stretches(headline, f"{100 * arms[name]['end']:.1f}% [", (")",))
        assert_counts(after_end, (arms[name]["collapses"], arms[name]["n"]))
    mantissa, exponent = f"{arms['seq_tis_vcpo_mean_lr']['lr']:.2e}".split("e")
    assert_quoted(adaptive, f"{arms['vcpo']['mean_lr_scale']:.2f}", f"{mantissa}e{int(exponent)}")
    assert_quoted(spread, *(f"{100 * arms[name]['end_sd']:.1f}" for name in ("sync", "vcpo", "seq_tis")))
    vcpo_rates = [arm for arm in arms.values() if arm["method"] == "vcpo"]
    assert not any(a["collapses"] for a in vcpo_rates)  # none of VCPO's runs collapses
    assert_quoted(adaptive, str(sum(a["n"] for a in vcpo_rates)))
    assert [arms[a]["collapses"] for a in ("seq_tis_lr5e-5", "seq_tis_lr1e-4", "seq_tis_lr1.5e-4", "seq_tis")] == [0, 1, 0, 3]


def test_each_difference_the_prose_quotes_is_signed_as_its_label_says():
    """'A - B +X' must be the comparison a - b (not b - a, nor another pair that happens to share the interval)."""
    countdown = evidence_stats()["tasks"]["countdown"]
    comparisons = by_pair(countdown["comparisons"] + countdown["learning_rate"]["comparisons"])
    studies = evidence_section()
    for label, pair in [
        ("VCPO - seq-TIS", ("vcpo", "seq_tis")), ("ESS step alone - seq-TIS", ("tis_ess", "seq_tis")),
        ("VCPO - ESS step alone is", ("vcpo", "tis_ess")), ("OPOB alone - seq-TIS", ("tis_opob", "seq_tis")),
        ("VCPO against sync:", ("vcpo", "sync")), ("against tuned seq-TIS:", ("vcpo", "seq_tis_lr5e-5")),
        ("against sync at 1e-4:", ("vcpo", "sync_lr1e-4")), ("(1.12e-4) VCPO is", ("vcpo", "seq_tis_vcpo_mean_lr")),
        ("per-step factor", ("vcpo", "seq_tis_vcpo_replay")),
    ]:
        assert_labelled(studies, label, *interval_quotes(comparisons[pair]))


def test_the_tool_use_paragraph_quotes_the_committed_tir_statistics():
    tir = evidence_stats()["tasks"]["tir"]
    rows = [row for row in load_rows("tables/evidence/runs.jsonl") if row["task"] == "tir"]
    arms = tir["arms"]
    pick, secondary = by_pair(tir["comparisons"]), by_pair(tir["comparisons_last_quarter"])
    lead, bases, steps, warning = bullets_of("docs/studies.md", "**Tool use (`tir`)", "A row's command re-runs it")

    for label, c in [("VCPO - seq-TIS", pick[("vcpo", "seq_tis")]), ("VCPO - sync", pick[("vcpo", "sync")]),
                     ("VCPO - OPOB at k = 0", pick[("vcpo", "tis_opob_sync")]), ("OPOB at k = 0 - sync", pick[("tis_opob_sync", "sync")]),
                     ("VCPO - seq-TIS", secondary[("vcpo", "seq_tis")]), ("VCPO - sync", secondary[("vcpo", "sync")])]:
        assert_labelled(lead, label, *interval_quotes(c))
    assert all(c["verdict"] == "no detectable difference" for c in tir["comparisons"])
    assert not any(arm["collapses"] for arm in arms.values())  # no run collapses

    sds = sorted(100 * arm["end_sd"] for name, arm in arms.items() if name != "sync")
    by_seed = {}
    for row in rows:
        by_seed.setdefault(row["seed"], []).append(row["end"])
    assert_quoted(bases, f"{100 * arms['sync']['end_sd']:.1f}", f"{sds[0]:.1f}", f"{sds[-1]:.1f}",
                  f"{100 * min(r['base'] for r in rows):.0f}", f"{100 * max(r['base'] for r in rows):.0f}%",
                  f"{100 * max(max(v) - min(v) for v in by_seed.values()):.1f}")

    first = sorted(arm["tool_calls_first"] for arm in arms.values())
    last = sorted(arm["tool_calls_last"] for arm in arms.values())
    assert_quoted(steps, f"{arms['vcpo']['mean_lr_scale']:.3f}", f"{arms['seq_tis']['ess_min']:.3f}", f"{arms['vcpo']['ess_min']:.3f}",
                  *(f"{arms[name]['grad_norm_max']:.2f}" for name in ("seq_tis", "vcpo", "sync")),
                  f"{first[0]:.2f}", f"{first[-1]:.2f}", f"{last[0]:.2f}", f"{last[-1]:.2f}",
                  *(f"{100 * arms[name]['tool_error_last']:.1f}%" for name in ("sync", "seq_tis", "vcpo", "tis_opob_sync")))

    predictor = tir["predictor"]
    assert predictor["collapsed"] == 0  # the early warning cannot be scored: none collapsed
    assert_counts(warning, (predictor["false_alarms"], predictor["runs"]))

    countdown = evidence_stats()["tasks"]["countdown"]["arms"]
    trust = section("docs/studies.md", "How far to trust it", "![Figure 1 at smoke scale]")
    assert_quoted(trust, f"{100 * arms['sync']['end_sd']:.1f}", *(f"{100 * countdown[name]['end_sd']:.1f}" for name in ("sync", "vcpo", "seq_tis")))


def test_every_difference_the_evidence_prose_calls_detected_says_what_its_sign_test_says():
    """A comparison the evidence study's prose quotes with Holm p < 0.05 is followed, in its clause, by its sign test:
    the seeds above, the test's p and, where the sign test does not agree (``sign_agrees``), that it does not confirm
    it (the tool-use secondary VCPO - seq-TIS: 8 of 10 seeds above, p 0.109)."""
    from prose_quotes import COMPARISON_QUOTE

    from vcpo.studies.statistics import sign_agrees

    stats = evidence_stats()
    comparisons = [c for entry in stats["tasks"].values() for c in entry["comparisons"] + entry["comparisons_last_quarter"]
                   + entry.get("learning_rate", {}).get("comparisons", [])]
    text = evidence_section()
    checked = []
    for match in COMPARISON_QUOTE.finditer(text):
        quote, _, holm_p = match.groups()
        found = [c for c in comparisons if f"{signed_points(c['mean'])} points {interval_of(c)}" == quote
                 and p_value(c["p_holm"]) == holm_p]
        if len(found) != 1 or found[0]["p_holm"] >= 0.05:
            continue
        (c,) = found
        clause = re.split(r"; |\. (?=[A-Z])", text[match.end():], maxsplit=1)[0]
        if not sign_agrees(c):
            assert "not confirm" in clause, (quote, clause)
            assert_counts(clause, (c["sign_positive"], c["sign_n"]))
            assert_quoted(clause, p_value(c["sign_p"]))
        checked.append((quote, sign_agrees(c)))
    assert ("+3.1 points [+0.9, +5.2]", False) in checked  # the tool-use secondary: 8 of 10 above, sign p 0.109
    tir = by_pair(stats["tasks"]["tir"]["comparisons_last_quarter"])[("vcpo", "seq_tis")]
    assert (tir["sign_positive"], tir["sign_n"], p_value(tir["sign_p"])) == (8, 10, "0.109") and tir["p_holm"] < 0.05


def interval_of(c: dict) -> str:
    """A comparison's 95% interval as the prose quotes it: '[+0.9, +5.2]'."""
    return f"[{signed_points(c['low'])}, {signed_points(c['high'])}]"


def test_the_step_sizes_share_is_said_as_far_as_its_controls_carry_it():
    """docs/studies.md credits the ESS step size (alone above seq-TIS) but not its adaptive part: the overview's row
    and the evidence study's bullet each quote VCPO - seq-TIS at VCPO's mean step as a constant rate, which no test
    separates from zero, and say the adaptive part is not shown; neither says the step size 'does it'."""
    countdown = evidence_stats()["tasks"]["countdown"]
    step_size = by_pair(countdown["comparisons"])[("tis_ess", "seq_tis")]
    controls = by_pair(countdown["learning_rate"]["comparisons"])
    mean_rate = controls[("vcpo", "seq_tis_vcpo_mean_lr")]
    assert step_size["p_holm"] < 0.05 and mean_rate["p_holm"] >= 0.05 and controls[("vcpo", "seq_tis_vcpo_replay")]["p_holm"] >= 0.05
    overview = next(normalised(line) for line in (ROOT / "docs/studies.md").read_text().splitlines()
                    if line.startswith("| [evidence study]"))
    _, _, components, _ = bullets_of("docs/studies.md", "**Countdown at lag", "**Does the adaptive step")
    for text in (overview, components):
        assert "adaptive part is not shown" in text and "what does it" not in text and "through its ESS step" not in text
        assert_labelled(text, "constant rate equal to", signed_points(mean_rate["mean"]), p_value(mean_rate["p_holm"]), stops=(")",))
    assert_labelled(components, "ESS step alone - seq-TIS", *interval_quotes(step_size), p_value(step_size["p_holm"]), stops=(";", ". "))


def test_the_lr_5e_5_study_calls_the_papers_result_untested_because_seq_tis_never_fails():
    """The study at lr 5e-5: by claims.md's rule a result whose premise (seq-TIS failing) did not arise is untested,
    not 'not reproduced'; the premise's absence is the tables': no seq-TIS run ends at or below half its best (a row
    of several seeds gives the mean of their bests, so its largest best is at most seeds x mean best - (seeds - 1) x
    the lowest end)."""
    prose = section("docs/studies.md", "## The study at lr 5e-5", "## The regime search")
    assert "untested here: its premise did not arise" in prose and "not reproduced" not in prose
    rows = []
    for name in ("core_k12", "methods_k12", "lag_sweep"):
        for line in (ROOT / "tables" / "sim_study" / f"{name}.md").read_text().splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if cells[0].startswith("seq_tis"):
                seeds, best = int(cells[2]), float(cells[5])
                low = float(re.search(r"\(([\d.]+)-", cells[4])[1])
                rows.append((name, cells[1], low, seeds * best - (seeds - 1) * low))
    assert {lag for _, lag, _, _ in rows} == {"2", "4", "8", "12", "24", "48"}
    assert all(low > largest_best / 2 for _, _, low, largest_best in rows), rows


def test_the_summaries_give_each_comparisons_detectable_difference_at_holms_first_step():
    """tables/evidence/summary.md and tables/across_lags/summary.md: beside the detectable difference at 0.05 before
    Holm, each table of one Holm family gives the one at the level Holm's first step tests at (0.05 / the family's
    tests), from the comparison's paired SD and pairs in stats.json (the evidence study's Countdown: 15.2, 7.4 and
    12.9 points for VCPO - seq-TIS, VCPO - ESS step alone and OPOB alone - seq-TIS at 0.05 / 6); each summary is what
    its report writes from stats.json now."""
    from vcpo.studies import across_lags_report, evidence_report

    evidence, across = load_json("tables/evidence/stats.json"), load_json("tables/across_lags/stats.json")
    families = {"tables/evidence/summary.md": [family for entry in evidence["tasks"].values()
                                               for family in (entry["comparisons"], entry["comparisons_last_quarter"])],
                "tables/across_lags/summary.md": [across["countdown"][key] for key in ("primary", "same_rate", "tuned", "vcpo_rates")]
                + [across["tir_confirm"]["comparisons"]]}
    for path, groups in families.items():
        text = (ROOT / path).read_text()
        tables = [block for block in text.split("\n\n") if block.startswith("| a - b |")]
        assert len(tables) == len(groups)
        for table, family in zip(tables, groups, strict=True):
            header, _, *rows = table.splitlines()
            columns = [cell.strip() for cell in header.strip("|").split("|")]
            tests = sum("p_holm" in c for c in family)
            holm_column = columns.index(f"detectable at 90% power, two-sided 0.05 / {tests} (Holm's first step)")
            plain_column = columns.index("detectable at 90% power, two-sided 0.05 before Holm")
            for row, c in zip(rows, family, strict=True):
                cells = [cell.strip() for cell in row.strip("|").split("|")]
                assert cells[0] == f"{c['a']} - {c['b']}"
                at_holm = detectable_difference(100 * c["sd"], c["n"], 0.05 / tests, 0.9)
                assert cells[holm_column] == f"{at_holm:.1f}", (path, cells[0])
                assert cells[plain_column] == f"{detectable_difference(100 * c['sd'], c['n'], 0.05, 0.9):.1f}"
                assert tests == 1 or at_holm > detectable_difference(100 * c["sd"], c["n"], 0.05, 0.9)
    countdown = dict(zip((f"{c['a']} - {c['b']}" for c in evidence["tasks"]["countdown"]["comparisons"]),
                         evidence["tasks"]["countdown"]["comparisons"], strict=True))
    assert [f"{detectable_difference(100 * countdown[pair]['sd'], 10, 0.05 / 6, 0.9):.1f}"
            for pair in ("vcpo - seq_tis", "vcpo - tis_ess", "tis_opob - seq_tis")] == ["15.2", "7.4", "12.9"]
    assert (ROOT / "tables/evidence/summary.md").read_text() == evidence_report.summary_markdown(evidence)
    assert (ROOT / "tables/across_lags/summary.md").read_text() == across_lags_report.summary_markdown(across)


def test_the_across_lags_registration_quotes_the_power_of_the_realised_sds():
    """recipes/sim/across_lags.md: the paired SDs it names are the evidence table's, and the detectable
    differences it quotes are detectable_difference's of them."""
    power = section("recipes/sim/across_lags.md", "- **Power**", "## Kernels")
    rows = load_rows("tables/evidence/runs.jsonl")
    end = {(row["arm"], row["seed"]): row["end"] for row in rows if row["task"] == "countdown"}

    def paired_sd(a: str, b: str) -> float:
        return float(np.std([end[(a, s)] - end[(b, s)] for s in range(10)], ddof=1)) * 100

    primary, collapsing = paired_sd("vcpo", "seq_tis_lr5e-5"), paired_sd("vcpo", "seq_tis")
    levels = (0.05, 0.0125)  # two-sided, and the first Holm step of four
    assert_quoted(power, f"{primary:.2f}", f"{collapsing:.1f}", *(str(alpha) for alpha in levels))
    for probability in (0.9, 0.8):
        assert_quoted(power, f"{100 * probability:.0f}%",
                      *(f"{detectable_difference(sd, 10, alpha, probability):.1f}" for sd in (primary, collapsing) for alpha in levels))


def test_the_across_lags_registration_quotes_the_kernel_measurement():
    table = load_json("tables/kernel_pinning/kernel_pinning.json")["settings"]
    kernels = section("recipes/sim/across_lags.md", "## Kernels", "## Provenance")
    assert_quoted(kernels, f"{table['compatible']['time_vs_native']:.2f}", f"{table['avx2']['time_vs_native']:.2f}")
    prints = [json.dumps(setting["fingerprint"]) for setting in table.values()]
    assert len(set(prints)) == len(prints) and all(setting["repeats_identical"] for setting in table.values())


def test_the_evidence_corrections_quote_the_committed_power_framing_and_predictor():
    """The evidence study's corrections: the detectable differences of the realised SDs at the level Holm's first step
    uses (0.05 over the six comparisons), the tuned-against-tuned framing and the predictor without sync runs with a
    bootstrap over bases, each as stats.json has it."""
    countdown = evidence_stats()["tasks"]["countdown"]
    pairs = by_pair(countdown["comparisons"])
    _, _, components, _ = bullets_of("docs/studies.md", "**Countdown at lag", "**Does the adaptive step")
    adaptive = section("docs/studies.md", "**Does the adaptive step", "**ESS as an early warning")
    warning = section("docs/studies.md", "**ESS as an early warning", "**How far a row moves")

    ess, opob, core = ("vcpo", "tis_ess"), ("tis_opob", "seq_tis"), ("vcpo", "seq_tis")
    first_step = 0.05 / len(countdown["comparisons"])
    assert_quoted(components, "90%", str(len(countdown["comparisons"])), *(f"{100 * pairs[pair]['sd']:.1f}" for pair in (ess, opob, core)),
                  *(f"{detectable_difference(100 * pairs[pair]['sd'], pairs[pair]['n'], first_step, 0.9):.1f}" for pair in (ess, opob, core)))
    tuned = countdown["learning_rate"]["tuned_against_tuned"][0]
    assert (tuned["a"], tuned["b"]) == ("vcpo_lr1e-4", "seq_tis_lr5e-5")
    assert_labelled(adaptive, "VCPO at 1e-4 - seq-TIS at 5e-5", *interval_quotes(tuned), p_value(tuned["p"]), stops=(";", ". "))
    assert set(countdown["learning_rate"]["best_at_grid_edge"].values()) == {"lowest"}  # every best rate is its grid's lowest
    predictor = countdown["predictor"]
    low, high = predictor["lagged_auc_base_interval"]
    assert_quoted(warning, str(predictor["lagged_runs"]), f"{predictor['lagged_auc']:.2f}", "95%", f"{low:.2f}", f"{high:.2f}")
    assert low < 0.5 < high  # the interval includes chance


def across_lags_rows() -> list[dict]:
    from vcpo.studies.across_lags import TABLE

    return load_rows(TABLE) if (ROOT / TABLE).exists() else []


def test_the_kernels_paragraph_quotes_the_sync_repeats_and_the_kernel_costs():
    """docs/studies.md's kernels paragraph: the seed-0 sync ends the across-lags study repeated from the evidence
    study on the same CPU type (to the last digit), and the kernel table's costs."""
    rows = [row for row in across_lags_rows() if row["method"] == "sync" and row["study_task"] == "countdown"]
    if not rows:
        pytest.skip("no sync runs archived yet")
    evidence = {(row["arm"], row["seed"]): row for row in load_rows("tables/evidence/runs.jsonl") if row["task"] == "countdown"}
    seed0 = [(new, evidence[("sync" if new["lr"] == 2e-4 else "sync_lr1e-4", 0)]) for new in rows if new["seed"] == 0]
    same_cpu = {new["lr"]: new["end"] for new, old in seed0 if new["cpu"] == old["cpu"]}
    assert all(new["end"] == old["end"] for new, old in seed0 if new["cpu"] == old["cpu"])  # to the last digit
    from vcpo.studies.across_lags_report import rate_label

    kernels = load_json("tables/kernel_pinning/kernel_pinning.json")["settings"]
    paragraph = section("docs/studies.md", "**Kernels.**", "## Registering a future study")
    assert_quoted(paragraph, f"{100 * same_cpu[2e-4]:.1f}%", f"{100 * same_cpu[1e-4]:.1f}%", rate_label(2e-4), rate_label(1e-4),
                  f"{kernels['avx2']['time_vs_native']:.2f}", f"{kernels['compatible']['time_vs_native']:.2f}")


def test_the_prose_quotes_the_committed_search_outcome():
    """docs/studies.md says what the search's rows give: the chosen cell, and its seq-TIS and sync counts."""
    from vcpo.studies.across_lags import search_report
    from vcpo.studies.across_lags_report import rate_label

    outcome = search_report([row for row in across_lags_rows() if row["counts"] and row["study_task"] == "tir_search"])
    if not outcome["complete"]:
        pytest.skip("the search is not complete in the committed rows")
    chosen = next(c for c in outcome["cells"] if (c["lr"], c["lag"]) == (outcome["chosen"]["lr"], outcome["chosen"]["lag"]))
    intro = section("docs/studies.md", "## The across-lags study", "<!-- across_lags_results -->")
    sentence = sentence_quoting(intro, rate_label(chosen["lr"]))
    assert_quoted(sentence, str(chosen["lag"]))
    assert_counts(sentence, (chosen["seq_tis_collapses"], chosen["seq_tis_n"]), (chosen["sync_holds"], chosen["sync_n"]))




def test_the_results_blocks_are_generated_from_the_committed_statistics():
    """docs/studies.md's across-lags results and the README's results are what the reports write from the committed
    stats.json files now."""
    from vcpo.studies import readme_results
    from vcpo.studies.across_lags_report import results_markdown

    stats = load_json("tables/across_lags/stats.json")
    assert block("docs/studies.md", "across_lags_results") == results_markdown(stats).strip()
    assert block("README.md", "results") == readme_results.results_markdown(readme_results.committed_statistics()).strip()


def test_the_readmes_status_paragraph_says_what_the_statistics_say():
    """The status paragraph's two negative findings, as the statistics have them: no best rate moves with the lag,
    and a tuned fixed rate matches VCPO (no detectable difference, tuned against tuned)."""
    from vcpo.studies.across_lags_report import common_rate_winners

    stats = load_json("tables/across_lags/stats.json")
    evidence = evidence_stats()["tasks"]["countdown"]
    assert section("README.md", "At CPU scale", "## Fresh machine")  # the paragraph these findings back
    assert all(len(best) == 1 for best in common_rate_winners(stats["countdown"]["best_rates"]).values())
    tuned = stats["countdown"]["tuned"] + evidence["learning_rate"]["tuned_against_tuned"]
    assert tuned and all(c["p_holm"] >= 0.05 for c in tuned)


# ---------------------------------------------------------------------------------------------
# Speed: docs/simulator.md, Table 1 at smoke scale, the `tir` gap
# ---------------------------------------------------------------------------------------------


GAP_TIR = [
    ("gap_tir_evals", {"eval_every": "10", "eval_problems": "50"}),
    ("gap_tir_lr", {"lr": "2e-4"}),
    ("gap_tir_lag_model", {"lag_model": "pipeline_overlap"}),
]
GAP_TIR_MOVES_MOST = "gap_tir_lr"  # the folder whose setting alone brings async VCPO nearest the table's gain
# all of them together at the table's step count: (folder, settings, steps)
GAP_TIR_ALL = ("gap_tir_all", {key: value for _, setting in GAP_TIR for key, value in setting.items()}, 40)

SAVES = ("docs/simulator.md", "### What it saves on two cores", "## Rollouts")
# docs/studies.md on Table 1 at smoke scale: the table, its time breakdown and the timed rounds; then the tir gap
SHOWS = ("docs/studies.md", "### What Table 1 at smoke scale shows", "`tables/async_speed/gap_tir_")
GAP = ("docs/studies.md", "`tables/async_speed/gap_tir_", "How far to trust it:")
README_TIME = ("README.md", "Only the time ratios", "docs/studies.md#what-table-1-at-smoke-scale-shows")
ROUNDS_TABLE = ("docs/simulator.md", "| task, lag |")
README_TABLE = ("README.md", "| task: ours (paper's) |")


def numbers(cell: str) -> list[str]:
    """The numbers a table cell writes, in order ("22.3% (21.1-23.2)" -> ["22.3", "21.1", "23.2"])."""
    return re.findall(r"\d+(?:\.\d+)?", cell)


def table_rows(path: str, header: str) -> list[list[str]]:
    """The body rows (cells without the outer pipes) of the markdown table whose header line starts at ``header``."""
    text = (ROOT / path).read_text()
    lines = [line.strip() for line in text[text.index(header):].splitlines()]
    end = next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:end]]


def paragraph_after_table(path: str, header: str) -> str:
    """The paragraph that follows the markdown table whose header line starts at ``header``, `normalised`."""
    text = (ROOT / path).read_text()
    lines = text[text.index(header):].splitlines()
    start = next(i for i, line in enumerate(lines) if not line.strip().startswith("|"))
    return normalised("\n".join(lines[start:]).strip().split("\n\n")[0])


def assert_single(text: str, *numbers: str) -> None:
    """`assert_quoted` for single numbers, each of which must also stand outside a range: "1.05" in "1.05-1.25"
    does not count (a range quoted nearby would otherwise stand in for a number the prose dropped)."""
    assert_quoted(text, *numbers)
    text = normalised(text)
    missing = [number for number in numbers
               if not re.search(rf"(?<![\d.])(?<!\d-){re.escape(normalised(number))}(?!\d|\.\d)(?!-\d)", text)]
    assert not missing, f"quoted only as the end of a range: {missing}"


def span(values: list[float], digits: int) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def test_simulator_md_quotes_the_committed_speed_ups():
    """docs/simulator.md's numbers on what concurrency saves come from tables/async_speed/async_speed.json, and so do
    the one-run-per-lag ranges docs/studies.md quotes."""
    report = load_json("tables/async_speed/async_speed.json")
    doc = section(*SAVES)
    serial, concurrent = report["overlap"]["serial"], report["overlap"]["concurrent"]
    assert_single(doc, f"{serial['wall_s']:.1f}", f"{concurrent['wall_s']:.1f}", f"{report['overlap']['serial_over_concurrent']:.2f}",
                  f"{serial['overlap_bound_s']:.1f}", f"{serial['outside_steps_s']:.1f}",
                  f"{report['overlap']['concurrent_over_bound']:.2f}",
                  f"{concurrent['sums_s']['timing_s/update_actor']:.1f}", f"{serial['sums_s']['timing_s/update_actor']:.1f}")
    assert report["overlap"]["serial_over_concurrent"] > 1  # concurrent is the faster
    assert report["overlap"]["concurrent_over_bound"] < 1  # it beats the overlap bound...
    assert concurrent["sums_s"]["timing_s/update_actor"] < serial["sums_s"]["timing_s/update_actor"]  # ...updating faster alone
    bullets = {"countdown": section(SAVES[0], "**Countdown**", "\n- **"), "tir": section(SAVES[0], "**`tir`**", "\n- **")}
    busy = {"countdown": "learner_busy_s", "tir": "generator_busy_s"}
    for task in ("countdown", "tir"):
        part = report["tasks"][task]
        sync = part["sync"]
        assert part["best_sync_threads"] == 2 and sync["2"]["wall_s"] < sync["1"]["wall_s"]
        assert_single(doc, f"{sync['1']['wall_s']:.1f}", f"{sync['2']['wall_s']:.1f}")
        assert_single(bullets[task], f"{sync['1']['generation_share']:.0%}")
        # Countdown: the learner is the larger side, every run bound by it; tir: generation, every run bound by its generator
        bound_by = "learner" if task == "countdown" else "generator"
        assert (sync["1"]["generation_share"] < 0.5) == (task == "countdown")
        assert {arm["bound_by"] for arm in part["arms"]} == {bound_by}
        speedups, sides = {}, {}
        for method in ("seq_tis_c8", "vcpo"):
            arms = sorted((arm for arm in part["arms"] if arm["method"] == method), key=lambda arm: arm["lag"])
            assert [arm["lag"] for arm in arms] == [1, 2, 4, 12, 48]
            speedups[method] = [arm["speedup_over_sync"] for arm in arms]
            sides[method] = [arm[busy[task]] for arm in arms]
            assert_quoted(bullets[task], span(speedups[method], 2), span(sides[method], 0))
        # VCPO's bound side is the longer one (OPOB in the learner on Countdown; the generator on tir), lag by lag
        assert all(v > s for v, s in zip(sides["vcpo"], sides["seq_tis_c8"], strict=True))
        if task == "countdown":
            assert min(sides["vcpo"]) > max(sides["seq_tis_c8"])
            assert_quoted(section(*SHOWS), span(speedups["seq_tis_c8"], 2), span(speedups["vcpo"], 2))
    tir_sync = report["tasks"]["tir"]["sync"]
    assert_single(bullets["tir"], f"{tir_sync['1']['wall_s'] / tir_sync['2']['wall_s']:.2f}")
    # the benchmarks' OPOB combination, named beside them, is the simulator's default
    assert report["opob_combination"] == SimConfig().opob_combination and report["opob_combination"] in bullets["countdown"]


def test_the_rounds_table_and_counts_are_the_committed_rounds():
    """docs/simulator.md's five-round table and its counts of rounds, and docs/studies.md's account of them, come
    from tables/async_speed/rounds_*."""
    rows = table_rows(*ROUNDS_TABLE)
    after = paragraph_after_table(*ROUNDS_TABLE)
    shows = section(*SHOWS)
    assert len(rows) == 2
    gains = {}
    for task, row in zip(("countdown", "tir"), rows, strict=True):
        part = load_json(f"tables/async_speed/rounds_{task}/async_speed.json")["tasks"][task]
        assert part["repeats"] == 5 and part["best_sync_threads"] == 2
        arms = {arm["method"]: arm for arm in part["arms"]}
        assert {arm["lag"] for arm in part["arms"]} == {int(n) for n in numbers(row[0])}  # the row's lag
        cells = [[f"{arm['speedup_over_sync']:.2f}", f"{min(arm['speedup_rounds']):.2f}", f"{max(arm['speedup_rounds']):.2f}"]
                 for arm in (arms["seq_tis_c8"], arms["vcpo"])]  # fmt: skip
        walls = part["sync"]["2"]["wall_s_rounds"]
        assert [numbers(cell) for cell in row[1:]] == [*cells, [f"{min(walls):.1f}", f"{max(walls):.1f}"]]
        gains[task] = {method: sum(ratio > 1 for ratio in arm["speedup_rounds"]) for method, arm in arms.items()}
        for method, arm in arms.items():  # docs/studies.md quotes both on Countdown, VCPO on tir
            if task == "countdown" or method == "vcpo":
                assert_single(shows, f"{arm['speedup_over_sync']:.2f}")
                assert_quoted(shows, span(arm["speedup_rounds"], 2))
        if task == "countdown":
            assert_quoted(after, span(walls, 1))
            seq_tis = arms["seq_tis_c8"]["speedup_rounds"]
            assert min(seq_tis) < 1 < max(seq_tis)  # seq-TIS level with sync: nothing measurable
            assert gains[task]["vcpo"] == 0 and arms["vcpo"]["speedup_over_sync"] < 1  # VCPO slower in every round
        else:
            assert all(arm["speedup_over_sync"] > 1 for arm in arms.values())  # both gain a little
    assert_single(after, str(gains["tir"]["seq_tis_c8"]), str(gains["tir"]["vcpo"]), "5")
    single = load_json("tables/async_speed/async_speed.json")["tasks"]["countdown"]["sync"]["2"]["wall_s"]
    assert_single(after, f"{single:.1f}")  # the single run's two-thread sync, beside the rounds' range


def test_the_tir_gap_numbers_are_the_committed_one_difference_benchmarks():
    """docs/studies.md's and the README's account of the `tir` speed gap: one setting of Table 1's runs at a time, five
    rounds each (GAP_TIR), none alone reaching the table's gain, GAP_TIR_MOVES_MOST nearest."""
    gap, readme = section(*GAP), section(*README_TIME)
    table1 = load_json("tables/tir/table1_smoke.json")["tasks"]["simpletir"]
    table_gain = table1["sync"]["wall_hours"]["mean"] / table1["async"]["wall_hours"]["mean"]
    gains, spans = {}, {}
    for folder, setting in GAP_TIR:
        report = load_json(f"tables/async_speed/{folder}/async_speed.json")
        part = report["tasks"]["tir"]
        assert report["settings"] == setting and part["repeats"] == 5 and part["best_sync_threads"] == 2
        (arm,) = part["arms"]
        assert_single(gap, f"{arm['speedup_over_sync']:.2f}")
        assert_quoted(gap, span(arm["speedup_rounds"], 2))
        gains[folder], spans[folder] = arm["speedup_over_sync"], span(arm["speedup_rounds"], 2)
    assert_single(gap, f"{1 / table_gain:.2f}", f"{table_gain:.2f}")
    assert max(gains.values()) < table_gain and max(gains, key=gains.get) == GAP_TIR_MOVES_MOST
    assert_single(readme, f"{gains[GAP_TIR_MOVES_MOST]:.2f}")
    assert_quoted(readme, spans[GAP_TIR_MOVES_MOST])
    folder, settings, steps = GAP_TIR_ALL
    report = load_json(f"tables/async_speed/{folder}/async_speed.json")
    part = report["tasks"]["tir"]
    assert report["settings"] == settings and part["steps"] == steps == table1["async"]["steps"]["mean"]
    assert part["repeats"] == 5 and part["best_sync_threads"] == 2
    (arm,) = part["arms"]
    assert arm["speedup_over_sync"] < table_gain  # together they do not reach it either
    assert_single(gap, f"{arm['speedup_over_sync']:.2f}")
    assert_quoted(gap, span(arm["speedup_rounds"], 2), str(steps))
    assert_single(readme, f"{arm['speedup_over_sync']:.2f}")
    assert_quoted(readme, span(arm["speedup_rounds"], 2))
    control = load_json("tables/async_speed/gap_tir_none/async_speed.json")  # the rounds' own setting on the same machine
    part = control["tasks"]["tir"]
    assert control["settings"] == {} and part["repeats"] == 5 and part["steps"] == 50
    (arm,) = part["arms"]
    assert_single(gap, f"{arm['speedup_over_sync']:.2f}")
    assert_quoted(gap, span(arm["speedup_rounds"], 2))
    rounds = load_json("tables/async_speed/rounds_tir/async_speed.json")["tasks"]["tir"]["arms"]
    assert_single(gap, f"{next(a for a in rounds if a['method'] == 'vcpo')['speedup_over_sync']:.2f}")


def test_the_readme_table_is_the_committed_smoke_table1():
    """Each row of the README's Table 1 writes the numbers of the committed smoke Table 1's row (tables/tir/
    table1_smoke.md), in its order, and the README has no other row: accuracy (ours, paper), steps (ours / paper),
    wall-clock minutes, minutes to sync's accuracy [reached / seeds] and the paper's GPU-hours."""
    committed = (ROOT / "tables/tir/table1_smoke.md").read_text()
    committed_rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in committed.splitlines()
                      if re.match(r"\| (Base|Sync|Async VCPO)", line)]  # fmt: skip
    # committed: method | ours | paper | steps ours | steps paper | wall-clock | core-minutes | GPU hours | to sync's | seeds
    expected = [[numbers(cells[i]) for i in (1, 2)] + [numbers(cells[3]) + numbers(cells[4])]
                + [numbers(cells[i]) for i in (5, 8, 7)] for cells in committed_rows]  # fmt: skip
    # README: task | method | ours | paper | steps ours / paper | wall-clock | to sync's | GPU-hours
    quoted = [[numbers(cells[i]) for i in (2, 3, 4, 5, 6, 7)] for cells in table_rows(*README_TABLE)]
    assert len(expected) == 6 and quoted == expected


def test_the_time_paragraphs_quote_the_committed_smoke_table1():
    """The ratios and the Countdown breakdown that docs/studies.md's "What Table 1 at smoke scale shows" and the
    README's summary under its table quote are the committed table's (tables/tir/table1_smoke.json)."""
    data = load_json("tables/tir/table1_smoke.json")["tasks"]
    text, summary = section(*SHOWS), section(*README_TIME)

    def minutes(value):
        return f"{value['mean'] * 60:.2f}"

    ratios = {}
    for task in ("countdown", "simpletir"):
        row = data[task]
        ratios[task] = row["async"]["wall_hours"]["mean"] / row["sync"]["wall_hours"]["mean"]
        assert_single(text, f"{ratios[task]:.2f}")
        assert_single(summary, f"{ratios[task]:.2f}")
        assert_single(text, f"{row['async']['accuracy']['mean'] * 100:.1f}%", f"{row['sync']['accuracy']['mean'] * 100:.1f}%")
    assert ratios["simpletir"] < 1 < ratios["countdown"]  # asynchrony saves time on tir, not on Countdown
    tir, countdown = data["simpletir"], data["countdown"]
    paper = f"{tir['paper']['async']['gpu_hours'] / tir['paper']['sync']['gpu_hours']:.2f}"
    assert_single(text, paper)
    assert_single(summary, paper)
    assert countdown["async"]["accuracy"]["mean"] < countdown["sync"]["accuracy"]["mean"]  # Countdown ends below sync
    assert_single(text, minutes(tir["async"]["hours_to_target"]), minutes(tir["sync"]["hours_to_target"]))
    assert tir["async"]["hours_to_target"]["mean"] < tir["sync"]["hours_to_target"]["mean"]
    assert_single(text, minutes(countdown["async"]["update"]), minutes(countdown["sync"]["update"]),
                  minutes(countdown["async"]["generation"]), minutes(countdown["sync"]["generation"]))
    assert countdown["async"]["update"]["mean"] > countdown["sync"]["update"]["mean"]
    assert countdown["async"]["generation"]["mean"] > countdown["sync"]["generation"]["mean"]
    share = countdown["async"]["update"]["mean"] / countdown["sync"]["wall_hours"]["mean"]
    assert_single(text, f"{share:.2f}", minutes(countdown["sync"]["wall_hours"]))


# ---------------------------------------------------------------------------------------------
# The engine, the GPU check, verl's asynchrony, the real model
# ---------------------------------------------------------------------------------------------


PER_SEQUENCE = "docs/per_sequence_gradients.md"


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def quote(value: float, low: float, high: float) -> str:
    """'X% [a, b]' in points, as the README and the docs write an estimate with its interval."""
    return f"{100 * value:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


# ---------------------------------------------------------------------------------------------
# docs/per_sequence_gradients.md: the memory model and the costs of OPOB's modes
# ---------------------------------------------------------------------------------------------


def test_the_docs_projection_table_is_the_launchers():
    """docs/per_sequence_gradients.md shows what `python -m vcpo.launch --memory-table` computes now, not an older model."""
    pytest.importorskip("verl")
    from vcpo.launch.__main__ import recipe_table

    assert block(PER_SEQUENCE, "projections") == recipe_table()


def test_the_docs_memory_terms_are_the_models():
    """The paragraphs under the projection table quote the memory model's constants, the changes the dry run names for
    SimpleTIR on Megatron (each projected again), and docs/verl.md MATH's Megatron step as the launcher projects it."""
    pytest.importorskip("verl")
    from vcpo import actor_memory
    from vcpo.launch import compose, make_run
    from vcpo.launch.memory import fitting, gpu_memory_gb, projection

    text = section(PER_SEQUENCE, "<!-- /projections -->", "## In the simulator's learner")
    assert_quoted(text, f"{actor_memory.CUDA_OVERHEAD_BYTES / 1e9:.0f} GB", f"{actor_memory.FRAGMENTATION_MARGIN:.0%}",
                  f"{actor_memory.LOCAL_ATTENTION_BACKWARD_BYTES} bytes a score", f"{actor_memory.LOCAL_ATTENTION_BUFFER_BYTES}-byte",
                  "2,048 MiB")
    simpletir = make_run("simpletir", "vcpo", strategy="megatron")
    capacity = gpu_memory_gb(simpletir.task.paper)
    config = compose(simpletir)
    assert projection(config, capacity).peak() > capacity * 1e9
    changes = [" ".join(change) for change, _ in fitting(config, capacity)]
    assert [("recompute_granularity=full" in changes[0]), ("optimizer_cpu_offload=true" in changes[1])] == [True, True]
    assert_quoted(text, f"{int(changes[2].split('=')[1])} trainer GPUs")
    math = make_run("math", "vcpo", strategy="megatron")
    assert_quoted(section("docs/verl.md", "The dry run prints what this costs", "The table of every recipe"),
                  f"MATH {projection(compose(math), gpu_memory_gb(math.task.paper)).peak() / 1e9:.1f} GB")


def test_the_docs_measurement_table_is_the_benchmarks():
    """The CPU table in the docs is the committed benchmark's, re-rendered from its rows, at every G for both models."""
    spec = importlib.util.spec_from_file_location("opob_memory", ROOT / "benchmarks/opob_memory.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    rows = json.loads((ROOT / "tables/opob_memory/results.json").read_text())["rows"]
    assert block(PER_SEQUENCE, "opob_memory") == benchmark.table(benchmark.with_extras(rows))
    assert {(row["model"], row["groups"]) for row in rows if row["kind"] == "single"} == {
        (model, g) for model in ("small", "50m") for g in (1, 2, 4, 8, 16, 32)}


def test_the_docs_bf16_memory_check_is_the_committed_check():
    """The largest deviation the docs quote for the two-rank bf16 check is tables/memory_model_check/results.json's,
    and every point of both engines, models and steps was measured."""
    record = json.loads((ROOT / "tables/memory_model_check/results.json").read_text())
    paragraph = section(PER_SEQUENCE, "**In bf16 over two ranks, both engines**", "**Projected per trainer GPU")
    assert f"over every point and rank is {record['largest_relative_error']:.3f}," in " ".join(paragraph.split())
    assert {(row["engine"], row["model"], row["kind"]) for row in record["rows"]} == {
        (engine, model, kind) for engine in ("fsdp2", "megatron") for model in ("small", "50m")
        for kind in ("plain", "two_pass", "single")}
    assert record["largest_relative_error"] <= 0.15  # what the paragraph says of it


def test_the_docs_numbers_on_the_memory_measurement_are_its_numbers():
    """The paragraph under the measured table quotes tables/opob_memory/results.json: the projections' deviations, the
    small model's constant gap, the extra of 32 buffers and two_pass's spread over the groups."""
    rows = json.loads((ROOT / "tables/opob_memory/results.json").read_text())["rows"]
    text = section(PER_SEQUENCE, "<!-- /opob_memory -->", "--memory-table")

    def deviation(kind, model):
        return max(abs(r["projected_bytes"] / r["measured_bytes"] - 1) for r in rows if r["kind"] == kind and r["model"] == model)

    def spread(model):
        values = [r["measured_bytes"] / r["copy_bytes"] for r in rows if r["model"] == model and r["kind"] == "two_pass"]
        return max(values) - min(values)

    kinds = ("plain", "single", "two_pass")
    assert_quoted(text, f"{max(deviation(k, m) for k in kinds for m in ('50m', 'small')):.1%}", "15%")
    assert max(deviation(k, m) for k in kinds for m in ("50m", "small")) <= 0.15  # the criterion
    assert_quoted(text, f"{max(deviation(k, '50m') for k in kinds):.1%}",
                  f"{max(deviation('plain', '50m'), deviation('two_pass', '50m')):.1%}", f"{deviation('single', '50m'):.1%}")
    large = [r for r in rows if r["model"] == "50m"]
    # plain and two_pass projected a little high, single low at 1 to 4 groups and high at 8 to 32
    assert all((r["projected_bytes"] > r["measured_bytes"]) == (r["kind"] != "single" or r["groups"] >= 8) for r in large)
    small = [r for r in rows if r["model"] == "small"]
    gap = {(r["kind"], r["groups"]): (r["measured_bytes"] - r["projected_bytes"]) / 1e6 for r in small}
    ratios = [r["projected_bytes"] / r["measured_bytes"] for r in small]
    outside = sum(abs(ratio - 1) > 0.15 for ratio in ratios)
    low = [value for value in gap.values() if value > 0]
    assert [point for point, value in gap.items() if value <= 0] == [("single", 32)]  # every projection but one low
    assert_quoted(text, f"{min(low):.0f}-{max(low):.0f} MB", f"{-gap['single', 32]:.0f} MB high", f"{min(ratios):.2f}",
                  f"{max(ratios):.2f}", str(outside), str(len(small)), "15%")
    single_32 = next(r for r in large if r["kind"] == "single" and r["groups"] == 32)
    plain_50m = next(r for r in large if r["kind"] == "plain")
    extra = (single_32["measured_bytes"] - plain_50m["measured_bytes"]) / single_32["copy_bytes"]
    projected_extra = (single_32["projected_bytes"] - plain_50m["projected_bytes"]) / single_32["copy_bytes"]
    assert_quoted(text, f"{extra:.2f}", f"{projected_extra:.2f}")
    assert_quoted(text, f"{spread('small'):.2f}", f"{spread('50m'):.3f}", f"{spread('small') / 31:.3f}", "0.1")
    assert spread("small") / 31 <= 0.1 and spread("50m") / 31 <= 0.1  # the aim: at most 0.1 C per group


def test_the_docs_small_model_gap_is_the_masked_attention_logs():
    """The paragraph on the small model's gap quotes its measurements: the masked CPU attention's excess per layer at
    896 tokens beside T² float32, the four layers' masks and what is left of the plain step's gap at three
    micro-batch sizes (opob_memory.py --micro, projected with the masks), and how far two measurements of one point
    differ."""
    text = section(PER_SEQUENCE, "The projection counts what attention keeps on CPU", "The extra over the plain step")
    layers = 4  # benchmarks/opob_memory.py's small model
    rows = {tokens: json.loads((ROOT / f"tables/opob_memory/small_plain_micro{micro}/results.json").read_text())["rows"][0]
            for micro, tokens in ((2, 448), (4, 896), (8, 1792))}
    for tokens, row in rows.items():
        assert row["tokens_per_micro_batch"] == tokens
        masks = layers * tokens**2 * 4
        assert row["projected_terms"]["masked attention (a T² float32 per layer)"] == masks
        assert_quoted(text, f"{masks / 1e6:.1f}", f"{(row['measured_bytes'] - row['projected_bytes']) / 1e6:.1f}")
    table = json.loads((ROOT / "tables/opob_memory/results.json").read_text())["rows"]
    same = next(r for r in table if r["model"] == "small" and r["kind"] == "plain")
    assert_quoted(text, f"{abs(same['measured_bytes'] - rows[896]['measured_bytes']) / same['copy_bytes']:.2f}")
    attention = (ROOT / "tables/opob_memory/masked_attention.log").read_text()
    excess = [float(m[1]) for m in re.finditer(r"^\s+896\s+\d+\s+\d+ \|.*\| +([\d.]+) +[\d.]+ \| +[\d.]+$", attention, re.MULTILINE)]
    assert len(excess) == 5
    assert_quoted(text, f"{min(excess):.2f}-{max(excess):.2f}", f"{896**2 * 4 / 1e6:.2f}")
    assert all(abs(value / (896**2 * 4 / 1e6) - 1) < 0.1 for value in excess)  # one T² float32 per layer, any heads


def test_the_docs_two_pass_floor_is_the_logs():
    """docs/per_sequence_gradients.md's costs of two_pass, its first pass and the input-gradient floor are the log's
    step/plain column, and the floor's arithmetic (1 + input_grads) and the norms' cost beyond it are quoted."""
    log = (ROOT / "tables/opob_engine/two_pass_floor_50m.log").read_text()
    ratio = {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)\s+[\d.]+\s+([\d.]+)\s+[\d.]+", log, re.MULTILINE)}
    text = section(PER_SEQUENCE, "two_pass_floor_50m.log", "opob_memory.py --out")
    assert_quoted(text, f"{ratio['opob']:.2f}", f"{ratio['two_pass']:.2f}", f"{ratio['norms_pass']:.2f}",
                  f"{ratio['input_grads']:.2f}", f"{1 + ratio['input_grads']:.2f}", f"{ratio['norms_pass'] - ratio['input_grads']:.2f}")
    # no first pass costs less than input_grads, and a second forward puts the mode out of the 1.5x aim's reach
    assert ratio["input_grads"] <= ratio["norms_pass"] and 1 + ratio["input_grads"] > 1.5
    assert_quoted(text, "1.5x")


def operator_counts(log_name: str) -> dict:
    """{(combination, block MiB or None): {"dispatched"|"computing": {variant: count}}} of an --count-ops log."""
    log = (ROOT / "tables/opob_engine" / log_name).read_text()
    counts = {}
    for command, body in re.findall(r"^# (python benchmarks/opob_overhead\.py.*)\n((?:[^#].*\n)+)", log, re.MULTILINE):
        block = re.search(r"--block-mb (\d+)", command)
        key = (re.search(r"--combination (\w+)", command)[1], int(block[1]) if block else None)
        counts[key] = {kind: {v: int(n) for v, n in re.findall(r"(\w+) (\d+) \(", line)}
                       for kind, line in re.findall(r"^ATen ops per step, (\w+).*?: (.*)$", body, re.MULTILINE)}
    return counts


def test_the_docs_operator_counts_are_the_logs():
    """docs/per_sequence_gradients.md's table of operators per step at the GPU check's shapes is the log's counts at
    both block sizes; the engine's step at CUDA's default blocks is within the 1.5x aim the text says it meets, and the
    blocks the text counts are the log's batched products."""
    counts = operator_counts("aten_ops_0.5b.log")
    table = section(PER_SEQUENCE, "| CUDA blocks | plain |", "\n\n")

    def cell(ops: dict, variant: str) -> str:
        kinds = ("dispatched", "computing")
        if variant == "plain":
            return " / ".join(f"{ops[kind]['plain']:,}" for kind in kinds)
        return " / ".join(f"{ops[kind][variant]:,} ({ops[kind][variant] / ops[kind]['plain']:.2f}×)" for kind in kinds)

    for label, ops in (("16 MiB (`--block-mb 16`): dispatched / computing", counts["split", 16]),
                       ("128 MiB, rows a multiple of 64 (CUDA's default): dispatched / computing", counts["split", None])):
        row = " | ".join([label, *(cell(ops, v) for v in ("plain", "opob", "two_pass"))])
        assert f"| {row} |" in table, row
    default = counts["split", None]
    assert all(default[kind]["opob"] <= 1.5 * default[kind]["plain"] for kind in ("dispatched", "computing"))
    log = (ROOT / "tables/opob_engine/aten_ops_0.5b.log").read_text()
    assert "blocks of 128 MiB, rows a multiple of 64" in log and "blocks of 16 MiB" in log
    from vcpo.core.per_sequence_grads.reductions import DEFAULT_BLOCK_BYTES, DEFAULT_BLOCK_ROW_MULTIPLE
    assert (DEFAULT_BLOCK_BYTES["cuda"], DEFAULT_BLOCK_ROW_MULTIPLE["cuda"]) == (128 << 20, 64)
    batched = [int(n) for n in re.findall(r"^  opob beyond plain: .*?bmm \+(\d+)", log, re.MULTILINE)]  # 128 MiB, 16 MiB
    text = section(PER_SEQUENCE, "the count follows the number of blocks", "L2 (50 MB)")
    assert_quoted(text, f"{batched[1] - 4:,}", f"bmm +{batched[1]}", f"{batched[0] - 4}", f"bmm +{batched[0]}")


def test_the_simulator_cost_table_quotes_its_measurement():
    """docs/per_sequence_gradients.md's simulator table is tables/opob_sim/update_cost.json's ratios, its profile
    paragraph tables/opob_sim/update_profile.json's operators."""
    measured = json.loads((ROOT / "tables/opob_sim/update_cost.json").read_text())
    ratios, shape = measured["ratio_to_seq_tis"], measured["padded_shape"]
    table = section(PER_SEQUENCE, "| variant | update |", "\n\n")
    for label, row in (("VCPO, deferred, routes chosen per call (as it runs)", "vcpo"), ("VCPO, deferred, ghost norms", "vcpo ghost"),
                       ("VCPO, deferred, per-sequence gradients materialised", "vcpo materialize"),
                       ("VCPO, two buffers (the studies' runs)", "vcpo buffers")):
        cells = " | ".join(f"{ratios[row][part]:.2f}" for part in ("timing_s/update", "timing_s/forward", "timing_s/backward"))
        assert f"| {label} | {cells} |" in table
    assert f"| seq-TIS (c = 8) | 1.00 ({measured['median_s']['seq_tis_c8']['timing_s/update'] * 1e3:.0f} ms) |" in table
    # the batches: sequences per micro-batch and the longest response
    assert_quoted(section(PER_SEQUENCE, "## In the simulator's learner", "recipes/sim/regime.yaml"),
                  str(shape[0][0]), str(max(s[1] for s in shape)))
    assert measured["settings"]["opob_combination"] == "deferred"
    profiled = json.loads((ROOT / "tables/opob_sim/update_profile.json").read_text())
    base, vcpo, total = profiled["self_ms"]["seq_tis_c8"], profiled["self_ms"]["vcpo"], profiled["total_ms"]
    text = section(PER_SEQUENCE, "update_profile.json", "## On a GPU")
    assert ratios["vcpo"]["timing_s/update"] > 1.10  # the 1.10x goal is not reached
    assert_quoted(text, "1.10x")
    assert_quoted(text, f"{total['seq_tis_c8']:.0f}", f"{total['vcpo']:.0f}", f"{total['vcpo'] / total['seq_tis_c8']:.2f}x")
    assert_quoted(text, *(f"{vcpo.get(op, 0.0) - base.get(op, 0.0):+.1f}"
                          for op in ("aten::bmm", "aten::addmm_", "aten::mul", "_OuterProductFunctionBackward", "aten::mm")))
    assert vcpo["aten::mm"] < base["aten::mm"]  # autograd's own weight gradients no longer run


# ---------------------------------------------------------------------------------------------
# The GPU check (tables/gpu_check/gpu_check.json)
# ---------------------------------------------------------------------------------------------


def test_the_documented_gpu_numbers_are_the_committed_gpu_check():
    """docs/per_sequence_gradients.md's GPU table and bullets and the README's status quote tables/gpu_check/gpu_check.json."""
    report = json.loads((ROOT / "tables/gpu_check/gpu_check.json").read_text())
    overhead = report["overhead"]
    step, memory = overhead["ratios"]["step_time_ratio"], overhead["ratios"]["memory_ratio"]
    doc = (ROOT / PER_SEQUENCE).read_text().split("## On a GPU")[1].split("\n## ")[0]
    names = {"plain": "plain backward", "opob": "single-backward OPOB", "naive": "naive two-backward",
             "per_sequence": "one trajectory per micro-batch"}  # fmt: skip
    for variant, name in names.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| {name}"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] == f"{overhead['step_s'][variant]:.3f}"
        assert cells[2] == f"{step[variant]:.2f}"
        assert cells[3] == f"{overhead['peak_bytes'][variant] / 2**30:.1f}"
        assert cells[4] == f"{memory[variant]:.2f}"
    opob = f"{step['opob']:.2f}×"
    # the CUDA target of 1.10x is missed, and OPOB is still faster than the other two ways to its update
    assert step["opob"] > 1.10 and step["opob"] < min(step["naive"], step["per_sequence"])
    assert_quoted(section(PER_SEQUENCE, "The CUDA target", "\n- "), "1.10×", opob, f"{step['naive']:.2f}×",
                  f"{step['per_sequence']:.2f}×", f"{memory['opob'] - 1:+.0%}")
    assert_quoted(section("README.md", "On a GPU only", "\n\n"), opob, "1.10×")
    assert_quoted(section(PER_SEQUENCE, "Exactness on the GPU", "\n- "), str(report["exactness"]["passed"]))
    assert report["exactness"]["failures"] == 0
    assert_quoted(section(PER_SEQUENCE, "The cost model's constant", "\n- "), f"{report['calibrate']['pass_cost']:.0f}")
    from vcpo.core.per_sequence_grads.reductions import DEFAULT_PASS_COST

    assert DEFAULT_PASS_COST["cuda"] == round(report["calibrate"]["pass_cost"])


# ---------------------------------------------------------------------------------------------
# docs/verl.md: the engine's step on CPU, its modes by groups, verl's asynchrony
# ---------------------------------------------------------------------------------------------


def test_the_engine_step_table_quotes_its_measurement():
    """docs/verl.md's engine table is tables/opob_engine/cpu_split.log (benchmarks/opob_engine.py's output, one run
    per configuration): the plain step's process CPU time and each variant's median process-CPU ratio."""
    blocks = (ROOT / "tables/opob_engine/cpu_split.log").read_text().split("== python benchmarks/opob_engine.py ")[1:]
    labels = {"--repeats 15": "small (4.2M), packed, verl's default (15)", "--padded --repeats 12": "small (4.2M), padded (12)",
              "--autocast bfloat16 --repeats 10": "small (4.2M), packed, `--autocast bfloat16` (10)",
              "--model 50m --batch 8 --repeats 8": "50M (46.5M, batch 8), packed (8)",
              "--model 50m --batch 8 --padded --repeats 6": "50M (46.5M, batch 8), padded (6)"}
    table = section("docs/verl.md", "| model, micro-batches (rounds)", "\n\n")
    ess, vcpo = [], []
    for block_ in blocks:
        arguments = block_.splitlines()[0]
        cpu = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"^  (\S+)\s+median.*process CPU\s+([\d.]+) ms  x([\d.]+)", block_, re.M)}
        ess.append(cpu["ess"][1])
        vcpo += [cpu["vcpo"][1], cpu["vcpo[buffers]"][1]]
        row = (f"| {labels[arguments.removesuffix(' --combinations buffers')]} | {cpu['plain'][0] / 1e3:.2f} s | {cpu['ess'][1]:.2f} | "
               f"{cpu['vcpo'][1]:.2f} | {cpu['vcpo[buffers]'][1]:.2f} |")
        assert row in table, row
        assert "vcpo combines with 'split'" in block_
    assert len(blocks) == len(labels)
    # the ESS column's range (the machine's noise) and the VCPO columns' range
    assert_quoted(section("docs/verl.md", "Medians over rounds", "\n\n"), f"{min(ess):.2f}", f"{max(ess):.2f}",
                  f"{min(vcpo):.2f}", f"{max(vcpo):.2f}")


def test_the_docs_mode_timings_are_the_logs():
    """docs/verl.md's table of the two modes by groups: each cell is its log's process CPU time of plain and its paired
    ratio (tables/opob_engine/modes_G*.log, benchmarks/opob_engine.py's output)."""
    table = section("docs/verl.md", "| G | plain step |", "\n\n")
    for groups in (1, 8, 32):
        log = (ROOT / f"tables/opob_engine/modes_G{groups}.log").read_text()
        assert f"batch=32 in {groups} groups" in log

        def paired(name, log=log):
            return float(re.search(rf"^  {re.escape(name)} +median .* paired x([0-9.]+)$", log, re.MULTILINE).group(1))

        plain_cpu = float(re.search(r"^  plain +median .* process CPU +([0-9.]+) ms", log, re.MULTILINE).group(1))
        row = f"| {groups} | {plain_cpu / 1000:.1f} s | {paired('vcpo'):.2f} | {paired('vcpo[two_pass]'):.2f} |"
        assert row in table, row
        assert paired("vcpo[two_pass]") > 1.5  # the docs say the 1.5x target is not met


def allocator_runs() -> tuple[dict, dict]:
    """tables/opob_engine/allocator.log (benchmarks/opob_engine.py's output): the paired single-against-plain ratio of
    every run by (G, freed memory kept), and the plain step's process CPU times by whether memory was kept."""
    from vcpo.resident_memory import CACHING_ENV

    kept_by_environment = " ".join(f"{key}={value}" for key, value in CACHING_ENV.items()) + " python "
    ratios, plain = {}, {}
    for block_ in (ROOT / "tables/opob_engine/allocator.log").read_text().split("\n== ")[1:]:
        command = block_.splitlines()[0]
        groups = 32 // int(re.search(r"--group (\d+)", command).group(1))
        kept = command.endswith("--allocator caching") or command.startswith(kept_by_environment)
        assert kept or command.endswith(("--allocator default", "--modes ''")), command
        assert f"batch=32 in {groups} groups" in block_
        ratios.setdefault((groups, kept), []).append(
            float(re.search(r"^  vcpo +median .* paired x([0-9.]+)$", block_, re.MULTILINE).group(1)))
        plain.setdefault(kept, []).append(float(re.search(r"^  plain +median .* process CPU +([0-9.]+) ms", block_, re.MULTILINE).group(1)))
    return ratios, plain


def test_the_docs_allocator_comparison_is_the_log():
    """docs/verl.md's single-against-plain ratios under glibc's default settings and with freed memory kept, each cell
    its runs in order; the plain step's time is the same under both settings."""
    ratios, plain = allocator_runs()
    table = section("docs/verl.md", "| G | glibc's default |", "\n\n")
    for groups in (1, 8, 32):
        cells = [", ".join(f"{ratio:.2f}" for ratio in ratios[groups, kept]) for kept in (False, True)]
        assert f"| {groups} | {cells[0]} | {cells[1]} |" in table, cells
    assert abs(statistics.median(plain[True]) / statistics.median(plain[False]) - 1) < 0.01
    text = section("docs/verl.md", "**Where single's time with groups goes", "## verl's own trainer")
    assert_quoted(text, f"{max(max(r) for (_, kept), r in ratios.items() if kept):.2f}")


def test_the_docs_time_and_memory_in_one_run_are_the_log():
    """docs/verl.md's one run under the measuring allocator settings: each variant's peak and paired ratio as
    tables/opob_engine/measuring_G8.log prints them; two_pass's peak is plain's, single's grows with its buffers."""
    log = (ROOT / "tables/opob_engine/measuring_G8.log").read_text()
    assert "batch=32 in 8 groups" in log and "glibc allocator settings: measuring" in log
    peaks = dict(re.findall(r"(\S+) ([\d.]+) C", log.split("in float32 copies of the model")[1].splitlines()[0]))
    paired = dict(re.findall(r"^  (\S+) +median .* paired x([0-9.]+)$", log, re.MULTILINE))
    text = section("docs/verl.md", "Time and peak memory in one run", "\n\n")
    assert_quoted(text, peaks["plain"], peaks["vcpo"], peaks["vcpo[two_pass]"], f"{float(paired['vcpo']):.2f}",
                  f"{float(paired['vcpo[two_pass]']):.2f}")
    assert float(peaks["vcpo[two_pass]"]) <= 1.1 * float(peaks["plain"]) < float(peaks["vcpo"])


def test_the_documented_verl_asynchrony_timings_are_the_committed_benchmark():
    """docs/verl.md's separate_async-against-sync numbers are tables/verl_async_speed/verl_async_speed.json's."""
    runs = {run["lag"]: run["timing_s_mean"] for run in json.loads((ROOT / "tables/verl_async_speed/verl_async_speed.json").read_text())["runs"]}
    text = section("docs/verl.md", "### verl's own asynchrony", "## Known verl")
    sync, lag1, lag2 = runs[0], runs[1], runs[2]
    assert_quoted(text, f"{sync['timing_s/step']:.3f}", f"{sync['timing_s/gen']:.3f}",
                  f"{lag1['timing_s/step']:.3f}", f"{lag2['timing_s/step']:.3f}",
                  f"{lag1['timing_s/step'] / sync['timing_s/step']:.2f}", f"{lag2['timing_s/step'] / sync['timing_s/step']:.2f}",
                  f"{lag1['timing_s/gen']:.3f}", f"{lag2['timing_s/gen']:.3f}",
                  f"{lag1['timing_s/update_actor']:.3f}", f"{lag2['timing_s/update_actor']:.3f}", f"{sync['timing_s/update_actor']:.3f}")
    # generation is most of sync's step; the overlap pays, more at lag 2; the update costs more than sync's
    assert sync["timing_s/gen"] > sync["timing_s/step"] / 2
    assert lag2["timing_s/step"] < lag1["timing_s/step"] < sync["timing_s/step"]
    assert min(lag1["timing_s/update_actor"], lag2["timing_s/update_actor"]) > sync["timing_s/update_actor"]


# ---------------------------------------------------------------------------------------------
# The real model (tables/real_model)
# ---------------------------------------------------------------------------------------------


REAL_MODEL_BENCHMARKS = {"gsm8k": "GSM8K", "math500": "MATH-500", "aime24": "AIME 2024", "aime25": "AIME 2025"}


def test_the_readmes_real_model_scores_are_the_committed_table():
    """The README's evaluation row quotes every benchmark of tables/real_model/base_eval.json (benchmarks/
    real_model_eval.py wrote it), each in its own stretch (from its name to the next benchmark's): mean@n under both
    formats with its interval, strict first, the subset size; docs/data_rewards_evaluation.md's table quotes the same."""
    rows = json.loads((ROOT / "tables" / "real_model" / "base_eval.json").read_text())["rows"]
    assert {"gsm8k", "math500", "aime24"} <= set(rows)
    for text, samples in ((section("README.md", "| `vcpo/evaluation/`", "\n"), "mean@{}"),
                          (section("docs/data_rewards_evaluation.md", "The table holds", "The subset rule"), "{}")):
        starts = sorted((text.index(REAL_MODEL_BENCHMARKS[name]), name) for name in rows)
        for (start, name), (end, _) in zip(starts, starts[1:] + [(len(text), None)], strict=True):
            row, part = rows[name], text[start:end]
            assert_quoted(part, samples.format(row["n"]), str(row["problems"]))
            for answer_format in ("strict", "lenient"):  # in this order: strict, then lenient after it
                score = row[answer_format]
                quote = f"{100 * score['mean_at_n']:.1f}% [{100 * score['low']:.1f}, {100 * score['high']:.1f}]"
                assert_quoted(part, quote)
                part = part[part.index(quote) + len(quote):]
                if score["mean_at_n"] == 0:  # zero successes: right after the cell, its Wilson upper bound over the problems
                    bound = f", Wilson ≤ {100 * zero_success_bound(row['problems']):.1f}%"
                    assert part.startswith(bound), (name, answer_format, part[:60])
                    part = part[len(bound):]
                else:
                    assert not part.lstrip(", ").startswith("Wilson"), (name, answer_format)


def zero_success_bound(problems: int) -> float:
    """The 95% Wilson interval's upper bound for none of ``problems`` solved: z^2 / (problems + z^2)."""
    z = 1.959963984540054
    return z * z / (problems + z * z)


def test_every_zero_success_cell_of_the_real_models_tables_carries_its_wilson_bound():
    """tables/real_model/task_choice.md and base_eval.md: a mean of zero (a bootstrap interval of zero width) stands
    with the Wilson upper bound over its problems (48: 7.4%, 65: 5.6%, 30: 11.4%), every other mean without one; each
    cell is its JSON row's, and each file is what its generator writes from that JSON now."""
    assert [f"{100 * zero_success_bound(n):.1f}" for n in (48, 65, 30)] == ["7.4", "5.6", "11.4"]
    assert zero_success_bound(48) == pytest.approx(wilson_interval(0, 48)[1])

    def cells(path: str) -> dict[tuple[str, str], list[str]]:
        lines = (ROOT / "tables" / "real_model" / path).read_text().splitlines()
        rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines if line.startswith("| ")]
        return {(row[0], row[1]): row for row in rows[1:]}

    def expected(mean: float, low: float, high: float, problems: int) -> str:
        cell = f"{100 * mean:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"
        return cell + (f", Wilson ≤ {100 * zero_success_bound(problems):.1f}%" if mean == 0 else "")

    choice = load_json("tables/real_model/task_choice.json")
    written = cells("task_choice.md")
    zeros = 0
    for number, round_ in enumerate(choice["rounds"], 1):
        for name, row in round_["rows"].items():
            cell = written[(f"{number} ({round_['answer_format']})", name)][3]
            assert cell == expected(row["mean_reward"], row["low"], row["high"], row["problems"]), (number, name, cell)
            zeros += row["mean_reward"] == 0
    assert zeros == 4
    evaluation = load_json("tables/real_model/base_eval.json")["rows"]
    written = {key[0]: row for key, row in cells("base_eval.md").items()}
    for name, row in evaluation.items():
        for column, answer_format in ((3, "strict"), (4, "lenient")):
            score = row[answer_format]
            assert written[name][column] == expected(score["mean_at_n"], score["low"], score["high"], row["problems"])

    def benchmark(name: str):
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    assert (ROOT / "tables/real_model/task_choice.md").read_text() == benchmark("real_model_task").choice_markdown(choice)
    assert (ROOT / "tables/real_model/base_eval.md").read_text() == benchmark("real_model_eval").table(evaluation)
    # the commands read the same whichever checkout renders them (they ran in another one, under root's home)
    ran_elsewhere = ("python -m vcpo.evaluation --model /home/ana/.cache/vcpo/models/m --benchmarks gsm8k "
                     "--out /srv/ckout/results/real_model/gsm8k --source-dir /data/shared --limit 65")
    assert benchmark("real_model_eval").portable(ran_elsewhere) == (
        "python -m vcpo.evaluation --model ~/.cache/vcpo/models/m --benchmarks gsm8k --out results/real_model/gsm8k "
        "--source-dir DIR --limit 65")


def test_the_docs_task_choice_is_the_committed_table():
    """docs/data_rewards_evaluation.md quotes tables/real_model/task_choice.json (the choice driver wrote it)."""
    choice = json.loads((ROOT / "tables" / "real_model" / "task_choice.json").read_text())
    text = section("docs/data_rewards_evaluation.md", "### A task whose training reward rises", "real_model_task.py train")
    strict, lenient = choice["rounds"]
    means = [row["mean_reward"] for row in strict["rows"].values()]
    assert strict["chosen"] is None  # round 1 (strict) chose none
    assert_quoted(text, f"{100 * min(means):.1f}", percent(max(means)))
    row = lenient["rows"][choice["chosen"]]
    assert choice["answer_format"] == "lenient"
    assert f"`{choice['chosen']}`" in text
    assert_quoted(text, quote(row["mean_reward"], row["low"], row["high"]))


def test_the_docs_real_model_paragraphs_quote_the_committed_tables():
    """docs/data_rewards_evaluation.md on the real model: the held-out greedy counts of each training arm, the share
    of AIME answers cut at the limit, MATH-500's minutes and the task choice's commits, each from its JSON."""
    trained = load_json("tables/real_model/training.json")
    arms, problems = trained["arms"], trained["plan"]["validation"]["problems"]
    training = section("docs/data_rewards_evaluation.md", "`python benchmarks/real_model_task.py train", "### The policy-lag")
    for name in ("sync_s0", "vcpo_s0"):
        first, last = arms[name]["validation"][0][1], arms[name]["validation"][-1][1]
        assert_quoted(training, f"{round(first * problems)}/{problems}", f"{round(last * problems)}/{problems}")
    rows = load_json("tables/real_model/base_eval.json")["rows"]
    evaluation = section("docs/data_rewards_evaluation.md", "A 135M model scores nothing", "The fetched tokenizer")
    assert_quoted(evaluation, span([100 * rows[name]["truncated"] for name in ("aime24", "aime25")], 0) + "%")
    origin = rows["math500"]["provenance"]
    minutes = (datetime.fromisoformat(origin["end"]) - datetime.fromisoformat(origin["start"])).total_seconds() / 60
    assert_quoted(section("docs/data_rewards_evaluation.md", "The subset rule underestimated", "###"), f"{minutes:.1f}")
    choice = load_json("tables/real_model/task_choice.json")
    origins = [row["provenance"] for round_ in choice["rounds"] for row in round_["rows"].values()]
    chosen = choice["rounds"][-1]["rows"][choice["chosen"]]["provenance"]
    assert chosen["dirty"]  # the chosen row among the dirty ones
    task = section("docs/data_rewards_evaluation.md", "### A task whose training reward rises", "`python benchmarks/real_model_task.py train")
    assert_quoted(task, f"{len(origins)} rows at {len({o['commit'] for o in origins})} commits",
                  f"{sum(o['dirty'] for o in origins)} of them")


def test_the_readmes_real_model_training_is_the_committed_table():
    """The README's status bullet quotes tables/real_model/training.json (benchmarks/real_model_task.py report)."""
    arms = json.loads((ROOT / "tables" / "real_model" / "training.json").read_text())["arms"]
    text = section("README.md", "**A real pretrained model**", "\n- **")
    for name in ("vcpo_s0", "sync_s0"):
        arm = arms[name]
        (first, first_low, first_high), (last, last_low, last_high) = arm["reward_first"], arm["reward_last"]
        validation = [value for _, value in arm["validation"]]
        assert arm["steps"] == arm["planned_steps"] == 30 and last_low > first_high  # it rose beyond the steps' spread
        assert_quoted(text, str(arm["steps"]), quote(first, first_low, first_high), quote(last, last_low, last_high),
                      percent(validation[0]), percent(validation[-1]))


def test_the_docs_table_of_tasks_is_the_one_the_recipes_render():
    from vcpo.reporting.hyperparams import tasks_table

    rendered = [line for line in tasks_table().splitlines() if line.startswith("|")]
    text = (ROOT / "docs" / "data_rewards_evaluation.md").read_text()
    documented = [line for line in text[text.index("## Tasks"):text.index("## Data")].splitlines() if line.startswith("|")]
    assert documented == rendered


REAL_MODEL_STEP_ROWS = (  # the docs table's rows: (metrics file, the lag of its run)
    ("metrics_lag12_one_trainer_thread.jsonl", 12),
    ("metrics_lag2_two_trainer_threads.jsonl", 2),
    ("metrics_lag2_single_opob.jsonl", 2),
    ("metrics_lag12_final.jsonl", 12),
)


def real_model_step_medians(name: str, lag: int) -> list[float]:
    """Step, update and weight-sync seconds: medians over the steps after the pipeline filled (step > lag + 1)."""
    import statistics

    rows = [json.loads(line) for line in (ROOT / "tables" / "real_model" / "step" / name).read_text().splitlines()]
    steady = [row["data"] for row in rows if row["step"] > lag + 1]
    return [statistics.median(data[key] for data in steady)
            for key in ("timing_s/step", "timing_s/update_actor", "timing_s/update_weights")]


def test_the_real_model_step_section_quotes_its_measurements():
    """docs/verl.md's real-model step: the generation and bfloat16 numbers and the distances are the final benchmark
    run's (its JSON), the table's medians are its runs' metrics, every run trained at min(step - 1, k), and the profile
    shares are the committed py-spy stacks'."""
    text = section("docs/verl.md", "### The real model's step on CPU", "## Known verl")
    step = ROOT / "tables" / "real_model" / "step"
    final = json.loads((step / "lag12_final.json").read_text())
    one, batched = final["generation"]["one at a time, float32"], final["generation"]["batched, float32"]
    bf16 = final["generation"]["batched, bfloat16"]
    bound = max(batched["bandwidth_bound_s"], batched["flop_bound_s"])
    assert_quoted(text, f"{one['seconds']:.1f}", f"{batched['seconds']:.1f}", f"{one['seconds'] / batched['seconds']:.1f}",
                  f"{batched['seconds'] / bound:.1f}", f"{bf16['seconds']:.1f}", f"{bf16['log_prob_error']['mean_abs']:.3f}",
                  f"{bf16['log_prob_error']['max_abs']:.2f}")
    for name, lag in REAL_MODEL_STEP_ROWS:
        assert_quoted(text, *(f"{value:.1f}" for value in real_model_step_medians(name, lag)))
        rows = [json.loads(line) for line in (step / name).read_text().splitlines()]
        for row in rows:
            staleness = (row["data"]["training/off_policy/trajectory_staleness/max"],
                         row["data"]["training/off_policy/trajectory_staleness/mean"])
            assert staleness == (min(row["step"] - 1, lag),) * 2, (name, row["step"], staleness)
    distances = final["distances"]
    assert_quoted(text, f"{distances['update_over_flop_bound']:.1f}", f"{distances['sixty_steps_min']:.0f}",
                  f"{final['run']['startup_s']:.0f}")
    samples, shares = 0, dict.fromkeys(("forward_backward_batch", "_OuterProductFunction", "sdpa_attention_forward"), 0)
    for line in (step / "profile_update_one_thread.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        stack, count = line.rsplit(" ", 1)
        samples += int(count)
        for frame in shares:
            shares[frame] += int(count) if frame in stack else 0
    assert_quoted(text, *(f"{100 * count / samples:.0f}%" for count in shares.values()))


def test_the_real_model_step_section_names_its_commits_cpu_and_the_task_it_timed():
    """docs/verl.md's real-model step names the commits and the CPU its runs' JSON records (every commit there, and no
    other), and says that it timed `sums` where the launcher trains the registered task: the two recipes share the
    batch and the length limits, and the prompt and response lengths it quotes are the final run's and the lag
    study's runs' at lr 1e-5."""
    import gzip

    text = section("docs/verl.md", "### The real model's step on CPU", "## Known verl")
    runs = [json.loads(path.read_text()) for path in sorted((ROOT / "tables" / "real_model" / "step").glob("lag*.json"))]
    commits = {run["provenance"]["commit"][:12] for run in runs}
    assert set(re.findall(r"`([0-9a-f]{12})`", text)) == commits
    final = json.loads((ROOT / "tables" / "real_model" / "step" / "lag12_final.json").read_text())
    assert f"`{final['provenance']['commit'][:12]}` (the final lag-12 run" in text
    (cpu,) = {run["provenance"]["cpu"] for run in runs}
    assert f"`{cpu}`" in text and all(run["provenance"]["dirty"] for run in runs) and "(`dirty`)" in text
    timed, registered = read_yaml(ROOT / "recipes" / "real_model.yaml"), read_yaml(ROOT / "recipes" / "real_model_launch.yaml")
    shared = ("prompts_per_step", "responses_per_prompt", "max_response_length", "max_prompt_length")
    assert [timed["training"][key] for key in shared] == [registered["training"][key] for key in shared]
    assert {run["task"] for run in runs} == {"sums"} and "task `sums` (`recipes/real_model.yaml`'s choice" in text
    assert f"not `{registered['task']}`" in text
    assert_quoted(text, f"temperature {timed['training']['temperature']}", f"temperature {registered['training']['temperature']}")
    study = []
    for path in sorted((ROOT / "tables" / "real_model_lag" / "metrics").glob("regime-*-lr1e-05-seed100.jsonl.gz")):
        with gzip.open(path, "rt") as lines:
            data = [json.loads(line)["data"] for line in lines]
        study.append({key: statistics.mean(row[key] for row in data if key in row)
                      for key in ("response_length/mean", "prompt_length/mean")})
    assert len(study) == 2
    prompts = sorted({f"{final['run']['prompt_tokens']:.0f}", *(f"{run['prompt_length/mean']:.0f}" for run in study)})
    responses = sorted(f"{run['response_length/mean']:.0f}" for run in study)
    assert f"as long ({' and '.join(prompts)} tokens)" in text
    assert f"{final['run']['response_tokens']:.0f} tokens on average in the final run here, {' and '.join(responses)} in" in text


def test_the_readme_and_the_docs_quote_the_lag_studys_task_choice():
    """The README's real-model bullet and the docs' section quote tables/real_model_lag/task_choice.json: the round that
    chose of how many were registered, the task, its temperature, its base mean and interval; the docs also the range
    of the means of the rounds that chose none."""
    choice = json.loads((ROOT / "tables" / "real_model_lag" / "task_choice.json").read_text())
    design = read_yaml(ROOT / "recipes" / "real_model_lag.yaml")
    row = choice["rounds"][-1]["rows"][choice["chosen"]]
    chosen = [f"`{choice['chosen']}`", f"temperature {choice['temperature']:g}",
              f"{100 * row['mean_reward']:.1f}% [{100 * row['low']:.1f}, {100 * row['high']:.1f}]"]
    readme = section("README.md", "**A real pretrained model**", "\n- **")
    assert f"round {len(choice['rounds'])} of {len(design['task_choice']['rounds'])}" in readme
    assert_quoted(readme, *chosen)
    docs = section("docs/data_rewards_evaluation.md", "### The policy-lag study on the real model")
    earlier = [r["mean_reward"] for round_ in choice["rounds"][:-1] for r in round_["rows"].values()]
    assert_quoted(docs, *chosen, f"{100 * min(earlier):.1f}-{100 * max(earlier):.1f}%")


def test_the_readme_says_how_the_lag_studys_rate_was_chosen_as_its_regime_file_does():
    """The README's sentence on the study's rate follows tables/real_model_lag/regime.json: the fallback (sync improved
    at no rate of the ladder) is said to be one exactly when the rule's record says so."""
    regime = json.loads((ROOT / "tables" / "real_model_lag" / "regime.json").read_text())
    readme = section("README.md", "**A real pretrained model**", "\n- **")
    fallback = regime["by"].startswith("fallback")
    assert fallback == (not any(rung["sync_improves"] for rung in regime["ladder"]))
    assert ("sync improved at no rate of its ladder, so it runs at the fallback rate" in readme) == fallback
