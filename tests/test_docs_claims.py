"""docs/claims.md: every number it quotes is the committed file's, computed here from that file."""

import json
import re
from pathlib import Path

from vcpo.studies.statistics import by_pair

ROOT = Path(__file__).resolve().parents[1]


def load(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def signed(value: float) -> str:
    return f"{100 * value:+.1f}".replace("-", "−")


def difference(c: dict) -> str:
    return f"{signed(c['mean'])} points [{signed(c['low'])}, {signed(c['high'])}], Holm p = {c['p_holm']:.3f}"


def claims() -> dict[int, str]:
    rows = {}
    for line in (ROOT / "docs/claims.md").read_text().splitlines():
        if match := re.match(r"\| (\d) \|", line):
            rows[int(match[1])] = line
    return rows


def test_every_quoted_number_is_its_files():
    from vcpo.studies.across_lags_report import common_rate_winners

    evidence = load("tables/evidence/stats.json")["tasks"]["countdown"]
    across = load("tables/across_lags/stats.json")
    arms, compared = evidence["arms"], by_pair(evidence["comparisons"])
    confirm = across["tir_confirm"]
    row = claims()
    assert set(row) == set(range(1, 9))

    seq_tis, sync, vcpo = arms["seq_tis"], arms["sync"], arms["vcpo"]
    tuned = [across["countdown"]["arms"][f"seq_tis_lr5e-5_k{lag}"] for lag in across["countdown"]["lags"]]
    assert (f"seq-TIS collapses in {seq_tis['collapses']} of {seq_tis['n']} runs and ends at {100 * seq_tis['end']:.1f}% "
            f"against sync's {100 * sync['end']:.1f}%") in row[1]
    assert sum(a["collapses"] for a in tuned) == 0 and f"collapses in none of {sum(a['n'] for a in tuned)} runs" in row[1]

    best = compared[("vcpo", "seq_tis")]
    assert f"VCPO − seq-TIS {difference(best)}, {best['sign_positive']} of {best['sign_n']} seeds above" in row[2]
    assert f"VCPO collapses in {vcpo['collapses']} of {vcpo['n']}" in row[2]
    confirmed = confirm["arms"]
    assert (f"seq-TIS collapses in {confirmed['seq_tis_lr5e-4_k8']['collapses']} of 10, VCPO in "
            f"{confirmed['vcpo_lr5e-4_k8']['collapses']} of 10") in row[2]

    against_sync = compared[("vcpo", "sync")]
    assert f"VCPO − sync {difference(against_sync)} (not detected after correction)" in row[3] and against_sync["p_holm"] >= 0.05
    assert all(e["verdict"] == "equivalence not shown" for e in across["countdown"]["equivalence"])
    below = confirm["comparisons"][1]
    assert f"VCPO − sync {signed(below['mean'])} points, {below['sign_positive']} of {below['sign_n']} seeds above" in row[3]
    assert below["sign_p"] >= 0.05

    ablation, step_size = compared[("vcpo", "tis_ess")], compared[("tis_ess", "seq_tis")]
    assert f"VCPO − the ESS step size alone {difference(ablation)}" in row[4] and ablation["p_holm"] >= 0.05
    assert f"the step size alone − seq-TIS {signed(step_size['mean'])} points" in row[4] and step_size["p_holm"] < 0.05

    assert all(len(winners) == 1 for winners in common_rate_winners(across["countdown"]["best_rates"]).values())
    assert f"(Holm p ≥ {min(c['p_holm'] for c in across['countdown']['tuned']):.3f}, exploratory)" in row[5]

    table1 = load("tables/tir/table1_smoke.json")["tasks"]
    ratio = {task: table1[task]["async"]["wall_hours"]["mean"] / table1[task]["sync"]["wall_hours"]["mean"] for task in table1}
    assert f"async VCPO takes {ratio['simpletir']:.2f} of sync's wall-clock" in row[6]
    assert f"Countdown at lag 48 {ratio['countdown']:.2f}x sync's" in row[6]
    times, spread = across["countdown"]["time_to_target"], across["countdown"]["time_ratio_range"]
    assert f"more than {min(t['ratio'] for t in times):.2f}x sync's (one timing seed; {spread['low']:.2f}-{spread['high']:.2f}" in row[6]

    log = (ROOT / "tables/opob_engine/two_pass_floor_50m.log").read_text()
    step = {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)\s+[\d.]+\s+([\d.]+)\s", log, re.MULTILINE)}
    gpu = load("tables/gpu_check/gpu_check.json")["overhead"]["ratios"]["step_time_ratio"]["opob"]
    assert f"{step['opob']:.2f}x a plain step at 46.5M" in row[7] and f"flat but {step['two_pass']:.2f}x" in row[7]
    assert f"on an H200 at 0.5B {gpu:.2f}x" in row[7]

    gsm8k = load("tables/real_model/base_eval.json")["rows"]["gsm8k"]
    assert f"scores {100 * gsm8k['strict']['mean_at_n']:.1f}% strict on GSM8K" in row[8]
