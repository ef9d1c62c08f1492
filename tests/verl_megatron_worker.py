"""One rank of verl 0.9.1's Megatron engine on CPU (gloo): a tiny random Qwen2 split over tensor-parallel,
pipeline-parallel (or, with TP = PP = 1, data-parallel) ranks, built by verl (``MegatronEngineWithLMHead``
through mbridge, bf16, padded path) with the shims of `vcpo.verl_plugin.cpu.megatron`. For each of untied
and tied embeddings: one ``infer_batch`` (log-probs, against the HF model's own float32 log-probs of the
same sequences), one ``train_batch`` with verl's ``ppo_loss`` (a vcpo policy loss with no engine rule;
its loss and grad_norm against the same ``ppo_loss`` on the float32 HF model), then the log-probs again.

Run by ``python -m torch.distributed.run --nproc_per_node 2 tests/verl_megatron_worker.py TP PP OUT
[distributed_optimizer]`` (megatron's distributed optimizer instead of the plain bf16 one). The rank
holding the engine's outputs (tensor rank 0 of the last pipeline stage, data rank 0) writes the JSON to
``OUT``; a failing rank writes ``OUT.rank<R>.error.json`` and ends the job.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from pathlib import Path

from vcpo.verl_contract import select_cpu_platform

select_cpu_platform()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

B, GROUP, PROMPT, RESPONSE, VOCAB, MICRO = 8, 4, 6, 6, 96, 2


def reference_log_probs(model, raw) -> torch.Tensor:
    """The HF model's response log-probs of the batch's sequences (0 at padding), float64."""
    with torch.no_grad():
        logits = model(input_ids=raw.input_ids, attention_mask=raw.attention, position_ids=raw.position_ids).logits
    logits = logits[:, raw.prompt_width - 1 : -1].double()
    responses = raw.input_ids[:, raw.prompt_width :]
    lp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return torch.where(raw.response_mask, lp, torch.zeros_like(lp))


def engine_log_probs(engine, td) -> torch.Tensor | None:
    """``infer_batch`` (forward only) as the actor's compute_log_prob runs it; [b, R] on the output rank."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    data = td.clone()
    tu.assign_non_tensor(data, calculate_entropy=False)
    with engine.eval_mode():
        output = engine.infer_batch(data)
    if not engine.is_mp_src_rank_with_outputs():
        return None
    return no_padding_2_padding(output["model_output"]["log_probs"], td).double()


def reference_step(model, td, raw, loss_function) -> dict:
    """verl's ``ppo_loss`` on the HF model's float32 log-probs of the whole batch (one call: the loss is
    normalised by global batch quantities, so it is the sum of the engine's micro-batch losses), and the
    norm of its gradient."""
    from verl.utils import tensordict_utils as tu

    model.zero_grad(set_to_none=True)
    per_sequence = []
    for i in range(raw.input_ids.shape[0]):
        ids = raw.input_ids[i][raw.attention[i].bool()]
        logits = model(input_ids=ids[None]).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
        per_sequence.append(torch.cat([lp, lp.new_zeros(1)]))  # the engine's layout: label = next token
    data = td.clone()
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()))
    log_probs = torch.nested.as_nested_tensor(per_sequence, layout=torch.jagged)
    loss, _ = loss_function(model_output={"log_probs": log_probs}, data=data, dp_group=None)
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    return {"loss": float(loss), "grad_norm": float(grad_norm)}


def plain(value):
    """JSON-able form of the engine's metrics (verl ``Metric`` objects, tensors, lists)."""
    if hasattr(value, "aggregate"):
        return float(value.aggregate())
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def agreement(engine_lp: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> dict:
    diff = (engine_lp - reference).abs()[mask]
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean())}


