"""The simulator's rollouts and update: lag semantics, behaviour log-probs, OPOB, multi-turn tool tokens."""

import copy
import math

import pytest
import torch
from scripted import ScriptedModel

from vcpo.core import opob_baseline
from vcpo.local_models import build_random_model, build_tokenizer
from vcpo.methods import get_method
from vcpo.sim.config import SimConfig
from vcpo.sim.learner import Learner, collate, response_log_probs
from vcpo.sim.rollout import TOOL_TOKEN, Rollouts, RolloutSampler, Sampling, ToolResult

GROUPS, GROUP_SIZE = 3, 4
END = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def prompts(tokenizer, count=40):
    return [
        tokenizer.encode(f"<|im_start|>user\nWhat is {i} + {i % 7}?<|im_end|>\n<|im_start|>assistant\n")
        for i in range(count)
    ]


class Run:
    """Rollouts and a learner over a float64 tiny model, keeping every version's weights."""

    def __init__(self, tokenizer, method="seq_tis_c8", lag_model="pipeline", lag=3, max_tokens=6, update_tokens=3):
        torch.manual_seed(0)
        self.model = build_random_model(tokenizer, hidden_size=32, num_layers=2).double().train()
        self.config = SimConfig(
            method=method, lag=lag, lag_model=lag_model, prompts_per_step=GROUPS,
            responses_per_prompt=GROUP_SIZE, micro_batch_size=2 * GROUP_SIZE, reference_lr=3e-3,
        )
        self.learner = Learner(self.model, get_method(method), self.config)
        sampling = Sampling(max_response_tokens=max_tokens, temperature=1.0, eos_token_ids=(0, 2), pad_token_id=0)
        self.versions = {}
        self.step = 0
        self.rollouts = Rollouts(
            lag_model=lag_model, lag=lag, prompts_per_step=GROUPS, responses_per_prompt=GROUP_SIZE,
            update_tokens=update_tokens, seed=1, prompts=prompts(tokenizer).__getitem__, num_problems=40, generator=RolloutSampler(tokenizer, sampling),
            model=copy.deepcopy(self.model).eval(), weights=lambda version: self.versions[version],
        )

    def batch(self):
        self.versions[self.step] = copy.deepcopy(self.model.state_dict())
        trajectories = self.rollouts.batch(self.step)
        rewards = [float((t.problem + i) % 3 == 0) for i, t in enumerate(trajectories)]
        return trajectories, collate(trajectories, rewards, pad_token_id=0, dtype=torch.float64)

    def update(self, batch):
        metrics = self.learner.update(batch, 1.0)
        self.step += 1
        return metrics


def version_log_probs(model, weights, batch):
    model = copy.deepcopy(model).eval()
    model.load_state_dict(weights)
    with torch.no_grad():
        return response_log_probs(model, batch, 1.0)


@pytest.mark.parametrize("lag_model", ["pipeline", "pipeline_overlap", "fixed", "minibatch"])
def test_behaviour_log_prob_is_that_of_the_generating_version(tokenizer, lag_model):
    run = Run(tokenizer, lag_model=lag_model)
    seen_lags, inflight, group_lags, newest_lags = set(), 0, [], []
    for _ in range(7):
        trajectories, batch = run.batch()
        generated = batch.versions >= 0
        for version in batch.versions[generated].unique().tolist():
            at = batch.versions == version
            expected = version_log_probs(run.model, run.versions[version], batch)
            assert torch.allclose(batch.behav_log_prob[at], expected[at], atol=1e-6, rtol=0)
        lags = run.step - batch.versions[generated]
        assert int(lags.max()) <= 3 and int(lags.min()) >= 0
        seen_lags |= set(lags.tolist())
        newest_lags.append(int(lags.min()))
        inflight += sum(len(set(t.versions)) > 1 for t in trajectories)
        group_lags.append({run.step - t.versions[0] for t in trajectories})
        run.update(batch)
    assert seen_lags == {0, 1, 2, 3}
    if lag_model.startswith("pipeline"):
        assert inflight > 0, "no response spans two policy versions: in-flight updates are not simulated"
        assert any(len(lags) > 1 for lags in group_lags), "groups of one batch never have mixed staleness"
    else:
        assert inflight == 0
    if lag_model in ("pipeline_overlap", "fixed"):  # the overlapping models: no token of batch n >= 1 from θ_n
        assert newest_lags[0] == 0 and min(newest_lags[1:]) >= 1
    else:  # θ_n generates some of batch n: it cannot be generated while θ_n is being computed
        assert 0 in newest_lags[1:]
    if lag_model == "fixed":
        assert [min(lags) for lags in group_lags] == [0, 1, 2, 3, 3, 3, 3]
    if lag_model == "minibatch":
        assert [min(lags) for lags in group_lags] == [0, 1, 2, 3, 0, 1, 2]


