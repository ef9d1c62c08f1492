"""Per-sequence gradient norms of megatron-core models under model parallelism (vcpo.core.per_sequence_grads.megatron).

Gloo ranks (TP 2, PP 2, TP 2 x PP 2; CPU, float64, and one bf16 case) run tests/megatron_tp_worker.py: a small megatron-core GPT of
each architecture (two families, tied embeddings, sequence parallelism, the layer sets of Qwen2, Llama 3 and Qwen3), its per-sequence squared norms from one
backward against one backward per sequence, and the OPOB update of every local parameter against the same
per-sequence gradients; the full gradient's norm taken by the reduction rule (sharded
parameters summed over the TP group, replicated ones once, after summing a sequence-parallel one's partial
gradients over the ranks' tokens).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vcpo.core.per_sequence_grads.megatron import MegatronSequenceNorms

WORKER = Path(__file__).with_name("megatron_tp_worker.py")


# (architecture, ranks): TP 2 for all but the pipeline ones, which run at PP 2 on two ranks and TP 2 x PP 2 on four
CASES = [("rmsnorm_swiglu_rope", 2), ("layernorm_gelu_learned", 2), ("rmsnorm_swiglu_rope_tied", 2), ("rmsnorm_swiglu_rope_sp", 2),
         ("layernorm_gelu_learned_sp", 2), ("qwen2", 2), ("llama3", 2), ("qwen3", 2), ("rmsnorm_swiglu_rope_pp", 2), ("rmsnorm_swiglu_rope_pp", 4),
         ("rmsnorm_swiglu_rope_pp_tied", 2), ("rmsnorm_swiglu_rope_pp_tied", 4)]
BF16_CASE = ("rmsnorm_swiglu_rope_bf16", 2)
ERROR_RATIO = 4.0  # in bf16 the engine's error may be this many times autograd's own (as for the transformers path)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every case's result: one launch per number of ranks, every architecture of it in turn."""
    pytest.importorskip("megatron.core")
    found = {}
    for ranks in sorted({ranks for _, ranks in CASES}):
        out = tmp_path_factory.mktemp("megatron") / "results.json"
        with socket.socket() as probe:  # a free port for the ranks' rendezvous
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        architectures = ",".join(architecture for architecture, r in [*CASES, BF16_CASE] if r == ranks)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
                   "--master_port", str(port), str(WORKER), architectures, str(out)]
        completed = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert completed.returncode == 0, completed.stderr[-3000:]
        found.update({(architecture, ranks): result for architecture, result in json.loads(out.read_text()).items()})
    return found


@pytest.mark.parametrize("case", CASES, ids=["tp2", "tp2-layernorm", "tp2-tied", "tp2-sp-tied", "tp2-sp-layernorm", "tp2-qwen2", "tp2-llama3",
                                         "tp2-qwen3-qk-norm", "pp2", "tp2xpp2",
                                         "pp2-tied", "tp2xpp2-tied"])
def test_parallel_norms_and_update_match_one_backward_per_sequence(results, case):
    architecture, _ = case
    result = results[case]
    reference, engine = torch.tensor(result["reference"]), torch.tensor(result["engine"])
    assert result["sharded_params"] > 0 and result["replicated_params"] > 0  # both halves of the rule at work
    assert set(result["sequence_parallel"]) == {architecture.endswith("_sp")}  # the setting the name says
    assert reference.min() > 0 and len(set(result["reference"])) == 3
    assert ((engine - reference).abs() / reference).max() < 1e-12
    assert result["update_error"] < 1e-12  # the OPOB update Σ_i (c^R_i − b_γ(i) c^S_i) g_i of every local parameter
    # the same from a step of two micro-batches whose forwards and backwards interleave (a pipeline schedule's order)
    assert ((torch.tensor(result["step_engine"]) - reference).abs() / reference).max() < 1e-12
    assert result["step_update_error"] < 1e-12


def test_bf16_norms_and_update_are_within_autograds_own_bf16_error(results):
    """bf16 parameters (the float64 model's, rounded), TP 2, tied embeddings: the truth is the float64 loop; plain
    autograd in bf16 is not exact either, so the engine's error is measured against autograd's own."""
    result = results[BF16_CASE]
    truth = torch.tensor(result["reference"])

    def relative(values: list[float]) -> float:
        return float(((torch.tensor(values) - truth).abs() / truth).max())

    own = relative(result["autograd"])
    assert 1e-4 < own < 3e-2  # bf16 rounding at work, and still a gradient
    assert relative(result["engine"]) <= ERROR_RATIO * own
    assert result["update_error"] <= ERROR_RATIO * result["autograd_update_error"]


class _Unknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_what_it_cannot_count_is_refused():
    with pytest.raises(ValueError, match="tied across pipeline stages need the embedding group"):
        MegatronSequenceNorms(SimpleNamespace(config=None, pre_process=True, post_process=False, share_embeddings_and_output_weights=True))
    last_stage = nn.Module()
    last_stage.config, last_stage.pre_process, last_stage.post_process, last_stage.share_embeddings_and_output_weights = None, False, True, True
    last_stage.shared_embedding_or_output_weight = lambda: None
    with pytest.raises(ValueError, match="the last stage of embeddings tied across pipeline stages needs the input ids"):
        with MegatronSequenceNorms(last_stage, embedding_group=object()).recording(2):
            pass
    with pytest.raises(ValueError, match=r"module 'block' \(_Unknown\) has trainable parameter 'scale'"):
        MegatronSequenceNorms(nn.ModuleDict({"block": _Unknown()}))


def test_combine_wants_one_baseline_per_group():
    norms = MegatronSequenceNorms(nn.ModuleDict({"positions": nn.Embedding(4, 3)}))
    with norms.recording(3, torch.ones(3), torch.ones(3), groups=torch.tensor([5, 5, 2])):
        pass
    with pytest.raises(ValueError, match="constant within each group"):
        norms.combine(torch.tensor([0.1, 0.2, 0.3]))
    norms.combine(torch.tensor([0.1, 0.1, 0.3]))  # a parameter no sequence reached: zeros
    assert torch.equal(norms.model["positions"].weight.grad, torch.zeros(4, 3))
