"""ESS identities (VCPO §2.2) and the step-size rule (Eq. 5)."""

import math

import pytest
import torch

from vcpo.core.ess import ess_ratio, ess_step_scale, log_effective_sample_size


def direct_ess(weights):
    return sum(weights) ** 2 / sum(w * w for w in weights)


def test_equal_weights_give_ess_equal_to_batch_size():
    for s in (0.0, -300.0, 250.0):
        assert math.exp(log_effective_sample_size(torch.full((7,), s))) == pytest.approx(7.0, rel=1e-12)
        assert ess_ratio(torch.full((7,), s)).item() == pytest.approx(1.0, rel=1e-12)


def test_one_dominant_weight_gives_ess_one():
    s = torch.tensor([500.0, 0.0, -3.0, 2.0])
    assert math.exp(log_effective_sample_size(s)) == pytest.approx(1.0, rel=1e-12)
    s = torch.tensor([30.0, 0.0, 0.0, 0.0])  # e^30 against 1s: ESS = 1 + O(e^-30)
    assert math.exp(log_effective_sample_size(s)) == pytest.approx(1.0, abs=1e-9)


def test_matches_direct_formula():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(20, generator=g, dtype=torch.float64) * 2
    expected = direct_ess([math.exp(v) for v in s.tolist()])
    assert math.exp(log_effective_sample_size(s)) == pytest.approx(expected, rel=1e-12)
    valid = torch.arange(20) % 3 != 0
    expected_valid = direct_ess([math.exp(v) for v, k in zip(s.tolist(), valid.tolist(), strict=True) if k])
    assert ess_ratio(s, valid).item() == pytest.approx(expected_valid / int(valid.sum()), rel=1e-12)


def test_extreme_log_weights_stay_finite():
    s = torch.tensor([1e4, -1e4, 9999.0, 3.0], dtype=torch.float32)
    value = ess_ratio(s)
    assert torch.isfinite(value) and 0.25 <= value.item() <= 1.0
    assert ess_ratio(s, torch.zeros(4, dtype=torch.bool)).item() == 0.0


@pytest.mark.parametrize(
    "ratio,rho_on,rule,clamp,expected",
    [
        (0.25, 1.0, "sqrt", True, 0.5),
        (0.25, 1.0, "linear", True, 0.25),
        (0.8, 0.55, "sqrt", True, 1.0),
        (0.8, 0.55, "sqrt", False, math.sqrt(0.8 / 0.55)),
        (0.11, 0.55, "linear", False, 0.2),
        (0.0, 1.0, "sqrt", True, 0.0),
    ],
)
def test_step_scale(ratio, rho_on, rule, clamp, expected):
    assert ess_step_scale(ratio, rho_on, rule, clamp) == pytest.approx(expected, rel=1e-12)


def test_step_scale_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rule"):
        ess_step_scale(0.5, rule="cubic")
    with pytest.raises(ValueError, match="rho_on"):
        ess_step_scale(0.5, rho_on=0.0)
    with pytest.raises(ValueError, match="ess_ratio"):
        ess_step_scale(float("nan"))


def _ess_rank(rank: int, world: int, store_file: str, results) -> None:
    """One of four gloo ranks: data-parallel rank = rank % 2, pipeline stage = rank // 2 (the second stage is last)."""
    import torch.distributed as dist

    from vcpo.core import ess_ratio_over_ranks

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    stage, dp_rank = rank // 2, rank % 2
    if stage == 1:  # the last stage holds the log-probs: 3 and 5 sequences, some not valid
        s, valid = LAST_STAGE_WEIGHTS[dp_rank]
    else:  # an earlier stage's values are never read
        s, valid = torch.full((2,), float("nan"), dtype=torch.float64), torch.ones(2, dtype=torch.bool)
    results.put((rank, ess_ratio_over_ranks(s, valid, dp_group=dp_groups[stage], pp_group=pp_groups[dp_rank])))
    dist.destroy_process_group()


LAST_STAGE_WEIGHTS = [
    (torch.tensor([0.3, -40.0, 2.5], dtype=torch.float64), torch.tensor([True, True, False])),
    (torch.tensor([150.0, 149.0, -3.0, 0.0, 7.5], dtype=torch.float64), torch.tensor([True, True, True, False, True])),
]


def test_the_ess_of_a_mini_batch_over_data_parallel_ranks_and_pipeline_stages(tmp_path):
    """Four gloo ranks (DP 2 x PP 2): every rank gets ρ_ess of the last stage's sequences of both data-parallel ranks."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # a fresh process: the test's may hold a process group already
    results = context.Queue()
    ranks = [context.Process(target=_ess_rank, args=(rank, 4, str(tmp_path / "store"), results)) for rank in range(4)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    assert [process.exitcode for process in ranks] == [0, 0, 0, 0]
    found = dict(results.get(timeout=10) for _ in range(4))
    expected = float(ess_ratio(torch.cat([s for s, _ in LAST_STAGE_WEIGHTS]), torch.cat([v for _, v in LAST_STAGE_WEIGHTS])))
    assert 0.1 < expected < 0.9  # two weights near e^150 dominate: neither 1 nor 1/B
    assert found == {rank: expected for rank in range(4)}
