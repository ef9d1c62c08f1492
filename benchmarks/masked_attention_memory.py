"""What PyTorch's CPU ``scaled_dot_product_attention`` keeps for its backward when it is given a mask, as HF's
``sdpa`` attention gives it for packed sequences (one row of several sequences, a block-diagonal causal mask).

A stack of ``layers`` attention calls over one (1, heads, T, 64) input runs forward and backward twice, in a fresh
process per point: with a boolean (T, T) mask, and with ``is_causal`` (no mask, what a GPU's varlen flash
attention amounts to). It prints the resident memory the forward keeps and the step's peak, both above the
memory before it, and the masked call's excess over the causal one per layer beside T² float32 bytes. The
memory model (`vcpo.actor_memory`) assumes fused attention, which keeps no (T, T) tensor; on
CPU, with packed sequences, this is what that assumption leaves out (docs/per_sequence_gradients.md, "Memory").

    python benchmarks/masked_attention_memory.py
    python benchmarks/masked_attention_memory.py --points 896:4:4,1792:4:4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from vcpo.resident_memory import MEASURING_ENV, reset_peak, status_bytes

DEFAULT_POINTS = "448:4:4,896:4:1,896:4:4,896:4:8,896:2:4,896:8:4,1792:4:4"  # tokens:heads:layers
HEAD_DIM = 64
POINT_TIMEOUT_S = 600  # a point takes seconds; a hung one fails the run by name


def measure(tokens: int, heads: int, layers: int, masked: bool) -> dict:
    """One point, in this (fresh) process: bytes the forward keeps and the peak of forward and backward."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    inputs = torch.randn(1, heads, tokens, HEAD_DIM, requires_grad=True)
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None] if masked else None
    before = reset_peak()
    hidden = inputs
    for _ in range(layers):
        hidden = F.scaled_dot_product_attention(hidden, hidden, hidden, attn_mask=mask, is_causal=not masked)
    kept = status_bytes("VmHWM") - before
    hidden.sum().backward()
    return {"kept": kept, "peak": status_bytes("VmHWM") - before}


def run_point(tokens: int, heads: int, layers: int, masked: bool) -> dict:
    env = {**os.environ, **MEASURING_ENV}
    done = subprocess.run([sys.executable, __file__, "--point", str(tokens), str(heads), str(layers), str(int(masked))],
                          env=env, capture_output=True, text=True, check=True, timeout=POINT_TIMEOUT_S)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default=DEFAULT_POINTS, help="tokens:heads:layers, comma-separated")
    parser.add_argument("--point", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.point:
        tokens, heads, layers, masked = args.point
        print(json.dumps(measure(tokens, heads, layers, bool(masked))))
        return
    from vcpo.provenance import code_state, cpu_name, utc_now

    state, started = code_state(), utc_now()
    print(f"# python benchmarks/masked_attention_memory.py --points {args.points}")
    print(f"# commit {state['commit']} (dirty: {state['dirty']}), {cpu_name()}, started {started}")
    megabyte = 1e6
    print("tokens heads layers | kept MB: mask causal | peak MB: mask causal | excess per layer MB: kept peak | T² float32 MB")
    for point in args.points.split(","):
        tokens, heads, layers = map(int, point.split(":"))
        masked, causal = run_point(tokens, heads, layers, True), run_point(tokens, heads, layers, False)
        excess = [(masked[key] - causal[key]) / layers / megabyte for key in ("kept", "peak")]
        print(f"{tokens:6d} {heads:5d} {layers:6d} | {masked['kept'] / megabyte:7.1f} {causal['kept'] / megabyte:6.1f} | "
              f"{masked['peak'] / megabyte:7.1f} {causal['peak'] / megabyte:6.1f} | {excess[0]:6.2f} {excess[1]:5.2f} | "
              f"{tokens * tokens * 4 / megabyte:6.2f}", flush=True)
    print(f"# finished {utc_now()}")


if __name__ == "__main__":
    main()