@pytest.mark.parametrize("lag_model, admitted", [("pipeline", 3 * GROUPS + 2), ("pipeline_overlap", 2 * GROUPS + 2)])
def test_the_server_holds_k_and_a_half_batches_or_one_fewer_when_it_overlaps(tokenizer, lag_model, admitted):
    """At k = 3 with 3 groups a step: `pipeline` keeps 3.5 batches admitted and unconsumed (rounded up), the
    overlapping server, whose groups wait one step less for the learner, 2.5."""
    run = Run(tokenizer, lag_model=lag_model)
    for step in range(5):
        _, batch = run.batch()
        # (the overlapping server's batch 0 is generated whole before the learner starts)
        assert len(run.rollouts.held) + GROUPS == (admitted if step or lag_model == "pipeline" else GROUPS)
        run.update(batch)


@pytest.mark.parametrize("lag_model", ["pipeline", "pipeline_overlap", "fixed", "minibatch"])
def test_lag_zero_is_on_policy(tokenizer, lag_model):
    run = Run(tokenizer, lag_model=lag_model, lag=0)
    for _ in range(3):
        _, batch = run.batch()
        assert set(batch.versions[batch.versions >= 0].tolist()) == {run.step}
        metrics = run.update(batch)
        assert metrics["rollout_corr/seq_ess_ratio"] == pytest.approx(1.0, abs=1e-6)
        assert abs(metrics["rollout_corr/kl"]) < 1e-6
        assert metrics["actor/is_weight_max"] == pytest.approx(1.0, abs=1e-6)


def test_lagged_batches_are_off_policy(tokenizer):
    run = Run(tokenizer, lag_model="fixed", lag=3)
    for _ in range(5):
        _, batch = run.batch()
        metrics = run.update(batch)
    assert metrics["rollout_corr/seq_ess_ratio"] < 0.999


def per_sequence_sq_norms(model, batch):
    """Reference: ||∇ mean_t l^θ_i||² by one backward per sequence (float64)."""
    norms = []
    for row in range(batch.size):
        model.zero_grad()
        one = batch.rows(row, row + 1)
        log_prob = response_log_probs(model, one, 1.0)
        (log_prob.sum() / one.mask.sum()).backward()
        norms.append(sum(float((p.grad**2).sum()) for p in model.parameters() if p.grad is not None))
    model.zero_grad()
    return torch.tensor(norms, dtype=torch.float64)


