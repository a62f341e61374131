"""
The CORE score of a GPT-2 model: the DCLM paper's 22 in-context tasks, scored as nanochat scores them, so
that the numbers compare with the published ones (GPT-2 124M 0.1139, 350M 0.1849, 774M 0.2146, 1.5B 0.2565).

    python evaluate.py --checkpoint log/                     # ours (a file, or the newest in a folder)
    python evaluate.py --init_from gpt2                      # OpenAI's GPT-2 124M (HF weights)
    python evaluate.py --checkpoint log --max_per_task 500 --json core.json
    torchrun --standalone --nproc_per_node=8 evaluate.py --init_from gpt2-xl   # split over 8 GPUs

The tasks come from DCLM's eval bundle, the eval_bundle.zip nanochat uses (downloaded once into
eval_bundle/ beside this file; --eval_bundle takes a folder or zip of the same layout): core.yaml lists
the tasks (icl_tasks: label, icl_task_type, dataset_uri, num_fewshot, continuation_delimiter),
eval_meta_data.csv gives each task's random baseline in percent, eval_data/ holds the examples, one JSON
object a line.

The protocol, nanochat's: a task's examples are shuffled with random.Random(1337) (--max_per_task keeps
the first N); example i's few-shot examples are drawn by random.Random(1234 + i).sample from the others;
each prompt is the few-shot blocks, each ending in a blank line, then the example, tokenized after an
<|endoftext|> and cut from the left to the model's context. A multiple-choice or schema example is right
when its answer has the lowest mean loss over the tokens its prompts do not share; a language-modelling one
when greedy decoding gives every token of its continuation. A task's accuracy is centered on its random
baseline r, (acc - r/100) / (1 - r/100); CORE is the mean over the tasks. The bundle's reading, the
rendering and the scoring are nanogpt/core_eval.py's, which the training loop's --core_every calls too.
"""

import json

from nanogpt.cli import INT_MAX, CLIParser, UserError, add_system_flags, add_weights_flags, run_cli
from nanogpt.core_eval import evaluate, load_tasks
from nanogpt.evaluation import evaluation_run, from_rank0, out_of_memory_said
from nanogpt.files import check_output_file, output_file
from nanogpt.tokenizer import get_tokenizer
from train_gpt2 import load_model, setup_distributed


def build_parser():
    p = CLIParser(description="CORE score (DCLM's 22 tasks, as nanochat scores them) of our checkpoint or of HF "
                              "GPT-2 weights.")
    add_weights_flags(p)
    p.add_argument("--eval_bundle", default=None,
                   help="DCLM's eval bundle, a folder or .zip holding core.yaml, eval_meta_data.csv and eval_data/ "
                        "(default: eval_bundle.zip, downloaded once into eval_bundle/ beside this script)")
    p.add_argument("--tasks", default=None, help="comma-separated labels of core.yaml's tasks to score (default: all)")
    p.add_argument("--max_per_task", type=int, default=None,
                   help="score only the first N of each task's shuffled examples (default: all)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the result to FILE: {\"core\": ..., \"tasks\": {label: {\"accuracy\", \"centered\", "
                        "\"shots\"}}}")
    p.add_argument("--batch_size", type=int, default=None,
                   help="prompts per forward pass (default: 32 on cuda, 8 elsewhere)")
    add_system_flags(p, dtype_default="fp32", compile_help="default: on for CUDA, off elsewhere",
                     dtype_help="autocast dtype: fp32 is exact; bf16 is what the training loop uses; auto = bf16 on CUDA "
                                "GPUs that have it, else fp16; fp32 on cpu/mps")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("checkpoint", "init_from", "eval_bundle", "tasks", "json", "device"):
        if getattr(args, name) == "":
            raise UserError(f"--{name} is empty; see --help")
    for name in ("batch_size", "max_per_task"):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= INT_MAX:
            raise UserError(f"--{name} {value}: must be a whole number from 1 to {INT_MAX}")
    if args.tasks is not None:
        args.tasks = [label.strip() for label in args.tasks.split(",")]
        if not all(args.tasks):
            raise UserError("--tasks: give comma-separated task labels (from core.yaml), without empty ones")
    if args.json is not None:  # here, not after the scoring it would throw away
        check_output_file(args.json, "--json")
    return args


def table(result):
    """The result as the lines printed: a row per task, then CORE."""
    width = max([len("task"), *(len(label) for label in result["tasks"])])
    lines = [f"{'task':<{width}}  shots  accuracy  centered  seconds"]
    for label, r in result["tasks"].items():
        lines.append(f"{label:<{width}}  {r['shots']:5d}  {r['accuracy']:8.4f}  {r['centered']:8.4f}  {r['seconds']:7.1f}")
    lines.append(f"{'CORE':<{width}}  {'':5}  {'':8}  {result['core']:8.4f}")
    return "\n".join(lines)


def write_json(path, result):
    """The contract's JSON, written as files.output_file writes: through a temporary twin (an interrupted write
    leaves the old file), the file a link points to; a FIFO or device in place."""
    out = {"core": result["core"], "tasks": {label: {key: r[key] for key in ("accuracy", "centered", "shots")}
                                             for label, r in result["tasks"].items()}}
    try:
        with output_file(path, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise UserError(f"cannot write --json {path} ({e.strerror or e}); give another file") from None


def main(argv=None):
    args = parse_args(argv)
    with evaluation_run(args, setup_distributed, load_model) as run:  # torchrun: one share per process
        tasks = from_rank0(lambda: load_tasks(args.eval_bundle, args.tasks, args.max_per_task), run.ddp, run.rank,
                           run.device)
        if run.master:
            print(f"{len(tasks)} tasks, {sum(len(t.examples) for t in tasks)} examples | {run.header}")
        batch = args.batch_size or (32 if run.device_type == "cuda" else 8)
        with out_of_memory_said(run.device, f"{batch} prompts per pass"), run.autocast:
            result = evaluate(run.model, tasks, get_tokenizer(), run.device, run.rank, run.world_size, args.batch_size,
                              progress=run.master)
        if run.master:
            print(table(result))
            if args.json is not None:
                write_json(args.json, result)
                print(f"wrote {args.json}")
        return result


if __name__ == "__main__":
    run_cli(main)
