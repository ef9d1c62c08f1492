"""The vcpo Megatron engine (vcpo.verl_plugin.engine.megatron) against the vcpo FSDP engine: one VCPO actor
step (ESS step size and OPOB), then one tis_ess step (the ESS step size alone), on the same model and batch.

The Megatron step runs in verl's Megatron engine on two gloo ranks (tests/verl_megatron_vcpo_worker.py: bf16
parameters as the engine requires, the padded path, megatron's own pipeline schedule) at TP 2 on a model with
tied embeddings and at PP 2 on an untied one; the FSDP step runs here, in float32 on one rank. The engines share
the step rule (vcpo.verl_plugin.engine.step) and differ in where the per-sequence gradients come from (hooks on
megatron's parallel layers, combined from the backward of Σ_i c^S_i l_i; the FSDP engine's own forward
replacement, from Σ_i l_i), so their norms, baseline and ESS ratio agree to bf16's precision. The Megatron
worker also takes the vcpo step again from the same weights in OPOB's two-pass mode (norms, then megatron's
plain step of the weighted scores), which must match its single-backward step.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

from verl.workers.utils.losses import ppo_loss  # noqa: E402

import vcpo.verl_plugin  # noqa: E402,F401  (registers the losses)
from vcpo.verl_plugin.cpu import standalone  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from verl_megatron_vcpo_worker import GROUP, METHODS, MICRO, PROMPT, RESPONSE, TWO_PASS, VOCAB, B, scalars  # noqa: E402

WORKER = Path(__file__).with_name("verl_megatron_vcpo_worker.py")
PLAIN_WORKER = Path(__file__).with_name("verl_megatron_worker.py")  # verl's Megatron engine alone, against the HF model
# (tensor, pipeline, tied embeddings): at PP 2 the tied weight spans the first and last stages
CASES = [(2, 1, True), (1, 2, False), (1, 2, True)]
BF16 = 1e-2  # relative: a bf16 engine against a float32 one (3.4e-3 measured; without the tied weight's cross term
# across stages the PP 2 tied norms move by 1.2-2.8% and the baseline by 9.5%)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[bool, Path]:
    return {tied: standalone.save_random_qwen2(tmp_path_factory.mktemp("tied" if tied else "untied"), vocab_size=VOCAB,
                                               tie_word_embeddings=tied) for tied in (True, False)}


def torchrun(worker: Path, args: list, out: Path, ranks: int = 2, after: tuple = ()) -> dict:
    """``worker`` on ``ranks`` gloo ranks; the JSON its output rank writes to ``out``."""
    with socket.socket() as probe:  # a free port for the ranks' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
               "--master_port", str(port), str(worker), *map(str, args), str(out), *after]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(out.read_text())


def fsdp_steps(model: Path) -> dict[str, dict[str, float]]:
    engine = standalone.build_engine(model, remove_padding=False, lr=1e-3)
    steps = {}
    for method in METHODS:
        td, _ = standalone.actor_batch(B, GROUP, PROMPT, RESPONSE, VOCAB, remove_padding=False, micro=MICRO)
        config = standalone.actor_config(method, B, GROUP, MICRO, opob_mode="single")
        with engine.train_mode():
            steps[method] = scalars(engine.train_batch(td, functools.partial(ppo_loss, config=config))["metrics"])
    return steps


@pytest.mark.parametrize("tensor, pipeline, tied", CASES, ids=["tp2-tied", "pp2-untied", "pp2-tied"])
def test_one_vcpo_step_under_megatron_is_the_fsdp_engines_step(process_group, models, tmp_path, tensor, pipeline, tied):
    megatron = torchrun(WORKER, [tensor, pipeline, models[tied]], tmp_path / "megatron.json")
    assert megatron["engine"] == "VcpoMegatronEngineWithLMHead"
    # megatron's local layers, as the launcher composes them for OPOB (recipes/megatron.yaml, local_layers)
    assert (megatron["transformer_impl"], megatron["recompute_granularity"], megatron["sequence_parallel"]) == ("local", "selective", False)
    fsdp = fsdp_steps(models[tied])
    for method in METHODS:  # vcpo (ESS and OPOB), then tis_ess (ESS only) from the parameters vcpo's step left
        ours, theirs = megatron["steps"][method], fsdp[method]
        # the mini-batch ESS and the step it sets (far off-policy: the rule is at work)
        assert theirs["rollout_corr/seq_ess_ratio"] < 0.5 and theirs["actor/lr_scale"] < 0.75, method
        for name in ("rollout_corr/seq_ess_ratio", "actor/lr_scale", "actor/effective_lr"):
            assert abs(ours[name] - theirs[name]) < 5e-3 * abs(theirs[name]), (method, name, ours[name], theirs[name])
    # the per-sequence gradient norms (over every shard and stage) and the OPOB baseline
    ours, theirs = megatron["steps"]["vcpo"], fsdp["vcpo"]
    for name in ("actor/seq_grad_norm_mean", "actor/seq_grad_norm_max", "actor/seq_grad_norm_min", "actor/opob_baseline",
                 "actor/pg_loss"):
        assert abs(ours[name] - theirs[name]) < BF16 * abs(theirs[name]), (name, ours[name], theirs[name])
    assert "actor/opob_baseline" not in megatron["steps"]["tis_ess"]
    # the two-pass mode's step from the same weights: the same norms, baseline and gradient (its norm before
    # clipping), within bf16's precision
    single, two_pass = megatron["steps"]["vcpo"], megatron["steps"][TWO_PASS]
    assert (single["actor/opob_two_pass"], two_pass["actor/opob_two_pass"]) == (0.0, 1.0)
    for name in ("actor/seq_grad_norm_mean", "actor/opob_baseline", "actor/lr_scale", "grad_norm"):
        assert abs(two_pass[name] - single[name]) < BF16 * abs(single[name]), (name, two_pass[name], single[name])


def test_the_megatron_step_at_data_parallel_2_is_its_step_at_1(models, tmp_path):
    """Two data-parallel ranks, each with half the batch (a prompt group each), with megatron's distributed optimizer
    (its state sharded over them), against one rank with all of it and the plain optimizer: the ESS and OPOB's norms
    and baseline gathered over the ranks, and the update (its norm before clipping: megatron averages the ranks'
    gradients, and the engine writes each rank's part times DP)."""
    one = torchrun(WORKER, [1, 1, models[False]], tmp_path / "dp1.json", ranks=1)
    two = torchrun(WORKER, [1, 1, models[False]], tmp_path / "dp2.json", ranks=2, after=("distributed_optimizer",))
    assert (one["data_parallel"], two["data_parallel"]) == (1, 2)
    assert set(two["optimizers"]) == {"DistributedOptimizer"} and "DistributedOptimizer" not in one["optimizers"]
    for step in ("vcpo", TWO_PASS, "tis_ess"):
        ours, theirs = two["steps"][step], one["steps"][step]
        names = ["rollout_corr/seq_ess_ratio", "actor/lr_scale"]
        if step != "tis_ess":  # (tis_ess's gradient is 0: the batch's advantages are zeros, which only OPOB does not read)
            names += ["grad_norm", "actor/seq_grad_norm_mean", "actor/seq_grad_norm_max", "actor/seq_grad_norm_min", "actor/opob_baseline"]
        for name in names:
            assert abs(ours[name] - theirs[name]) < 1e-3 * abs(theirs[name]), (step, name, ours[name], theirs[name])
    assert one["steps"]["vcpo"]["rollout_corr/seq_ess_ratio"] < 0.5  # far off-policy: the rule is at work


@pytest.mark.parametrize("tensor, pipeline", [(2, 1)], ids=["tp2"])  # PP 2 runs verl's engine in the tests above
def test_verls_megatron_engine_runs_on_cpu_as_the_hf_model_computes(tmp_path, tensor, pipeline):
    """verl's own Megatron engine (mbridge, megatron's DDP, optimizer and schedule) with the CPU shims of
    vcpo.verl_plugin.cpu.megatron, untied and tied embeddings: its log-probs against the HF model's float32 ones
    (no further than the HF model's own bf16 ones are, times 3), one plain step's loss and gradient norm against
    verl's ppo_loss on the HF model in float32, and the step moves the policy."""
    results = torchrun(PLAIN_WORKER, [tensor, pipeline], tmp_path / "plain.json")
    assert set(results) == {"untied", "tied"}
    for name, result in results.items():
        assert (result["tensor"], result["pipeline"]) == (tensor, pipeline), name
        assert result["engine_vs_fp32"]["max_abs"] <= 3 * result["hf_bf16_vs_fp32"]["max_abs"], name
        reference = result["reference_fp32_step"]
        assert abs(result["metrics"]["actor/pg_loss"] - reference["loss"]) <= 1e-2 * abs(reference["loss"]), name
        assert abs(result["grad_norm"] - reference["grad_norm"]) <= 1e-2 * reference["grad_norm"], name
        assert result["after_step_vs_before"]["max_abs"] > 1e-2, name


def test_mbridge_builds_megatrons_local_spec_when_the_transformer_config_says_local(process_group):
    """vcpo.verl_plugin.engine.layer_spec: transformer_impl="local" gets megatron's local layers (what the per-sequence
    norms watch) and their separate norms' weights under the names mbridge's maps know; any other value mbridge's own
    Transformer Engine spec, as before."""
    from types import SimpleNamespace

    from mbridge.core.bridge import Bridge
    from mbridge.core.llm_bridge import LLMBridge
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vcpo.verl_plugin.engine.layer_spec import honour_transformer_impl, te_name

    honour_transformer_impl()
    honour_transformer_impl()  # idempotent

    def bridge(impl: str) -> SimpleNamespace:
        return SimpleNamespace(config=TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, normalization="RMSNorm",
                                                        transformer_impl=impl, use_cpu_initialization=True))

    parallel_state.initialize_model_parallel()
    try:
        block = LLMBridge._get_transformer_layer_spec(bridge("local"))
        assert block.layer_norm.__name__ == "WrappedTorchNorm"  # the final norm too (apex's would refuse RMSNorm)
        layer = block.layer_specs[0].submodules
        attention = layer.self_attention.submodules
        assert (attention.linear_qkv, attention.linear_proj, layer.mlp.submodules.linear_fc1) == (
            ColumnParallelLinear, RowParallelLinear, ColumnParallelLinear)
        assert layer.input_layernorm.__name__ == "WrappedTorchNorm"
        te = bridge("transformer_engine")
        original = LLMBridge._get_transformer_layer_spec.__wrapped__
        try:
            expected = original(te)
        except Exception as error:  # no Transformer Engine here: mbridge's own spec fails as it would unpatched
            with pytest.raises(type(error)):
                LLMBridge._get_transformer_layer_spec(te)
        else:
            assert LLMBridge._get_transformer_layer_spec(te) == expected
    finally:
        parallel_state.destroy_model_parallel()
    assert te_name("decoder.layers.3.input_layernorm.weight") == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert te_name("decoder.layers.0.pre_mlp_layernorm.weight") == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert te_name("decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"
    assert getattr(Bridge._weight_name_mapping_mcore_to_hf, "__wrapped__", None) is not None


def test_verls_padding_mask_becomes_megatrons_square_mask():
    """verl's padded path: [b, s], True at real tokens; megatron's local attention: [b, 1, sq, sk], True where masked
    (a later key, or a padded one). By hand for one sequence of 2 real tokens padded to 3."""
    import torch

    from vcpo.verl_plugin.engine.layer_spec import square_attention_mask

    mask = square_attention_mask(torch.tensor([[True, True, False]]), 3, 3)
    assert mask.shape == (1, 1, 3, 3)
    assert mask[0, 0].tolist() == [[False, True, True], [False, False, True], [False, False, True]]
