"""One verdict per claim of the paper, computed from the registered tests that bear on it (docs/claims.md states the
rule and quotes each claim's measurements; a test checks that every verdict it writes is the one computed here).

A claim's *parts* are registered tests in the pre-registered studies' statistics: a paired difference a - b (a t-test,
Holm-corrected within its registered family, beside its exact sign test) or an equivalence test (two one-sided tests
against the registered margin, Holm-corrected). The paper says of each part that a is higher than b, lower, or that
the two match. A part answers:

- ``AGREES``: it rejects in the paper's direction after Holm (p_holm < ALPHA), and, for a difference, its sign test
  agrees (p < ALPHA with most pairs on the same side; two-sided, or one-sided where the study registered that);
- ``OPPOSES``: it rejects in the opposite direction after Holm (a difference where the paper says the two match,
  or a difference against the paper's sign), or an equivalence test puts the effect inside the margin where the
  paper claims a difference;
- ``SILENT``: it rejects nothing (or rejects a difference its sign test does not confirm).

A difference test cannot show that two arms match, nor an equivalence test that one is higher: such a part only
counts when it opposes. The verdict over a claim's answering parts, first rule that applies:

    untested          no registered test, the premise did not arise, the registered runs are not all in, or the
                      evidence is one seed or one timing run
    not reproduced    some part OPPOSES
    reproduced        every part AGREES
    partly reproduced some part AGREES
    not detected      nothing rejects; the smallest difference the study could detect at Holm's first-step level
                      (ALPHA / family size) with 80% power is quoted beside it
"""

from __future__ import annotations

from dataclasses import dataclass

from vcpo.studies.across_lags_report import common_rate_winners
from vcpo.studies.readme_results import ACROSS_LAGS, EVIDENCE, REAL_MODEL_LAG, part_of
from vcpo.studies.statistics import ALPHA, detectable_difference, sign_agrees

AGREES, OPPOSES, SILENT = "agrees", "opposes", "silent"
HIGHER, LOWER, MATCH = "higher", "lower", "match"  # what the paper says of a against b
DIFFERENCE, EQUIVALENCE = "difference", "equivalence"
POWER = 0.8  # the power the smallest detectable difference of a "not detected" verdict is quoted at


def part_answer(result: dict, kind: str, paper: str, alpha: float = ALPHA, sign_p: str = "sign_p") -> str | None:
    """What one registered test says of the paper's statement about a - b (AGREES, OPPOSES or SILENT), or None where
    its kind cannot answer that statement (a difference test for a match, an equivalence test for a direction) and it
    does not oppose. ``sign_p``: the result's entry holding the registered sign test's p."""
    rejects = result["p_holm"] < alpha
    if kind == EQUIVALENCE:
        if paper == MATCH:
            return AGREES if rejects else SILENT
        return OPPOSES if rejects else None
    if not rejects:
        return SILENT if paper != MATCH else None
    direction = HIGHER if result["mean"] > 0 else LOWER
    if paper == MATCH or direction != paper:
        return OPPOSES
    return AGREES if sign_agrees(result, alpha, sign_p) else SILENT


def verdict(answers: list[str | None], untested_because: str | None = None) -> str:
    """The claim's verdict from its parts' answers (None: a part that cannot answer), by the rule above."""
    answering = [answer for answer in answers if answer is not None]
    if untested_because is not None or not answers:
        return "untested"
    if OPPOSES in answering:
        return "not reproduced"
    if answering and all(answer == AGREES for answer in answering):
        return "reproduced"
    if AGREES in answering:
        return "partly reproduced"
    return "not detected"


def holm_detectable(result: dict, family_size: int, power: float = POWER) -> float:
    """The smallest mean difference (a fraction) a difference test of ``result``'s n pairs and SD detects at Holm's
    first-step level, ALPHA / family_size, with probability ``power``."""
    return detectable_difference(result["sd"], result["n"], ALPHA / family_size, power)


@dataclass(frozen=True)
class Part:
    """Registered tests in one family of a study's statistics (``family``: the keys to its list): the one comparing
    ``pair`` (a, b), or every one of the family (a per-lag family), what the paper says of a against b, and the entry
    holding the sign test's p the study registered."""

    study: str
    family: tuple[str, ...]
    paper: str
    pair: tuple[str, str] | None = None
    kind: str = DIFFERENCE
    sign_p: str = "sign_p"

    def results(self, statistics: dict[str, dict]) -> tuple[list[dict], int]:
        """This part's test results and the size of the family Holm corrected them in."""
        family = part_of(statistics[self.study], self.family)
        chosen = [r for r in family if self.pair is None or (r["a"], r["b"]) == self.pair]
        if not chosen:
            raise KeyError(f"{self.study}: no test {self.pair} in {'/'.join(self.family)}")
        return chosen, len(family)


@dataclass(frozen=True)
class Claim:
    """A claim of the paper (docs/claims.md's row ``number``), its parts, and why it is untested where it is."""

    number: int
    parts: tuple[Part, ...] = ()
    untested_because: str | None = None
    premise: str | None = None  # the name of a check in PREMISES that must pass for the parts to bear on the claim


