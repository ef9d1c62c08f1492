"""The vcpo FSDP engine (vcpo.verl_plugin.engine.fsdp) through verl 0.9.1's FSDP engine code, on CPU.

verl runs on the CPU platform of the plugin (selected in conftest.py and for the spawned ranks, as the
launcher's workers select it). The engine's module is left unwrapped in float64 (tests/verl_engine_cpu.py: verl's FSDP policies
have no float64), and the FSDP2 tests wrap it with ``fully_shard`` themselves; the rest of the step is
verl's own code. References are float64: `vcpo.core` (PerSequenceGradients on the plain model) and a
per-sequence backward loop.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("verl")

import verl_engine_cpu as cpu  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import vcpo.verl_plugin  # noqa: E402,F401  (registers the losses)
from vcpo.core import PerSequenceGradients, ess_ratio, ess_step_scale, opob_baseline  # noqa: E402
from vcpo.core.baselines import group_reward_std  # noqa: E402
from vcpo.verl_contract import ENGINE_MODEL_TYPE  # noqa: E402
from vcpo.verl_plugin.engine.batch import reward_key  # noqa: E402
from vcpo.verl_plugin.engine.fsdp import VcpoFSDPEngineWithLMHead  # noqa: E402
from vcpo.verl_plugin.engine.rule import rule_from_loss_function  # noqa: E402

B, PROMPT, RESPONSE, GROUP, MICRO, VOCAB = 8, 5, 7, 4, 2, 96
BASE_LR = 1e-3
TIS_CAP = 8.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return cpu.save_random_qwen2(tmp_path_factory.mktemp("tiny"), vocab_size=VOCAB)


def make_batch(remove_padding: bool, rows: slice | None = None):
    return cpu.actor_batch(B, GROUP, PROMPT, RESPONSE, VOCAB, remove_padding, MICRO, rows=rows)


OPOB_MODES = ("single", "two_pass")


def ppo_loss_for(method: str, opob_mode: str = "auto"):
    """What verl's ActorRolloutRefWorker hands the engine: ppo_loss bound to the actor config."""
    return functools.partial(ppo_loss, config=cpu.actor_config(method, B, GROUP, MICRO, opob_mode=opob_mode))


def reference_log_probs(model, raw: cpu.RawBatch) -> torch.Tensor:
    logits = model(input_ids=raw.input_ids, attention_mask=raw.attention, position_ids=raw.position_ids).logits
    logits = logits[:, raw.prompt_width - 1 : -1].double()
    responses = raw.input_ids[:, raw.prompt_width :]
    lp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return torch.where(raw.response_mask, lp, torch.zeros_like(lp))


def sequence_terms(model, raw: cpu.RawBatch, std: torch.Tensor, count: int):
    """(scores l_i = mean_t l^θ with grad, s_i, c^S_i = −min(w_i, c)/(σ_g N)) of the VCPO preset."""
    mask = raw.response_mask
    lp = reference_log_probs(model, raw)
    s = ((lp.detach() - raw.old) * mask).sum(-1)
    coef_s = -torch.exp(s).clamp(max=TIS_CAP) / (std * count)
    scores = (lp * mask).sum(-1) / mask.sum(-1)
    return scores, s, coef_s


def seq_log_weights(model, raw: cpu.RawBatch) -> torch.Tensor:
    with torch.no_grad():
        return sequence_terms(model, raw, torch.ones(B, dtype=torch.float64), B)[1]


def scalar(metrics: dict, name: str) -> float:
    """The engine reports one value per step as a one-element list (verl's per-micro-batch metric format)."""
    value = metrics[name]
    assert isinstance(value, list) and len(value) == 1, (name, value)
    return value[0]


