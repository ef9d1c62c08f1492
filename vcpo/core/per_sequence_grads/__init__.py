"""Exact per-sequence gradient norms and the single-backward OPOB update (VCPO §3.4, Alg. 1, App. C), in rooms:
`gradients` (`PerSequenceGradients`: the norms and the coefficient combinations from one backward, and how to use it),
`sites` (one per parameterised module, and the per-micro-batch accumulator), `functions` (the autograd functions that
hand a module's parameter gradient to its site), `reductions` (the math as pure functions, and the combinations' names)
and `megatron` (the same norms for megatron-core's layers under tensor and pipeline parallelism)."""