def test_opob_update_equals_the_registry_loss_gradient(tokenizer):
    """VCPO in one backward = autograd of seq-TIS with A_i = (R_i − b*_g)/σ_g, b* from exact norms (Eq. 7)."""
    run = Run(tokenizer, method="vcpo", lag_model="fixed", lag=2)
    for _ in range(3):
        _, batch = run.batch()
        run.update(batch)
    _, batch = run.batch()
    model, learner = run.model, run.learner
    learner.actor_config.global_batch_info.update(dp_size=1, batch_num_tokens=int(batch.mask.sum()), global_batch_size=batch.size)
    learner._opob_backward(batch, batch.rewards.double(), {})
    learner_grad = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    sq_norms = per_sequence_sq_norms(model, batch)
    log_prob = response_log_probs(model, batch, 1.0)
    s = ((log_prob.detach() - batch.behav_log_prob) * batch.mask).sum(-1)
    baseline = opob_baseline(batch.rewards.double(), sq_norms, s, batch.groups)
    rewards = batch.rewards.double()
    std = torch.stack([rewards[batch.groups == g].std(unbiased=False) for g in batch.groups])
    std = torch.where(std > 1e-6, std, 1.0)
    advantages = ((rewards - baseline) / std).unsqueeze(-1) * batch.mask
    loss, _ = learner._call_loss(batch, log_prob, advantages, None)
    loss.backward()
    # verl's seq-mean-token-mean divides by T_i + 1e-8, the learner by T_i: agreement to ~1e-8 relative.
    for learner, reference in zip(learner_grad, [p.grad for p in model.parameters()], strict=True):
        assert torch.allclose(learner, reference, rtol=1e-6, atol=1e-7 * float(reference.abs().max()))
    assert any(float(g.abs().max()) > 0 for g in learner_grad)


def test_multi_turn_tool_tokens_are_masked_and_rewarded(tokenizer):
    from vcpo.rewards import score_batch

    turns = ["Let me compute. <code>print(6*7)</code>", " so #### 42<|im_end|>"]
    calls = []

    def tool(code):
        calls.append(code)
        return ToolResult("42\n")

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampling = Sampling(max_response_tokens=128, temperature=1.0, eos_token_ids=(im_end,), pad_token_id=0, max_turns=2)
    rollouts = Rollouts(
        lag_model="fixed", lag=0, prompts_per_step=1, responses_per_prompt=2, update_tokens=4, seed=0,
        prompts=prompts(tokenizer, 2).__getitem__, num_problems=2, generator=RolloutSampler(tokenizer, sampling, tool),
        model=ScriptedModel(tokenizer, turns), weights=lambda version: {},
    )
    trajectories = rollouts.batch(0)
    assert calls == ["print(6*7)"]  # the two responses wrote the same program in the same round: it ran once
    for t in trajectories:
        assert tokenizer.decode(t.response_ids, skip_special_tokens=True) == (
            "Let me compute. <code>print(6*7)</code><output>42\n</output> so #### 42"
        )
        tool_ids = [token for token, version in zip(t.response_ids, t.versions, strict=True) if version == TOOL_TOKEN]
        policy_ids = [token for token, version in zip(t.response_ids, t.versions, strict=True) if version != TOOL_TOKEN]
        assert tokenizer.decode(tool_ids) == "<output>42\n</output>"
        assert tokenizer.decode(policy_ids, skip_special_tokens=True) + "<|im_end|>" == "".join(turns)
        assert policy_ids[-1] == im_end
        assert all(lp == 0.0 for lp, version in zip(t.behav_log_probs, t.versions, strict=True) if version == TOOL_TOKEN)
        assert t.tool_calls == 1 and t.finished and not t.truncated
    batch = collate(trajectories, [1.0, 1.0], pad_token_id=0)
    assert int(batch.mask.sum()) == sum(len(t.response_ids) for t in trajectories) - 2 * len(tool_ids)
    texts = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajectories]
    assert [r["score"] for r in score_batch(["gsm8k"] * 2, texts, ["42", "42"])] == [1.0, 1.0]