def record_lr(engine) -> list[float]:
    seen, step = [], engine.optimizer.step

    def recording(*args, **kwargs):
        seen.append(engine.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    engine.optimizer.step = recording
    return seen


# ---------------------------------------------------------------------------------------------
# ESS step size
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_ess_step_size_matches_core(process_group, model_dir, remove_padding):
    engine = cpu.build_engine(model_dir, remove_padding, lr=BASE_LR)
    td, raw = make_batch(remove_padding)
    s = seq_log_weights(engine.module, raw)
    expected = ess_step_scale(ess_ratio(s), rho_on=1.0, rule="sqrt", clamp=True)
    assert expected < 0.99  # off-policy enough for the rule to act
    seen = record_lr(engine)
    metrics = engine.train_batch(td, ppo_loss_for("tis_ess"))["metrics"]
    assert seen == [pytest.approx(BASE_LR * expected, rel=1e-9)]  # the LR of this optimizer.step()
    assert engine.optimizer.param_groups[0]["lr"] == BASE_LR  # restored after it
    assert scalar(metrics, "actor/lr_scale") == pytest.approx(expected, rel=1e-9)
    assert scalar(metrics, "actor/effective_lr") == pytest.approx(BASE_LR * expected, rel=1e-9)
    assert scalar(metrics, "rollout_corr/seq_ess_ratio") == pytest.approx(float(ess_ratio(s)), rel=1e-9)
    assert "actor/pg_loss" in metrics  # verl's ppo_loss ran (the ESS-only step keeps verl's loss)


def test_method_without_ess_or_opob_is_verls_step(process_group, model_dir):
    engine = cpu.build_engine(model_dir, remove_padding=True, lr=BASE_LR)
    td, _ = make_batch(True)
    seen = record_lr(engine)
    metrics = engine.train_batch(td, ppo_loss_for("seq_tis_c8"))["metrics"]
    assert seen == [BASE_LR] and "actor/lr_scale" not in metrics


# ---------------------------------------------------------------------------------------------
# OPOB
# ---------------------------------------------------------------------------------------------


def per_sequence_loop_gradient(model, raw: cpu.RawBatch):
    """Σ_i c^S_i (R_i − b_i) g_i with g_i from one backward per sequence, b from Eq. 7 on ||g_i||²."""
    params = [p for p in model.parameters() if p.requires_grad]
    std = group_reward_std(raw.rewards, raw.groups)
    scores, s, coef_s = sequence_terms(model, raw, std, B)
    grads = [torch.autograd.grad(scores[i], params, retain_graph=True) for i in range(B)]
    sq_norms = torch.stack([sum((g.double() ** 2).sum() for g in gi) for gi in grads])
    baseline = opob_baseline(raw.rewards, sq_norms, s, raw.groups)
    coef = coef_s * (raw.rewards - baseline)
    gradient = [sum(coef[i] * grads[i][k] for i in range(B)) for k in range(len(params))]
    return gradient, baseline, sq_norms, float((coef * scores.detach()).sum())


def core_gradient(model, raw: cpu.RawBatch) -> list[torch.Tensor]:
    """vcpo.core's PerSequenceGradients on the plain model: padded rows, one group per micro-batch."""
    per_sequence = PerSequenceGradients(model)
    params = [p for p in model.parameters() if p.requires_grad]
    std = group_reward_std(raw.rewards, raw.groups)
    s_all = []
    for start in range(0, B, GROUP):
        rows = raw.rows(slice(start, start + GROUP))
        zeros = torch.zeros(GROUP, dtype=torch.float64)
        with per_sequence.micro_batch(zeros, zeros, groups=rows.groups):
            scores, s, coef_s = sequence_terms(model, rows, std[start : start + GROUP], B)
            per_sequence.set_coefficients(coef_s * rows.rewards, coef_s)
            scores.sum().backward()
        s_all.append(s)
    per_sequence.combine(opob_baseline(raw.rewards, per_sequence.sq_norms, torch.cat(s_all), raw.groups))
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


def assert_gradients_close(got, expected, names=None):
    scale = max(float(g.abs().max()) for g in expected)
    assert scale > 0
    for k, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.allclose(a, b, atol=1e-6 * scale, rtol=1e-6), names[k] if names else k


def check_opob_step(engine, remove_padding: bool, packed: bool, max_tokens: int | None = None, mode: str = "single"):
    td, raw = make_batch(remove_padding)
    if max_tokens is not None:  # verl's dynamic batch size: token-budget micro-batches, reordered
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=max_tokens)
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    loop, baseline, sq_norms, pg_loss = per_sequence_loop_gradient(engine.module, raw)
    core = core_gradient(engine.module, raw)
    s = seq_log_weights(engine.module, raw)
    out = engine.train_batch(td, ppo_loss_for("vcpo", mode))
    metrics = out["metrics"]
    assert scalar(metrics, "actor/opob_two_pass") == float(mode == "two_pass")
    # p.grad after the step is the assembled gradient (clip_grad 1e9 never clips; zeroed at the next step)
    got = [p.grad for p in engine.module.parameters() if p.requires_grad]
    assert_gradients_close(core, loop, names)
    assert_gradients_close(got, loop, names)
    assert scalar(metrics, "actor/opob_baseline") == pytest.approx(float(baseline.mean()), rel=1e-6)
    assert scalar(metrics, "actor/seq_grad_norm_max") == pytest.approx(float(sq_norms.sqrt().max()), rel=1e-6)
    assert scalar(metrics, "actor/seq_grad_norm_min") == pytest.approx(float(sq_norms.sqrt().min()), rel=1e-6)
    assert scalar(metrics, "actor/opob_packed") == float(packed)
    assert scalar(metrics, "actor/lr_scale") == pytest.approx(ess_step_scale(ess_ratio(s)), rel=1e-9)
    assert scalar(metrics, "actor/pg_loss") == pytest.approx(pg_loss, rel=1e-6)
    assert out["loss"] == [scalar(metrics, "actor/pg_loss")]
    # the seq-TIS loss's diagnostics, per micro-batch as the loss would log them: max over micro-batches of
    # the applied weight min(e^s_i, c), every token kept (truncation keeps all), and the KL estimate
    assert max(flat(metrics["actor/is_weight_max"])) == pytest.approx(min(float(s.exp().max()), 8.0), rel=1e-5)
    assert set(flat(metrics["actor/kept_token_frac"])) == {1.0}
    assert all(math.isfinite(v) for v in flat(metrics["rollout_corr/kl"]))
    return out


