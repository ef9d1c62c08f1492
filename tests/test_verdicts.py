"""vcpo.studies.verdicts: what one registered test answers, and the verdict over a claim's answers, on hand-made cases."""

from __future__ import annotations

import pytest

from vcpo.studies.statistics import sign_agrees
from vcpo.studies.verdicts import (
    AGREES,
    EQUIVALENCE,
    HIGHER,
    LOWER,
    MATCH,
    OPPOSES,
    SILENT,
    Claim,
    Part,
    claim_verdict,
    holm_detectable,
    part_answer,
    verdict,
)


def difference(mean: float, p_holm: float, above: int, sign_p: float, n: int = 10, sd: float = 0.05, pair=("x", "y")) -> dict:
    return {"a": pair[0], "b": pair[1], "mean": mean, "p_holm": p_holm, "sign_positive": above, "sign_n": n, "sign_p": sign_p, "n": n, "sd": sd}


# 9 of 10 above: two-sided binomial p = 22/1024; 8 of 10: 112/1024
CONFIRMED, UNCONFIRMED = (9, 22 / 1024), (8, 112 / 1024)


@pytest.mark.parametrize(("result", "paper", "answer"), [
    (difference(+0.10, 0.01, *CONFIRMED), HIGHER, AGREES),  # rejects on the paper's side, the sign test agrees
    (difference(+0.10, 0.01, *UNCONFIRMED), HIGHER, SILENT),  # the sign test does not confirm it
    (difference(+0.10, 0.20, *CONFIRMED), HIGHER, SILENT),  # no rejection after Holm
    (difference(-0.10, 0.01, 1, 22 / 1024), HIGHER, OPPOSES),  # rejects on the other side
    (difference(-0.10, 0.01, 1, 22 / 1024), LOWER, AGREES),
    (difference(-0.10, 0.01, 2, 112 / 1024), MATCH, OPPOSES),  # a difference where the paper says they match
    (difference(-0.02, 0.07, 2, 112 / 1024), MATCH, None),  # a difference test cannot show a match
])
def test_a_difference_tests_answer(result, paper, answer):
    assert part_answer(result, "difference", paper) == answer


@pytest.mark.parametrize(("p_holm", "paper", "answer"), [
    (0.01, MATCH, AGREES), (0.30, MATCH, SILENT),  # equivalence shown, or not
    (0.01, HIGHER, OPPOSES),  # inside the margin where the paper claims a difference
    (0.30, HIGHER, None),  # an equivalence test cannot show a difference
])
def test_an_equivalence_tests_answer(p_holm, paper, answer):
    assert part_answer({"mean": -0.02, "p_holm": p_holm}, EQUIVALENCE, paper) == answer


def test_the_sign_test_agrees_only_on_the_means_side():
    assert sign_agrees(difference(-0.10, 0.01, 1, 22 / 1024))
    assert not sign_agrees(difference(-0.10, 0.01, 9, 22 / 1024))  # most pairs above, the mean below
    assert not sign_agrees(difference(+0.10, 0.01, *UNCONFIRMED))


@pytest.mark.parametrize(("answers", "because", "word"), [
    ([], None, "untested"),  # no registered test
    ([AGREES, AGREES], "one timing run", "untested"),
    ([AGREES, OPPOSES], None, "not reproduced"),
    ([AGREES, AGREES, None], None, "reproduced"),  # a part that cannot answer does not count
    ([AGREES, SILENT], None, "partly reproduced"),
    ([SILENT, None], None, "not detected"),
    ([None, None], None, "not detected"),
])
def test_the_verdict_rule(answers, because, word):
    assert verdict(answers, because) == word


def test_the_detectable_difference_at_holms_first_step():
    """Large n: the t-test's power approaches the normal one, d = (z_{1 - alpha / 2} + z_power) sd / sqrt(n); a family
    of 5 at alpha 0.05 tests its first step at 0.01: (2.5758 + 0.8416) / 100 = 0.034174."""
    assert holm_detectable({"sd": 1.0, "n": 10_000}, family_size=5) == pytest.approx(0.034174, rel=1e-3)


def test_a_claims_cell_names_why_it_is_untested_and_what_could_have_been_detected():
    statistics = {"study": {"family": [difference(+0.01, 0.9, 5, 1.0, sd=1.0, n=10_000),
                                       difference(+0.2, 0.001, *CONFIRMED, pair=("u", "v"))]}}
    silent = Claim(9, (Part("study", ("family",), HIGHER, ("x", "y")),))
    # a family of 2: its first step at 0.025, (2.2414 + 0.8416) / 100 = 0.0308
    assert claim_verdict(silent, statistics) == "not detected: 3.1 points detectable"
    both = Claim(10, (Part("study", ("family",), HIGHER),))
    assert claim_verdict(both, statistics) == "partly reproduced"
    assert claim_verdict(Claim(11, both.parts, untested_because="one seed"), statistics) == "untested: one seed"


def test_a_one_sided_sign_test_agrees_where_the_study_registered_it():
    """7 of 8 pairs above: two-sided binomial p = 18/256 does not confirm; the one-sided 9/256 a study registered does."""
    result = {**difference(+0.10, 0.01, 7, 18 / 256, n=8), "sign_p_one_sided": 9 / 256}
    assert part_answer(result, "difference", HIGHER) == SILENT
    assert part_answer(result, "difference", HIGHER, sign_p="sign_p_one_sided") == AGREES


def test_the_real_models_claims_wait_for_every_registered_pair():
    """Claims 9-11 (the real model's lag study) are untested until each comparison pairs all the registered seeds,
    and the cell counts the pairs; then the rule reads the comparisons with their one-sided sign tests."""
    from vcpo.studies.readme_results import REAL_MODEL_LAG
    from vcpo.studies.verdicts import CLAIMS

    def study(pairs: int, above: int, p_holm: float) -> dict:
        comparisons = [{**difference(+0.1, p_holm, above, 1.0, n=pairs, pair=pair), "sign_p_one_sided": 9 / 256}
                       for pair in (("vcpo", "seq_tis"), ("vcpo", "sync"), ("sync", "seq_tis"))]
        return {REAL_MODEL_LAG: {"comparisons": comparisons, "registered_seeds": list(range(8))}}

    claims = {claim.number: claim for claim in CLAIMS}
    assert claim_verdict(claims[10], study(5, 5, 0.01)) == "untested: the confirmation is under way (5 of 8 pairs)"
    assert claim_verdict(claims[10], study(8, 7, 0.01)) == "reproduced"
    assert claim_verdict(claims[9], study(8, 7, 0.01)) == "reproduced"
    assert claim_verdict(claims[11], study(8, 7, 0.01)) == "not reproduced"  # a difference where the paper says they match
    assert claim_verdict(claims[11], study(8, 7, 0.2)) == "not detected"