def test_tool_calls_beyond_the_budget_end_the_episode(tokenizer):
    turns = ["<code>print(1)</code>", "<code>print(2)</code>", "#### 2<|im_end|>"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampling = Sampling(max_response_tokens=128, temperature=1.0, eos_token_ids=(im_end,), pad_token_id=0, max_turns=1)
    rollouts = Rollouts(
        lag_model="fixed", lag=0, prompts_per_step=1, responses_per_prompt=2, update_tokens=4, seed=0,
        prompts=prompts(tokenizer, 2).__getitem__, num_problems=2, generator=RolloutSampler(tokenizer, sampling, lambda code: ToolResult("1\n")),
        model=ScriptedModel(tokenizer, turns), weights=lambda version: {},
    )
    for t in rollouts.batch(0):
        assert t.tool_calls == 1 and t.finished
        assert tokenizer.decode(t.response_ids, skip_special_tokens=True) == "<code>print(1)</code><output>1\n</output><code>print(2)</code>"


def test_the_multi_turn_tool_runs_code_in_the_sandbox():
    from vcpo.sim.rollout import sandbox_tool

    run = sandbox_tool(timeout_s=10.0)
    assert run("print(6 * 7)").text == "42\n" and not run("print(6 * 7)").error
    failed = run("1 / 0")
    assert failed.text == "ZeroDivisionError: division by zero" and failed.error


def _trajectories(tokenizer, count=6):
    from vcpo.sim.rollout import Trajectory

    return [Trajectory(group=i, problem=i, prompt_ids=ids, admitted_at=0) for i, ids in enumerate(prompts(tokenizer, count))]


@pytest.fixture(scope="module")
def sampler_model(tokenizer):
    torch.manual_seed(3)
    return build_random_model(tokenizer, hidden_size=32, num_layers=2).eval()


@pytest.mark.parametrize("attention", ["sdpa", "grouped_query"])
def test_sampling_draws_what_generate_draws(tokenizer, sampler_model, attention):
    """The simulator's KV-cached sampler against transformers' generate from the same seed (prompts of
    unequal length, so rows are left-padded; 4 query heads on 2 key/value heads): the same tokens, the
    same log-probs, with transformers' SDPA attention or the simulator's grouped-query one."""
    from vcpo.sim.rollout import use_grouped_query_sdpa

    sampling = Sampling(max_response_tokens=12, temperature=0.7, eos_token_ids=(0, 2), pad_token_id=0)
    trajectories = _trajectories(tokenizer)
    rollout_model = copy.deepcopy(sampler_model)
    if attention == "grouped_query":
        use_grouped_query_sdpa(rollout_model)
    assert sampler_model.config.num_key_value_heads < sampler_model.config.num_attention_heads
    RolloutSampler(tokenizer, sampling).extend(rollout_model, 0, trajectories, 12, seed=5)

    from vcpo.sim.rollout import left_padded, sampling_log_probs

    ids, mask = left_padded([t.prompt_ids for t in _trajectories(tokenizer)], 0)
    torch.manual_seed(5)
    out = sampler_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=12,
        eos_token_id=[0, 2], pad_token_id=0, output_scores=True, return_dict_in_generate=True,
    )
    new = out.sequences[:, ids.shape[1] :]
    log_probs, _ = sampling_log_probs(torch.stack(out.scores, dim=1), new)
    for row, t in enumerate(trajectories):
        assert t.response_ids == new[row, : len(t.response_ids)].tolist()
        assert t.finished and t.truncated == (t.response_ids[-1] not in (0, 2))
        assert torch.allclose(torch.tensor(t.behav_log_probs), log_probs[row, : len(t.response_ids)], atol=1e-5)


@pytest.mark.parametrize("kv_cache", ["recompute", "keep"])
def test_a_kept_cache_gives_what_a_full_prefill_gives(tokenizer, sampler_model, kv_cache):
    """Rounds of 3 tokens with the same weights: the cache carried between rounds changes nothing."""
    sampling = Sampling(max_response_tokens=12, temperature=1.0, eos_token_ids=(0, 2), pad_token_id=0, kv_cache=kv_cache)
    cached, fresh = _trajectories(tokenizer), _trajectories(tokenizer)
    generator = RolloutSampler(tokenizer, sampling)
    for round_ in range(4):
        generator.extend(sampler_model, 0, cached, 3, seed=round_)
        for t in fresh:
            t.kv = None  # a full prefill every round
        generator.extend(sampler_model, 0, fresh, 3, seed=round_)
    for a, b in zip(cached, fresh, strict=True):
        assert a.response_ids == b.response_ids
        assert torch.allclose(torch.tensor(a.behav_log_probs), torch.tensor(b.behav_log_probs), atol=1e-5)
    assert sum(len(t.response_ids) for t in cached) > 3 * len(cached), "no response spans two rounds"