def flat(values) -> list[float]:
    """verl's per-micro-batch metric values (Metric objects or floats, possibly nested lists) as floats."""
    if isinstance(values, (list, tuple)):
        return [v for item in values for v in flat(item)]
    if hasattr(values, "values"):  # verl.utils.metric.Metric
        return flat(values.values)
    return [float(values)]


@pytest.mark.parametrize("mode", OPOB_MODES)
@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_opob_gradient_matches_core_and_loop(process_group, model_dir, remove_padding, mode):
    check_opob_step(cpu.build_engine(model_dir, remove_padding), remove_padding, packed=remove_padding, mode=mode)


@pytest.mark.parametrize("mode", OPOB_MODES)
def test_opob_dynamic_batch_size(process_group, model_dir, mode):
    """use_dynamic_bsz: verl re-sorts the sequences into token-budget micro-batches of varying size (two_pass: each
    sequence's weight follows it into pass 2's micro-batches)."""
    engine = cpu.build_engine(model_dir, remove_padding=True)
    check_opob_step(engine, remove_padding=True, packed=True, max_tokens=30, mode=mode)


@pytest.mark.parametrize("mode", OPOB_MODES)
def test_opob_packed_with_static_pad(process_group, model_dir, mode):
    """pad_to_length: verl pads the packed row to a bucket; the tail belongs to no sequence."""
    engine = cpu.build_engine(model_dir, remove_padding=True)
    engine.pad_to_length, engine.pad_to_length_bucket = True, 64
    check_opob_step(engine, remove_padding=True, packed=True, mode=mode)


def test_the_two_modes_take_the_same_step(process_group, model_dir):
    """One step of two_pass equals one step of the single backward: the same gradient and the same parameters after
    AdamW (float64; the floating-point order differs, and HF's Qwen2 RMSNorm normalises in float32, so a plain
    backward of Σ_i a_i l_i with cancelling a_i rounds at float32 precision: measured 5.6e-8)."""
    steps = {}
    for mode in OPOB_MODES:
        engine = cpu.build_engine(model_dir, remove_padding=True)
        td, _ = make_batch(True)
        metrics = engine.train_batch(td, ppo_loss_for("vcpo", mode))["metrics"]
        steps[mode] = ([p.grad.clone() for p in engine.module.parameters()], [p.detach().clone() for p in engine.module.parameters()],
                       {k: scalar(metrics, k) for k in ("actor/opob_baseline", "actor/seq_grad_norm_mean", "actor/lr_scale")})
    (grads, params, metrics), (grads_2, params_2, metrics_2) = steps["single"], steps["two_pass"]
    assert relative_error(grads_2, grads) < 1e-6
    assert relative_error(params_2, params) < 1e-7
    assert metrics_2 == pytest.approx(metrics, rel=1e-9)


