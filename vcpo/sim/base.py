"""Tiny Qwen2 base models for the simulator, warm-started by supervised fine-tuning and cached on disk.

``sft_base(task, size)`` trains a byte-level BPE tokenizer on the task's train split (prompts and
solutions, with Qwen's chat special tokens), builds a randomly initialised ``Qwen2ForCausalLM`` of
``MODEL_SIZES[size]``, fine-tunes it on the train split (loss on the assistant tokens only, the
closing ``<|im_end|>`` included, so that the model learns to stop) and saves model, tokenizer and
``sft_info.json`` under ``<cache_dir>/sft-<task>-<size>-seed<seed>-<hash>/``. The hash covers every
setting and the library versions, so a changed setting or library gives a new folder; an existing
folder is returned without training (it is written to a temporary folder and renamed into place).

The SFT is deliberately short: RL must start from a base that solves some but not most held-out
problems when sampling at temperature 1 (the target is 10-40%), so that there is both a reward
signal from the first step and room to improve.

The accuracy each task's base reaches, and what its step count was chosen from: docs/simulator.md
("SFT bases: what they reach").

    python -m vcpo.sim.base --task countdown --size tiny [--seed S] [--cache-dir D] [--steps N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from vcpo.lifetimes import die_with_the_named_runner
from vcpo.local_models import IM_END, IM_START, build_random_model, build_tokenizer
from vcpo.locks import cache_dir as default_cache_dir
from vcpo.locks import cache_entry_lock
from vcpo.sim.heldout import heldout_accuracy
from vcpo.sim.rollout import SIM_TOOL_TIMEOUT_S, TOOL_OUTPUT, sandbox_tool, tool_output_ids
from vcpo.sim.tasks import SIM_TASKS, SimTask, get_sim_task, render_prompt
from vcpo.tools.sandbox import SandboxUnavailableError

# Bump when the SFT procedure changes in a way the settings below do not capture: it changes every hash.
SFT_VERSION = 2  # 2: every base trains on SFT_THREADS (a cached base of 1 may have trained on more)
INFO_FILE = "sft_info.json"

# hidden, layers, heads, kv_heads, intermediate: the Qwen2 dimensions; vocab: the BPE vocabulary;
# lr, batch_size, steps: the SFT defaults for the size (steps per task may differ, see SFT_STEPS).
MODEL_SIZES: dict[str, dict] = {
    # ~0.6M parameters: CI, smoke tests, the study's many runs on CPU.
    "tiny": {
        "hidden": 128,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 512,
        "vocab": 512,
        "lr": 2e-3,
        "batch_size": 32,
        "steps": 800,
    },
    # ~10M parameters.
    "small": {
        "hidden": 256,
        "layers": 10,
        "heads": 8,
        "kv_heads": 4,
        "intermediate": 1024,
        "vocab": 512,
        "lr": 1e-3,
        "batch_size": 32,
        "steps": 800,
    },
    # ~100M parameters (Qwen2-like proportions: head dim 64, 3 query heads per key-value head).
    "100m": {
        "hidden": 768,
        "layers": 12,
        "heads": 12,
        "kv_heads": 4,
        "intermediate": 3072,
        "vocab": 512,
        "lr": 3e-4,
        "batch_size": 32,
        "steps": 800,
    },
}
# (task, size) -> SFT steps, where the size's default does not fit the task.
SFT_STEPS: dict[tuple[str, str], int] = {("arithmetic", "tiny"): 600, ("arithmetic_long", "tiny"): 500}
EVAL_PROBLEMS = 200
# Digits as single tokens, never merged with a space (as Qwen2 tokenizes): a number reads the same in
# the prompt and in the answer, which a tiny model must copy.
SPLIT_DIGITS = True
WARMUP_FRACTION = 0.05


def model_size(size: str) -> dict:
    try:
        return MODEL_SIZES[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; known: {', '.join(MODEL_SIZES)}") from None


def sft_settings(
    task: str | SimTask, size: str = "tiny", *, seed: int = 0, steps: int | None = None, device: str = "cpu"
) -> dict:
    """Everything that determines the SFT base, library versions included (the cache key)."""
    import reasoning_gym
    import tokenizers
    import transformers

    sim_task = _sim_task(task)
    dims = model_size(size)
    return {
        "task": sim_task.settings(),
        "size": size,
        "dims": dims,
        "seed": seed,
        "device": device,
        "steps": steps if steps is not None else SFT_STEPS.get((sim_task.name, size), dims["steps"]),
        "warmup_fraction": WARMUP_FRACTION,
        "split_digits": SPLIT_DIGITS,
        "eval_problems": EVAL_PROBLEMS,
        "eval_max_new_tokens": sim_task.max_response_tokens,
        "sft_version": SFT_VERSION,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "reasoning_gym": reasoning_gym.__version__,
        },
    }


# A base trained on the CPU depends on the thread count (the order of floating-point reductions:
# recipes/sim/evidence.md measured Countdown seed 0 at 21.5% on one thread, 21.0% on two), so every base
# trains on one thread: the same base whatever cores its builder had.
SFT_THREADS = 1


def sft_base(
    task: str | SimTask,
    size: str = "tiny",
    *,
    seed: int = 0,
    cache_dir: Path | None = None,
    steps: int | None = None,
    progress: bool = True,
    device: str = "cpu",
) -> Path:
    """The folder of the SFT base of ``task`` and ``size`` (loadable with ``from_pretrained``), trained
    on first use and cached. ``task``: a name in ``vcpo.sim.tasks.SIM_TASKS``, or a task itself (e.g. one
    with smaller splits, for tests). ``steps`` overrides the default number of SFT steps. ``device``: where
    to train (e.g. "cuda" for the larger sizes); another device gives another base, with its own folder."""
    sim_task = _sim_task(task)
    settings = sft_settings(task, size, seed=seed, steps=steps, device=device)
    if settings["steps"] < 1:
        raise ValueError(f"sft_base: steps must be >= 1, got {settings['steps']}")
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / f"sft-{sim_task.name}-{size}-seed{seed}-{digest}"
    if (path / INFO_FILE).exists() and (problem := damage(path)) is None:
        return path
    with cache_entry_lock(path):  # one builder per base: a second one waits, then finds it built
        if (path / INFO_FILE).exists() and (problem := damage(path)) is not None:
            print(f"SFT base {path} is damaged ({problem}): building it again", file=sys.stderr)
            shutil.rmtree(path)
        if not (path / INFO_FILE).exists():
            _build_base(path, sim_task, size, seed, settings, progress, device)
    return path


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a base folder but its info file (which records them)."""
    return {file.name: hashlib.sha256(file.read_bytes()).hexdigest() for file in sorted(Path(folder).iterdir())
            if file.is_file() and file.name != INFO_FILE}