def test_keep_samples_the_new_weights_over_the_old_cache(tokenizer, sampler_model):
    """kv_cache=keep: after a weight update the first new token's l^μ is that of the new weights reading
    the keys and values the old weights wrote; recompute gives log π_new of a fresh prefill."""
    from transformers.cache_utils import DynamicCache

    newer = copy.deepcopy(sampler_model)
    with torch.no_grad():
        for parameter in newer.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    runs = {}
    for mode in ("keep", "recompute"):
        sampling = Sampling(max_response_tokens=20, temperature=1.0, eos_token_ids=(), pad_token_id=0, kv_cache=mode)
        trajectories = _trajectories(tokenizer, 2)
        generator = RolloutSampler(tokenizer, sampling)
        generator.extend(sampler_model, 0, trajectories, 4, seed=0)
        generator.extend(newer, 1, trajectories, 1, seed=1)
        runs[mode] = trajectories
    assert [t.response_ids[:4] for t in runs["keep"]] == [t.response_ids[:4] for t in runs["recompute"]]
    for keep, recompute in zip(runs["keep"], runs["recompute"], strict=True):
        context = keep.prompt_ids + keep.response_ids[:4]
        with torch.no_grad():
            cache = DynamicCache()
            sampler_model(input_ids=torch.tensor([context[:-1]]), past_key_values=cache, use_cache=True)
            stale = newer(input_ids=torch.tensor([context[-1:]]), past_key_values=cache, use_cache=True).logits[0, -1]
            exact = newer(input_ids=torch.tensor([context])).logits[0, -1]
        assert keep.behav_log_probs[4] == pytest.approx(float(torch.log_softmax(stale, -1)[keep.response_ids[4]]), abs=1e-5)
        assert recompute.behav_log_probs[4] == pytest.approx(float(torch.log_softmax(exact, -1)[recompute.response_ids[4]]), abs=1e-5)
        assert abs(float(torch.log_softmax(stale, -1)[keep.response_ids[4]] - torch.log_softmax(exact, -1)[keep.response_ids[4]])) > 1e-4
        assert keep.versions == [0] * 4 + [1]


class VersionedScriptedModel(ScriptedModel):
    """A ScriptedModel whose weights change the probability of its scripted token: every other token
    gets logit -(14 + scale), so log π_v(scripted token) = -log(1 + (V - 1) e^-(14 + scale_v))."""

    scale = 0.0

    def __call__(self, input_ids, attention_mask, past_key_values, **kwargs):
        logits = super().__call__(input_ids, attention_mask, past_key_values, **kwargs).logits
        logits = torch.where(logits > 0, 0.0, -(14.0 + self.scale))
        return type("Out", (), {"logits": logits})

    def load_state_dict(self, state):
        self.scale = state["scale"]

    def log_prob(self, scale: float) -> float:
        return -math.log1p((len(self.tokenizer) - 1) * math.exp(-(14.0 + scale)))