def test_metrics_pass_through_the_training_worker(process_group, model_dir):
    """TrainingWorker._postprocess_output (DP all-gather of metrics) and train_mini_batch's flattening."""
    from itertools import chain
    from types import SimpleNamespace

    from verl.workers.engine_workers import TrainingWorker

    engine = cpu.build_engine(model_dir, remove_padding=True)
    td, _ = make_batch(True)
    out = engine.train_batch(td, ppo_loss_for("vcpo"))
    out.pop("model_output")
    worker = SimpleNamespace(engine=engine, device_name="cpu", flops_counter=None)
    final = TrainingWorker._postprocess_output(
        worker, out, global_token_num=None, delta_time=1.0, forward_only=False, images_seqlens=None
    )
    metrics = tu.get(final, "metrics")
    for name in ("actor/lr_scale", "actor/opob_baseline", "actor/seq_grad_norm_mean", "rollout_corr/seq_ess_ratio"):
        assert len(list(chain.from_iterable(metrics[name]))) == 1  # what train_mini_batch does with lists
    assert metrics["loss"] == pytest.approx(metrics["actor/pg_loss"][0][0])


def fsdp2_engine(model_dir, remove_padding: bool, world: int = 1, bf16: bool = False, config_precision=None):
    """The engine with its module wrapped as verl's apply_fsdp2 does (each decoder layer, then the root);
    ``bf16``: verl's default mixed precision (fp32 weights, bf16 compute parameters and autocast, fp32
    reduction), else float64 throughout (``config_precision``: the engine config's mixed_precision)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from verl.workers.config.optimizer import build_optimizer

    precision = {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"} if bf16 else config_precision
    engine = cpu.build_engine(model_dir, remove_padding, dtype=torch.float32 if bf16 else torch.float64,
                              mixed_precision=precision)  # fmt: skip
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    if bf16:
        engine._autocast_dtype = torch.bfloat16  # what verl's _build_fsdp_module sets from param_dtype
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    for layer in engine.module.model.layers:
        fully_shard(layer, mesh=mesh, **({"mp_policy": policy} if bf16 else {}))
    fully_shard(engine.module, mesh=mesh, **({"mp_policy": policy} if bf16 else {}))
    engine.optimizer = build_optimizer(engine.module.parameters(), engine.optimizer_config)
    return engine


def full_gradients(module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in module.parameters()]


@pytest.mark.parametrize("mode", OPOB_MODES)
@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_opob_under_fsdp2(process_group, model_dir, remove_padding, mode):
    """fully_shard (FSDP2, world size 1 on gloo): the sharded DTensor gradients are the OPOB gradient (single: the
    model unsharded for the step; two_pass: FSDP2's own sharded step, twice)."""
    from torch.distributed.tensor import DTensor
    from transformers import Qwen2ForCausalLM

    reference = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").double()
    engine = fsdp2_engine(model_dir, remove_padding)
    td, raw = make_batch(remove_padding)
    loop, baseline, _, _ = per_sequence_loop_gradient(reference, raw)
    before = [p.full_tensor().clone() for p in engine.module.parameters()]
    metrics = engine.train_batch(td, ppo_loss_for("vcpo", mode))["metrics"]
    assert scalar(metrics, "actor/opob_two_pass") == float(mode == "two_pass")
    assert all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in engine.module.parameters())
    assert_gradients_close(full_gradients(engine.module), loop)
    assert scalar(metrics, "actor/opob_baseline") == pytest.approx(float(baseline.mean()), rel=1e-6)
    assert any(not torch.equal(b, p.full_tensor()) for b, p in zip(before, engine.module.parameters(), strict=True))
    # the next step runs again (FSDP2 state restored: resharded, gradient sync back on)
    td, _ = make_batch(remove_padding)
    engine.train_batch(td, ppo_loss_for("vcpo", mode))
    td, _ = make_batch(remove_padding)
    engine.train_batch(td, ppo_loss_for("tis_ess"))  # and verl's own FSDP2 path after it


