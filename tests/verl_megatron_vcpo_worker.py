"""One rank of tests/test_verl_megatron_engine.py: one VCPO actor step (ESS step size and OPOB), then one tis_ess step (the ESS step size alone), of the vcpo
Megatron engine (`vcpo.verl_plugin.engine.megatron`) inside verl 0.9.1's Megatron engine on CPU (gloo, bf16,
padded path, the shims of `vcpo.verl_plugin.cpu.megatron`), on the model and batch the test gives the FSDP
engine. Run by ``python -m torch.distributed.run --nproc_per_node N THIS TP PP MODEL_DIR OUT [distributed_optimizer]``
(megatron's distributed optimizer, its state sharded over the data-parallel ranks): N / (TP x PP) data-parallel
ranks, each with its share of the batch's rows; the first rank holding the engine's outputs (tensor rank 0 of the
last pipeline stage, data-parallel rank 0) writes the steps' metrics to OUT.
"""

from __future__ import annotations

import functools
import json
import sys

import torch.distributed as dist

from vcpo.verl_contract import select_cpu_platform

# the test's batch: 8 sequences in prompt groups of 4, micro-batches of 2
B, GROUP, PROMPT, RESPONSE, VOCAB, MICRO = 8, 4, 6, 6, 96, 2
METHODS = ("vcpo", "tis_ess")  # ESS step size and OPOB; then the ESS step size alone
TWO_PASS = "vcpo[two_pass]"  # the vcpo step again, from the same initial weights, in OPOB's two-pass mode


def scalars(metrics: dict) -> dict[str, float]:
    """The step's one-value metrics (the engine logs them as one-element lists; the optimizer's grad_norm as a number)."""
    values = {name: value[0] if isinstance(value, list) and len(value) == 1 else value for name, value in metrics.items()}
    return {name: float(value) for name, value in values.items() if isinstance(value, (int, float))}


def main(tensor: int, pipeline: int, model_dir: str, out: str, distributed_optimizer: bool = False) -> None:
    select_cpu_platform()  # before verl is imported (the test imports this module for its constants only)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as mpu
    from verl.workers.utils.losses import ppo_loss

    import vcpo.verl_plugin  # noqa: F401  (the vcpo policy losses)
    from vcpo.verl_contract import ENGINE_MODEL_TYPE
    from vcpo.verl_plugin.cpu import standalone

    data_parallel = dist.get_world_size() // (tensor * pipeline)

    def build():
        return standalone.build_megatron_engine(model_dir, tensor_parallel=tensor, pipeline_parallel=pipeline, lr=1e-3,
                                                model_type=ENGINE_MODEL_TYPE, use_distributed_optimizer=distributed_optimizer)

    engine, steps = build(), {}
    # one step each, in turn, on the same batch; then the first again on a new engine in two_pass mode
    for name, method, mode in (*((method, method, "single") for method in METHODS), (TWO_PASS, "vcpo", "two_pass")):
        if name == TWO_PASS:
            engine = build()
        share = B // data_parallel
        rows = slice(mpu.get_data_parallel_rank() * share, (mpu.get_data_parallel_rank() + 1) * share)
        td, _ = standalone.actor_batch(B, GROUP, PROMPT, RESPONSE, VOCAB, remove_padding=False, micro=MICRO, rows=rows)
        config = standalone.actor_config(method, B, GROUP, MICRO, megatron_engine=engine, opob_mode=mode)
        with engine.train_mode():
            outputs = engine.train_batch(td, functools.partial(ppo_loss, config=config))
        if engine.is_mp_src_rank_with_outputs():  # the other ranks get no outputs
            steps[name] = scalars(outputs["metrics"])
    if engine.is_mp_src_rank_with_outputs() and mpu.get_data_parallel_rank() == 0:
        config = engine.tf_config
        with open(out, "w") as handle:
            json.dump({"engine": type(engine).__name__, "steps": steps, "data_parallel": mpu.get_data_parallel_world_size(),
                       "transformer_impl": config.transformer_impl, "recompute_granularity": config.recompute_granularity,
                       "sequence_parallel": config.sequence_parallel,
                       "optimizers": [type(inner).__name__ for inner in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])]},
                      handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], distributed_optimizer=sys.argv[5:] == ["distributed_optimizer"])