def rate_transfer_premise(statistics: dict[str, dict]) -> str | None:
    """Claim 5's premise: some method's best rate, among those tested at every lag, changes with the lag."""
    best_rates = statistics[ACROSS_LAGS]["countdown"]["best_rates"]
    return None if any(len(best) > 1 for best in common_rate_winners(best_rates).values()) else "the premise did not arise"


def real_model_runs_all_in(statistics: dict[str, dict]) -> str | None:
    """The real model's claims wait for the registered confirmation: every comparison paired over every seed."""
    study = statistics[REAL_MODEL_LAG]
    pairs = min((comparison["n"] for comparison in study["comparisons"]), default=0)
    registered = len(study["registered_seeds"])
    return None if pairs >= registered else f"the confirmation is under way ({pairs} of {registered} pairs)"


# each check returns None when it passes, else why the claim is untested
PREMISES = {"a best rate changes with the lag": rate_transfer_premise, "the real model's runs are all in": real_model_runs_all_in}
COUNTDOWN, LEARNING_RATE = ("tasks", "countdown", "comparisons"), ("tasks", "countdown", "learning_rate", "comparisons")
CLAIMS = (
    Claim(1, untested_because="no registered test compares a collapse rate with sync's"),
    Claim(2, (Part(EVIDENCE, COUNTDOWN, HIGHER, ("vcpo", "seq_tis")),
              Part(ACROSS_LAGS, ("countdown", "same_rate"), HIGHER),
              Part(ACROSS_LAGS, ("tir_confirm", "comparisons"), HIGHER, ("vcpo_lr5e-4_k8", "seq_tis_lr5e-4_k8")))),
    Claim(3, (Part(EVIDENCE, COUNTDOWN, MATCH, ("vcpo", "sync")),
              Part(EVIDENCE, ("tasks", "tir", "comparisons"), MATCH, ("vcpo", "sync")),
              Part(ACROSS_LAGS, ("countdown", "equivalence"), MATCH, kind=EQUIVALENCE),
              Part(ACROSS_LAGS, ("tir_confirm", "comparisons"), MATCH, ("vcpo_lr5e-4_k8", "sync_lr5e-4")))),
    Claim(4, (Part(EVIDENCE, COUNTDOWN, HIGHER, ("tis_ess", "seq_tis")),  # the step size alone lifts seq-TIS
              Part(EVIDENCE, COUNTDOWN, HIGHER, ("vcpo", "tis_opob")),  # ... and adds to OPOB
              Part(EVIDENCE, COUNTDOWN, HIGHER, ("vcpo", "tis_ess")),  # OPOB adds to the step size
              Part(EVIDENCE, COUNTDOWN, HIGHER, ("tis_opob", "seq_tis")),  # OPOB alone lifts seq-TIS
              Part(EVIDENCE, LEARNING_RATE, HIGHER, ("vcpo", "seq_tis_vcpo_mean_lr")),  # adaptive beats its mean rate
              Part(EVIDENCE, LEARNING_RATE, HIGHER, ("vcpo", "seq_tis_vcpo_replay")))),  # OPOB beyond VCPO's own steps
    Claim(5, (Part(ACROSS_LAGS, ("countdown", "primary"), HIGHER),), premise="a best rate changes with the lag"),
    Claim(6, untested_because="one timing run per task"),
    Claim(7, untested_because="no registered test, one timing run per setting"),
    Claim(8, untested_because="needs the paper's scale"),
    # the real model's lag study (recipes/real_model_lag.md): its three registered comparisons, one-sided sign tests
    *(Claim(number, (Part(REAL_MODEL_LAG, ("comparisons",), paper, pair, sign_p="sign_p_one_sided"),),
            premise="the real model's runs are all in")
      for number, pair, paper in ((9, ("sync", "seq_tis"), HIGHER), (10, ("vcpo", "seq_tis"), HIGHER),
                                  (11, ("vcpo", "sync"), MATCH))),
)


def claim_answers(claim: Claim, statistics: dict[str, dict]) -> list[tuple[dict, int, str | None]]:
    """Each test of the claim's parts with its family's size and its answer."""
    found = []
    for part in claim.parts:
        results, family_size = part.results(statistics)
        found += [(result, family_size, part_answer(result, part.kind, part.paper, sign_p=part.sign_p)) for result in results]
    return found


def untested_reason(claim: Claim, statistics: dict[str, dict]) -> str | None:
    if claim.untested_because is not None:
        return claim.untested_because
    return PREMISES[claim.premise](statistics) if claim.premise is not None else None


def claim_verdict(claim: Claim, statistics: dict[str, dict]) -> str:
    """The verdict cell of docs/claims.md: the rule's word, with why it is untested, or, where nothing was detected,
    the smallest difference the study could have detected (points, Holm's first step, 80% power)."""
    reason = untested_reason(claim, statistics)
    answered = claim_answers(claim, statistics) if reason is None else []
    word = verdict([answer for _, _, answer in answered], reason)
    if word == "untested":
        return f"untested: {reason}"
    if word == "not detected":
        sizes = [holm_detectable(result, size) for result, size, answer in answered if answer is not None and "sd" in result]
        return f"not detected: {100 * min(sizes):.1f} points detectable" if sizes else word
    return word


def claim_verdicts(statistics: dict[str, dict]) -> dict[int, str]:
    """docs/claims.md's verdict cell of every claim, from the studies' committed statistics."""
    return {claim.number: claim_verdict(claim, statistics) for claim in CLAIMS}