@pytest.mark.parametrize(
    "precision, refused",
    [({"param_dtype": "32", "reduce_dtype": "bf16"}, True), ({"param_dtype": "fp32", "reduce_dtype": "32"}, False)],
)
def test_opob_under_fsdp2_reads_precisions_by_verls_names(process_group, model_dir, precision, refused):
    """fp32 parameters need an fp32 reduction under OPOB's single backward, whichever of verl's names spell them
    ("32" too); two_pass reduces as verl's own step does, and runs."""
    engine = fsdp2_engine(model_dir, remove_padding=True, config_precision=precision)
    td, _ = make_batch(True)
    if refused:
        with pytest.raises(NotImplementedError, match="needs mixed_precision.reduce_dtype fp32"):
            engine.train_batch(td, ppo_loss_for("vcpo", "single"))
        td, _ = make_batch(True)
        engine.train_batch(td, ppo_loss_for("vcpo", "two_pass"))
    else:
        engine.train_batch(td, ppo_loss_for("vcpo", "single"))


def relative_error(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    difference = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(got, expected, strict=True))
    return (difference / sum(float(b.double().pow(2).sum()) for b in expected)) ** 0.5


@pytest.mark.parametrize("mode", OPOB_MODES)
@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_opob_under_fsdp2_in_verls_default_mixed_precision(process_group, model_dir, remove_padding, mode):
    """verl's default precision: the OPOB gradient of the bf16 compute path against the float64 loop on
    the fp32 weights, within 4x the error plain autograd makes in the same precision (the same loop on
    the weights in bf16 under autocast(bf16)); the sharded fp32 gradients are what the optimizer steps on.
    Measured: autograd 6.6e-3, the engine 6.6e-3 (padded and packed)."""
    from torch.distributed.tensor import DTensor
    from transformers import Qwen2ForCausalLM

    reference = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    engine = fsdp2_engine(model_dir, remove_padding, bf16=True)
    td, raw = make_batch(remove_padding)
    truth, _, _, _ = per_sequence_loop_gradient(copy.deepcopy(reference).double(), raw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autograd, _, _, _ = per_sequence_loop_gradient(copy.deepcopy(reference).to(torch.bfloat16), raw)
    autograd_error = relative_error(autograd, truth)
    assert autograd_error > 1e-4  # bf16 really ran

    engine.train_batch(td, ppo_loss_for("vcpo", mode))
    assert all(isinstance(p.grad, DTensor) and p.grad.dtype == torch.float32 for p in engine.module.parameters())
    assert relative_error(full_gradients(engine.module), truth) <= 4 * autograd_error
    td, _ = make_batch(remove_padding)
    engine.train_batch(td, ppo_loss_for("vcpo", mode))  # the next step runs too (FSDP2 state restored)


# ---------------------------------------------------------------------------------------------
# Selection and presets
# ---------------------------------------------------------------------------------------------


def test_rules_from_presets_and_loss_function():
    from vcpo.methods import step_rule

    vcpo = step_rule("vcpo")
    assert vcpo.ess and vcpo.opob and vcpo.scope == "group" and vcpo.loss_params["hi"] == TIS_CAP
    assert not step_rule("seq_tis_c8").active
    tis_ess = step_rule("tis_ess")
    assert tis_ess.ess and not tis_ess.opob
    assert rule_from_loss_function(ppo_loss_for("vcpo")) == vcpo
    assert rule_from_loss_function(lambda **kw: None) is None


def test_registry_selects_the_engine_by_model_type():
    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls(ENGINE_MODEL_TYPE, backend) is VcpoFSDPEngineWithLMHead


@pytest.mark.parametrize("task, rho_on", [("math", 1.0), ("simpletir", 0.55)])
def test_the_launchers_overrides_give_the_engine_its_rule(model_dir, task, rho_on):
    """vcpo.launch's own composed config of a VCPO run, read as verl's workers read it: the engine by model
    type, the FSDP2 strategy, and the loss function whose rule is the preset's with the task's ρ_on."""
    from verl.utils.config import omega_conf_to_dataclass

    from vcpo.launch import compose, make_run
    from vcpo.methods import step_rule

    run = make_run(task, "vcpo", 1, 0)
    config = compose(run, [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.tokenizer_path=null"])
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    assert model.model_type == ENGINE_MODEL_TYPE and actor.engine.strategy == "fsdp2"
    assert EngineRegistry.get_engine_cls(model.model_type, actor.engine.strategy) is VcpoFSDPEngineWithLMHead
    rule = rule_from_loss_function(functools.partial(ppo_loss, config=actor))
    assert rule == step_rule("vcpo").with_rho_on(rho_on)


def test_opob_refuses_losses_it_would_drop():
    import dataclasses

    from vcpo.verl_plugin.engine.rule import check_opob_loss

    config = dataclasses.replace(cpu.actor_config("vcpo", B, GROUP, MICRO), use_kl_loss=True)
    with pytest.raises(NotImplementedError, match="use_kl_loss"):
        check_opob_loss(functools.partial(ppo_loss, config=config))
    with pytest.raises(NotImplementedError, match="replaces verl's ppo_loss"):
        check_opob_loss(lambda **kwargs: None)
    check_opob_loss(ppo_loss_for("vcpo"))


def test_the_megatron_strategy_selects_the_vcpo_megatron_engine():
    """The same model type on the megatron backend is the Megatron engine (vcpo.verl_plugin.engine.megatron)."""
    from vcpo.methods import step_rule
    from vcpo.verl_plugin.engine.megatron import VcpoMegatronEngineWithLMHead

    assert EngineRegistry.get_engine_cls(ENGINE_MODEL_TYPE, "megatron") is VcpoMegatronEngineWithLMHead
    for method in ("vcpo", "tis_ess", "tis_opob"):
        assert "megatron" in step_rule(method).strategies


# ---------------------------------------------------------------------------------------------
# Two data-parallel ranks
# ---------------------------------------------------------------------------------------------


def _dp_worker(rank: int, world: int, store_path: str, model_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        results = {}
        for sharded, remove_padding, mode in itertools.product((False, True), (False, True), OPOB_MODES):
            if sharded:  # FSDP2 over the two ranks: every parameter really sharded
                engine = fsdp2_engine(model_dir, remove_padding, world=world)
            else:  # unwrapped module: the engine's own all-reduce is the only gradient sync
                engine = cpu.build_engine(model_dir, remove_padding)
            # rank r holds rows r, r + world, ...: every prompt group is split across the ranks
            td, _ = make_batch(remove_padding, rows=slice(rank, None, world))
            metrics = engine.train_batch(td, ppo_loss_for("vcpo", mode))["metrics"]
            results[sharded, remove_padding, mode] = {
                "grads": full_gradients(engine.module),
                # the engine's per-step values (the loss's per-micro-batch diagnostics are not compared)
                "metrics": {k: flat(v)[0] for k, v in metrics.items() if k.startswith(("actor/", "rollout_corr/"))},
            }
        torch.save(results, f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_opob_two_data_parallel_ranks(model_dir, tmp_path):
    """Two gloo ranks, groups split across them, unwrapped and FSDP2-sharded, padded and packed:
    gathered norms and baseline, one all-reduce, the same gradient as one process on the whole batch."""
    from transformers import Qwen2ForCausalLM

    from vcpo.verl_contract import CPU_PLATFORM_ENV

    with pytest.MonkeyPatch.context() as patch:  # the spawned ranks import verl on the CPU platform
        for name, value in CPU_PLATFORM_ENV.items():
            patch.setenv(name, value)
        torch.multiprocessing.spawn(_dp_worker, args=(2, str(tmp_path / "store"), str(model_dir), str(tmp_path)), nprocs=2)
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").double()
    _, raw = make_batch(False)
    loop, baseline, _, _ = per_sequence_loop_gradient(model, raw)
    expected_scale = ess_step_scale(ess_ratio(seq_log_weights(model, raw)))
    for rank in range(2):
        for (_, remove_padding, _), result in torch.load(tmp_path / f"{rank}.pt").items():
            assert_gradients_close(result["grads"], loop)
            assert result["metrics"]["actor/opob_baseline"] == pytest.approx(float(baseline.mean()), rel=1e-6)
            assert result["metrics"]["actor/lr_scale"] == pytest.approx(expected_scale, rel=1e-9)
            assert result["metrics"]["actor/opob_packed"] == float(remove_padding)


def test_opob_sums_the_kl_penalised_rewards_when_verl_sends_them():
    from tensordict import TensorDict

    scores, penalised = torch.ones(2, 3), torch.zeros(2, 3)
    assert reward_key(TensorDict({"rm_scores": scores}, batch_size=[2])) == "rm_scores"
    both = TensorDict({"rm_scores": scores, "token_level_rewards": penalised}, batch_size=[2])
    assert reward_key(both) == "token_level_rewards"
    with pytest.raises(KeyError, match="per-token rewards"):
        reward_key(TensorDict({"advantages": scores}, batch_size=[2]))


# ---------------------------------------------------------------------------------------------
# One step rule for both backends
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["vcpo", "tis_ess", "tis_opob"])
def test_the_simulator_and_the_engine_take_the_same_step(process_group, model_dir, monkeypatch, method):
    """One batch through the simulator's learner and through the verl engine: the same OPOB coefficients
    (c^R, c^S per sequence), the same baseline, the same ESS learning-rate scale and the same gradient."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from vcpo.methods import get_method
    from vcpo.sim.learner import Batch, Learner

    seen: dict[str, list] = {"engine": [], "sim": []}
    backend = ["engine"]
    original = PerSequenceGradients.set_coefficients

    def recording(self, reward_coef, score_coef):
        seen[backend[0]].append((reward_coef.detach().clone(), score_coef.detach().clone()))
        return original(self, reward_coef, score_coef)

    monkeypatch.setattr(PerSequenceGradients, "set_coefficients", recording)

    engine = cpu.build_engine(model_dir, remove_padding=False, lr=BASE_LR)
    td, raw = make_batch(remove_padding=False)
    engine_lr = record_lr(engine)
    engine_metrics = engine.train_batch(td, ppo_loss_for(method))["metrics"]
    engine_grads = [p.grad.clone() for p in engine.module.parameters() if p.requires_grad]

    backend[0] = "sim"
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").double()
    config = SimpleNamespace(
        base_lr=BASE_LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, grad_clip=1e9, rho_on=None, temperature=1.0,
        responses_per_prompt=GROUP, prompts_per_step=B // GROUP, micro_batch_size=GROUP, opob_combination="deferred",
    )
    learner = Learner(model, get_method(method), config)
    sim_grads, sim_lr = [], []

    def step(*args, **kwargs):
        sim_grads.extend(p.grad.clone() for p in learner.params)
        sim_lr.append(learner.optimizer.param_groups[0]["lr"])

    learner.optimizer.step = step
    versions = torch.where(raw.response_mask, 0, -2)
    batch = Batch(
        input_ids=raw.input_ids, attention_mask=raw.attention, position_ids=raw.position_ids,
        prompt_width=raw.prompt_width, response_ids=raw.input_ids[:, raw.prompt_width:], mask=raw.response_mask,
        behav_log_prob=raw.old, sum_pi_squared=torch.zeros_like(raw.old), versions=versions, rewards=raw.rewards,
        groups=raw.groups,
    )
    sim_metrics = learner.update(batch, schedule_factor=1.0)

    assert sim_lr == [pytest.approx(lr, rel=1e-9) for lr in engine_lr]
    assert sim_metrics["actor/lr_scale"] == pytest.approx(scalar(engine_metrics, "actor/lr_scale"), rel=1e-9)
    if method == "tis_ess":
        # the loss's own backward on both sides (verl's trainer hands the engine its advantages, the batch here
        # has none, so only the step size is compared): no coefficients, and an ESS scale that acts
        assert seen == {"engine": [], "sim": []} and scalar(engine_metrics, "actor/lr_scale") < 0.99
        return
    for k in range(2):
        engine_side = torch.cat([pair[k] for pair in seen["engine"]])
        sim_side = torch.cat([pair[k] for pair in seen["sim"]])
        assert torch.allclose(sim_side, engine_side, rtol=1e-9, atol=0), k
    baseline = scalar(engine_metrics, "actor/opob_baseline")
    assert sim_metrics["actor/opob_baseline"] == pytest.approx(baseline, rel=1e-9)
    assert_gradients_close(sim_grads, engine_grads)
