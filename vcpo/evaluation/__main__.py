"""python -m vcpo.evaluation --model PATH --benchmarks gsm8k,math500 --out DIR [options]

Samples n completions per problem (vLLM on GPU machines, transformers otherwise), scores them with
vcpo.rewards under both answer formats (strict: the format the prompt asks for; lenient: also a bare
final number) and writes per-sample jsonl and mean@n / pass@k summaries (see vcpo.evaluation.harness).
With --tool-config the completions are multi-turn tool dialogues sampled as verl's tool agent loop
samples them in training (SimpleTIR checkpoints; see vcpo.evaluation.tool_use).
"""

import argparse
import logging
import sys
from pathlib import Path

from verl.experimental.agent_loop.tool_parser import ToolParser

from vcpo.cli import output_folder_problem
from vcpo.evaluation import BACKENDS, run_evaluation
from vcpo.evaluation.generation import is_hub_id
from vcpo.evaluation.harness import SUMMARY_FILE, EvaluationInputError
from vcpo.evaluation.tool_use import EVAL_OPTIONS, TRUNCATE_SIDES, ToolUse, verl_multi_turn_defaults
from vcpo.recipes import recipes_dir
from vcpo.rewards import ANSWER_FORMATS
from vcpo.runs import CONFIG_FILE, verl_hf_checkpoint
from vcpo.upstream import require

BENCHMARKS_FILE = recipes_dir() / "benchmarks.yaml"  # the paper's sampling settings per benchmark


# Over 80 lines as one parser: the command's flags with their help, which a reader looks up in one place.
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vcpo.evaluation", description=__doc__.split("\n\n")[1])
    parser.add_argument(
        "--model",
        required=True,
        help="checkpoint directory (Hugging Face format); a verl run folder or checkpoint folder (its last "
        "checkpoint's Hugging Face weights); or a hub id (org/name) of a base model",
    )
    parser.add_argument("--benchmarks", required=True, help="comma-separated names from --benchmarks-file")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier evaluation in --out (without it, "
                        "an interrupted one in --out is resumed where it stopped)")
    parser.add_argument("--benchmarks-file", type=Path, default=BENCHMARKS_FILE)
    parser.add_argument("--n", type=int, help="samples per problem (default: per benchmark)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--limit", type=int, help="evaluate only the first K problems of each benchmark")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--source-dir", type=Path, help="local benchmark files (<benchmark>/<split>.jsonl) instead of the hub")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (transformers backend)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--answer-format",
        choices=ANSWER_FORMATS,
        help="primary answer format of the summaries (default: per benchmark, strict); both are always scored",
    )
    verl_defaults = verl_multi_turn_defaults()
    tools = parser.add_argument_group(
        "multi-turn tool use", "as verl's actor_rollout_ref.rollout.multi_turn samples in training; defaults are verl's"
    )
    tools.add_argument(EVAL_OPTIONS["tool_config"], type=Path, help="verl tool config YAML: evaluate with these tools")
    tools.add_argument(EVAL_OPTIONS["max_turns"], type=int, help="assistant turns per response (required with tools)")
    tools.add_argument(
        EVAL_OPTIONS["max_tool_response_length"], type=int, default=verl_defaults["max_tool_response_length"]
    )
    tools.add_argument(
        EVAL_OPTIONS["tool_response_truncate_side"],
        choices=TRUNCATE_SIDES,
        default=verl_defaults["tool_response_truncate_side"],
    )
    tools.add_argument(EVAL_OPTIONS["max_parallel_calls"], type=int, default=verl_defaults["max_parallel_calls"])
    require("tool_parsers")
    tools.add_argument(
        EVAL_OPTIONS["tool_parser"], default=verl_defaults["format"], choices=sorted(ToolParser._registry)
    )
    args = parser.parse_args(argv)
    args.tool_use = None
    if args.tool_config is not None:
        if args.max_turns is None:
            parser.error(f"{EVAL_OPTIONS['tool_config']} needs {EVAL_OPTIONS['max_turns']}")
        try:
            args.tool_use = ToolUse(
                args.tool_config,
                args.max_turns,
                args.max_tool_response_length,
                args.tool_response_truncate_side,
                args.max_parallel_calls,
                args.tool_parser,
            )
        except (ValueError, FileNotFoundError) as error:
            parser.error(str(error))
    elif args.max_turns is not None:
        parser.error(f"{EVAL_OPTIONS['max_turns']} needs {EVAL_OPTIONS['tool_config']}")
    args.benchmark_names = [name.strip() for name in args.benchmarks.split(",") if name.strip()]
    if not args.benchmark_names:
        parser.error(f"--benchmarks: no benchmark named (comma-separated names of {args.benchmarks_file})")
    model = Path(args.model)
    if model.exists() and not (model / CONFIG_FILE).is_file():
        checkpoint = verl_hf_checkpoint(model)
        if checkpoint is None:
            parser.error(f"--model {model}: not a model folder (no {CONFIG_FILE}), nor a verl run folder or checkpoint "
                         "with Hugging Face weights (checkpoints/global_step_N/actor/huggingface)")
        print(f"--model {model}: evaluating {checkpoint}", file=sys.stderr)
        args.model = str(checkpoint)
    if not model.exists() and not is_hub_id(args.model):
        parser.error(f"--model {args.model}: no such folder (and not a hub id, which reads org/name)")
    if (args.out / SUMMARY_FILE).exists() and not args.overwrite:
        parser.error(f"--out {args.out} holds an earlier evaluation ({SUMMARY_FILE}): pass --overwrite to replace it, "
                     "or choose another --out")
    if args.source_dir is not None and not args.source_dir.is_dir():
        parser.error(f"--source-dir {args.source_dir}: no such folder")
    if problem := output_folder_problem(args.out):
        parser.error(f"--out {args.out}: {problem}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        summary = evaluate(args)
    except EvaluationInputError as error:  # found before any model is loaded
        print(f"error: {error}", file=sys.stderr)
        return 2
    for name, result in summary["results"].items():
        n = result["sampling"]["n"]
        for answer_format, metrics in result["by_answer_format"].items():
            pass_at_k = ", ".join(f"pass@{k} {value:.3f}" for k, value in metrics["pass_at_k"].items())
            primary = " (primary)" if answer_format == result["answer_format"] else ""
            print(f"{name} [{answer_format}{primary}]: mean@{n} {metrics['mean_at_n']:.3f}, {pass_at_k}")
    return 0


def evaluate(args: argparse.Namespace) -> dict:
    return run_evaluation(
        args.model,
        args.benchmark_names,
        args.out,
        benchmarks_file=args.benchmarks_file,
        sampling_overrides={
            "n": args.n,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens,
        },
        backend=args.backend,
        limit=args.limit,
        source_dir=args.source_dir,
        batch_size=args.batch_size,
        seed=args.seed,
        answer_format=args.answer_format,
        tool_use=args.tool_use,
        resume=not args.overwrite,
    )


if __name__ == "__main__":
    sys.exit(main())