def test_multi_turn_behaviour_log_probs_cover_exactly_the_generated_tokens_across_weight_updates(tokenizer):
    """Pipeline lag 2, 3 tokens per weight update: responses of two turns span several policy versions
    and a tool call. Every generated token carries the log-prob of the version that sampled it (the
    scale of that version's weights), every tool-output token none (version TOOL_TOKEN, log-prob 0,
    outside the loss mask), and the policy's tokens are exactly the scripted turns."""
    turns = ["<code>print(6*7)</code>", " #### 42<|im_end|>"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampling = Sampling(max_response_tokens=64, temperature=1.0, eos_token_ids=(im_end,), pad_token_id=0, max_turns=2)
    model = VersionedScriptedModel(tokenizer, turns)
    rollouts = Rollouts(
        lag_model="pipeline", lag=2, prompts_per_step=2, responses_per_prompt=2, update_tokens=3, seed=0,
        prompts=prompts(tokenizer, 40).__getitem__, num_problems=40,
        generator=RolloutSampler(tokenizer, sampling, lambda code: ToolResult("42\n")),
        model=model, weights=lambda version: {"scale": 0.5 * version},
    )
    # The sampler's float32 log-softmax sums V - 1 terms e^-(14 + s) onto 1: the recursive-summation bound
    # puts its rounding error within (V - 1)·u·Σ (u = 2^-24), ~1.1e-5 here; where in that range it lands
    # depends on the CPU's kernel (its order of additions), so the tolerance is the bound, not one machine's.
    vocab = len(tokenizer)
    tolerance = (vocab - 1) * 2.0**-24 * (1 + (vocab - 1) * math.exp(-14.0))
    by_version: dict[int, list[float]] = {}
    spanning = 0
    for step in range(6):
        batch = rollouts.batch(step)
        for t in batch:
            generated = [(token, lp, v) for token, lp, v in zip(t.response_ids, t.behav_log_probs, t.versions, strict=True) if v != TOOL_TOKEN]
            assert tokenizer.decode([token for token, _, _ in generated], skip_special_tokens=False) == "".join(turns)
            for _, log_prob, version in generated:
                assert log_prob == pytest.approx(model.log_prob(0.5 * version), abs=tolerance)
                by_version.setdefault(version, []).append(log_prob)
            tool = [(token, lp) for token, lp, v in zip(t.response_ids, t.behav_log_probs, t.versions, strict=True) if v == TOOL_TOKEN]
            assert tokenizer.decode([token for token, _ in tool]) == "<output>42\n</output>"
            assert all(lp == 0.0 for _, lp in tool)
            versions_before_tool = {v for v in t.versions[: t.versions.index(TOOL_TOKEN)]}
            versions_after_tool = {v for v in t.versions[len(t.versions) - t.versions[::-1].index(TOOL_TOKEN) :]}
            spanning += len(versions_before_tool | versions_after_tool) > 1
        collated = collate(batch, [1.0] * len(batch), pad_token_id=0)
        assert int(collated.mask.sum()) == sum(len(t.response_ids) - t.versions.count(TOOL_TOKEN) for t in batch)
    assert spanning > 0, "no response spanned a weight update"
    # each token carries its own version's log-prob, not a neighbour's: the versions' values rise with the
    # version (log π_v = -(V - 1) e^-(14 + 0.5 v)), and so must the mean recorded for each
    means = [sum(values) / len(values) for _, values in sorted(by_version.items())]
    assert len(means) >= 4 and means == sorted(means) and len(set(means)) == len(means)


@pytest.mark.parametrize("lag_model", ["fixed", "pipeline"])
def test_a_tool_call_the_round_ended_after_still_runs(tokenizer, lag_model):
    """A policy that writes end-of-sequence right after its </code> in the same round (a long round
    samples past the call): the call is cut there, the program runs, and the response goes on."""
    turns = [f"<code>print(6*7)</code>{END}", f" #### 42{END}"]
    im_end = tokenizer.convert_tokens_to_ids(END)
    sampling = Sampling(max_response_tokens=128, temperature=1.0, eos_token_ids=(im_end,), pad_token_id=0, max_turns=2)
    rollouts = Rollouts(
        lag_model=lag_model, lag=0, prompts_per_step=1, responses_per_prompt=2, update_tokens=64, seed=0,
        prompts=prompts(tokenizer, 2).__getitem__, num_problems=2,
        generator=RolloutSampler(tokenizer, sampling, lambda code: ToolResult("42\n")),
        model=ScriptedModel(tokenizer, turns), weights=lambda version: {},
    )  # fmt: skip
    for t in rollouts.batch(0):
        assert t.tool_calls == 1 and t.finished and not t.truncated
        assert tokenizer.decode(t.response_ids, skip_special_tokens=True) == "<code>print(6*7)</code><output>42\n</output> #### 42"