def damage(folder: Path) -> str | None:
    """What differs from the files a base was built with (None: intact). A base cached before its files
    were recorded is taken as it is."""
    try:
        recorded = json.loads((Path(folder) / INFO_FILE).read_text()).get("files")
    except (OSError, json.JSONDecodeError) as error:
        return f"{INFO_FILE} unreadable: {error}"
    if recorded is None:
        return None
    now = file_digests(folder)
    changed = sorted(name for name in recorded if now.get(name) != recorded[name])
    return f"{', '.join(changed)}: missing or changed" if changed else None


def _build_base(path: Path, sim_task: SimTask, size: str, seed: int, settings: dict, progress: bool, device: str) -> None:
    root = path.parent
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".{path.name}.{os.getpid()}.tmp"
    shutil.rmtree(partial, ignore_errors=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(SFT_THREADS)
        model, tokenizer, info = train_sft(
            sim_task, size, seed=seed, steps=settings["steps"], progress=progress, device=device
        )
        info["settings"] = settings
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        info["files"] = file_digests(partial)  # checked at every use: a damaged base is rebuilt, never loaded
        (partial / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        partial.rename(path)  # atomic: a folder at ``path`` is always complete
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(partial, ignore_errors=True)


def _sim_task(task: str | SimTask) -> SimTask:
    return task if isinstance(task, SimTask) else get_sim_task(task)


def chat_text(prompt: str, solution: str) -> str:
    """One whole conversation as the chat template writes it (the tokenizer's training text)."""
    return f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n{solution}{IM_END}\n"


def task_tokenizer(sim_task: SimTask, vocab_size: int, *, seed: int = 0):
    """The byte-level BPE tokenizer of a base: merges learned from the task's train conversations."""
    corpus = [chat_text(problem.prompt, problem.solution) for problem in sim_task.problems("train")]
    return build_tokenizer(vocab_size, seed=seed, corpus=corpus, split_digits=SPLIT_DIGITS)


def train_sft(sim_task: SimTask, size: str, *, seed: int, steps: int, progress: bool = True, device: str = "cpu"):
    """``(model, tokenizer, info)``: a fresh tokenizer and model of ``size``, fine-tuned on the train split."""
    # the held-out evaluation's tool (multi-turn tasks) with the simulator's default timeout; made first, so that a
    # machine that cannot run the sandbox is told so before the fine-tuning, not after it
    tool = {"tool": sandbox_tool(SIM_TOOL_TIMEOUT_S), "max_turns": sim_task.max_turns} if sim_task.max_turns else {}
    started, cpu_started = time.perf_counter(), time.process_time()
    dims = model_size(size)
    train = sim_task.problems("train")
    tokenizer = task_tokenizer(sim_task, dims["vocab"], seed=seed)
    model = build_random_model(
        tokenizer,
        hidden_size=dims["hidden"],
        num_layers=dims["layers"],
        num_heads=dims["heads"],
        num_kv_heads=dims["kv_heads"],
        intermediate_size=dims["intermediate"],
        seed=seed,
    ).to(device)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    examples = [(tokenizer.encode(render_prompt(tokenizer, problem), add_special_tokens=False),
                 *solution_tokens(tokenizer, problem.solution, im_end)) for problem in train]
    losses = _fine_tune(model, examples, tokenizer.pad_token_id, dims, steps=steps, seed=seed, device=device,
                        progress_label=f"SFT {sim_task.name}/{size}" if progress else None)
    train_seconds, train_cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started

    model.eval()
    if tool:  # the multi-turn sampler (vcpo.sim.rollout) runs on the CPU, as the simulator does
        model = model.cpu()
    heldout = _heldout(model, tokenizer, sim_task, seed, tool)
    prompt_tokens = [len(prompt) for prompt, *_ in examples]
    info = {
        "task": sim_task.name,
        "size": size,
        "seed": seed,
        "steps": steps,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        "heldout_accuracy": heldout["temperature_1"]["mean_at_n"],
        "heldout_accuracy_greedy": heldout["greedy"]["mean_at_n"],
        **({"heldout_accuracy_no_tool": heldout["temperature_1_no_tool"]["mean_at_n"]} if tool else {}),
        "heldout": heldout,
        "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens),
        "max_prompt_tokens": max(prompt_tokens),
        "sft_seconds": train_seconds,  # tokenizer, tokenization and training (wall clock)
        "sft_cpu_seconds": train_cpu_seconds,  # the same in CPU time of this process (all threads)
        "seconds": time.perf_counter() - started,  # the held-out evaluation included
        "cpu_seconds": time.process_time() - cpu_started,
        "threads": torch.get_num_threads(),
        "device": device,
    }
    return model.cpu(), tokenizer, info


def _fine_tune(model, examples: list, pad_token_id: int, dims: dict, *, steps: int, seed: int, device: str,
               progress_label: str | None) -> list[float]:
    """``steps`` AdamW steps of the SFT loss on batches of ``examples`` drawn in seeded epochs (warm-up, then a
    cosine decay to a tenth of the size's rate); the loss of every step."""
    from tqdm.auto import tqdm

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=dims["lr"], betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, round(WARMUP_FRACTION * steps))

    def lr_factor(step: int) -> float:  # linear warmup, cosine decay to a tenth
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    order: list[int] = []
    losses: list[float] = []
    bar = tqdm(range(steps), desc=progress_label, disable=progress_label is None, unit="step", mininterval=2.0)
    for _ in bar:
        if len(order) < dims["batch_size"]:
            order += torch.randperm(len(examples), generator=generator).tolist()
        batch = [examples[index] for index in order[: dims["batch_size"]]]
        del order[: dims["batch_size"]]
        input_ids, labels, attention_mask = (tensor.to(device) for tensor in _collate(batch, pad_token_id))
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        # refresh=False: redrawn every mininterval like the count, not every step (a log file's size).
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", refresh=False)
    return losses


def _heldout(model, tokenizer, sim_task: SimTask, seed: int, tool: dict) -> dict:
    """The base's held-out accuracy on the first EVAL_PROBLEMS validation problems, sampled at T = 1 and greedy; with
    a tool, sampled at T = 1 without it too (does the tool matter?)."""
    validation = sim_task.problems("validation")[:EVAL_PROBLEMS]
    heldout = {"temperature_1": heldout_accuracy(model, tokenizer, sim_task, validation, temperature=1.0, seed=seed, **tool),
               "greedy": heldout_accuracy(model, tokenizer, sim_task, validation, temperature=0.0, seed=seed, **tool)}
    if tool:
        heldout["temperature_1_no_tool"] = heldout_accuracy(model, tokenizer, sim_task, validation, temperature=1.0, seed=seed)
    return heldout


def solution_tokens(tokenizer, solution: str, im_end: int) -> tuple[list[int], list[bool]]:
    """A solution's tokens as a rollout holds them, closing ``<|im_end|>`` included, and which of them the
    SFT loss trains: a tool output (``<output>...</output>``) is tokenized on its own as the rollout appends
    it, and, not being the policy's, is not trained."""
    ids, trained = [], []
    for piece in TOOL_OUTPUT.split(solution):
        output = TOOL_OUTPUT.fullmatch(piece) is not None
        piece_ids = tool_output_ids(tokenizer, piece[len("<output>") : -len("</output>")]) if output else (
            tokenizer.encode(piece, add_special_tokens=False))  # fmt: skip
        ids += piece_ids
        trained += [not output] * len(piece_ids)
    return ids + [im_end], trained + [True]


def _collate(batch: list[tuple[list[int], list[int], list[bool]]], pad_id: int):
    """Right-padded ``input_ids``, ``labels`` (-100 outside the trained response tokens) and ``attention_mask``."""
    width = max(len(prompt) + len(response) for prompt, response, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (prompt, response, trained) in enumerate(batch):
        ids = prompt + response
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, len(prompt) : len(ids)] = torch.where(torch.tensor(trained), torch.tensor(response), -100)
        attention_mask[row, : len(ids)] = 1
    return input_ids, labels, attention_mask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vcpo.sim.base", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="countdown", choices=sorted(SIM_TASKS))
    parser.add_argument("--size", default="tiny", choices=list(MODEL_SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=None, help="SFT steps (default: the size's and task's)")
    args = parser.parse_args(argv)
    die_with_the_named_runner()  # a study's runner, however many processes lie between
    try:
        path = sft_base(args.task, args.size, seed=args.seed, cache_dir=args.cache_dir, steps=args.steps)
    except SandboxUnavailableError as error:
        raise SystemExit(f"error: {error}") from None
    info = json.loads((path / INFO_FILE).read_text())
    print(path)
    print(
        f"held-out accuracy (T=1): {info['heldout_accuracy']:.3f}  greedy: {info['heldout_accuracy_greedy']:.3f}  "
        f"SFT {info['steps']} steps in {info['sft_seconds']:.0f} s, final loss {info['final_loss']:.3f}"
    )


if __name__ == "__main__":
    main()