def run(model_dir: Path, tensor: int, pipeline: int, distributed_optimizer: bool = False) -> dict:
    from transformers import AutoModelForCausalLM
    from verl.workers.utils.losses import ppo_loss

    from vcpo.verl_plugin.cpu import standalone

    engine = standalone.build_megatron_engine(
        model_dir,
        tensor_parallel=tensor,
        pipeline_parallel=pipeline,
        lr=1e-3,
        use_distributed_optimizer=distributed_optimizer,
    )
    # data parallelism (ranks beyond tensor x pipeline): each replica takes its share of the rows, as verl's
    # trainer dispatches them; global_batch_size and the token count stay those of the whole batch
    dp, dp_rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
    td, raw = standalone.actor_batch(B, GROUP, PROMPT, RESPONSE, VOCAB, remove_padding=False, micro=MICRO, rows=rows)
    whole, _ = standalone.actor_batch(B, GROUP, PROMPT, RESPONSE, VOCAB, remove_padding=False, micro=MICRO)
    # group-centred rewards as advantages (actor_batch's are zero, which would make the policy gradient zero)
    centred = raw.rewards - raw.rewards.view(-1, GROUP).mean(-1).repeat_interleave(GROUP)
    advantages = (centred[:, None] * raw.response_mask).to(td["advantages"].dtype)
    td["advantages"], whole["advantages"] = advantages[rows], advantages
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    reference = reference_log_probs(hf, raw)
    config = standalone.actor_config("seq_tis_c8", B, GROUP, MICRO, megatron_engine=engine)
    loss_function = functools.partial(ppo_loss, config=config)
    step_reference = reference_step(hf, whole, raw, loss_function)
    reference_bf16 = reference_log_probs(hf.to(torch.bfloat16), raw)

    before = engine_log_probs(engine, td)
    with engine.train_mode():
        out = engine.train_batch(td.clone(), loss_function)
    after = engine_log_probs(engine, td)
    if before is None or dp_rank != 0:
        return {}
    mask, reference, reference_bf16 = raw.response_mask[rows], reference[rows], reference_bf16[rows]
    metrics = {k: plain(v) for k, v in out["metrics"].items()}
    return {
        "tensor": tensor,
        "pipeline": pipeline,
        "data": dp,
        "log_probs": before.tolist(),
        "reference_fp32": reference.tolist(),
        "engine_vs_fp32": agreement(before, reference, mask),
        "hf_bf16_vs_fp32": agreement(reference_bf16, reference, mask),
        "after_step_vs_before": agreement(after, before, mask),
        "metrics": metrics,
        "grad_norm": float(metrics["grad_norm"]),
        "reference_fp32_step": step_reference,
        "module": [type(m).__name__ for m in engine.module],
        "sequence_parallel": engine.tf_config.sequence_parallel,
        "optimizer": type(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])[0]).__name__,
    }


def main(tensor: int, pipeline: int, out: str, distributed_optimizer: bool = False) -> None:
    dist.init_process_group("gloo")
    import vcpo.verl_plugin  # noqa: F401  (registers the vcpo policy losses)
    from vcpo.verl_plugin.cpu import standalone
    from vcpo.verl_plugin.cpu.megatron import enable_megatron_on_cpu

    enable_megatron_on_cpu()
    results = {}
    for tied in (False, True):
        name = "tied" if tied else "untied"
        model_dir = Path(out).parent / f"{Path(out).stem}_qwen2_{name}"
        if dist.get_rank() == 0:
            standalone.save_random_qwen2(
                model_dir, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, tie_word_embeddings=tied
            )
        dist.barrier()
        try:
            results[name] = run(model_dir, tensor, pipeline, distributed_optimizer)
        except Exception:  # a failing stage would leave its pipeline peer waiting: report, then end the job
            traceback.print_exc()
            results[name] = {"error": traceback.format_exc()[-4000:]}
            with open(f"{out}.rank{dist.get_rank()}.error.json", "w") as handle:
                json.dump(results, handle)
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(1)
    if all(results.values()):  # the output rank: tensor rank 0 of the last pipeline stage, data rank 0
        with open(out, "w") as handle:
            json.dump(results, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], "distributed_optimizer" in sys.argv[4:])
