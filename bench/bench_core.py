"""
Time evaluate.py's CORE, task by task, on a synthetic eval bundle shaped like DCLM's: its 22 tasks with
their types, few-shot counts, delimiters and random baselines, and examples of random words about as
long as the real tasks' (the lengths below are estimates; the real bundle was not at hand). A randomly
initialised model scores like chance, but the time depends only on the shapes. Not a test.

    python bench/bench_core.py --model tiny --max_per_task 50     # the tiny preset (context 256)
    python bench/bench_core.py --model d12 --max_per_task 11      # GPT-2 124M's shape (context 1024)
    python bench/bench_core.py --model d12 --device cuda --dtype bf16 --max_per_task 500   # the loop's default
"""

import argparse
import csv
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanogpt import core_eval  # noqa: E402
from train_gpt2 import MODEL_PRESETS, GPT, GPTConfig, autocast_context, get_tokenizer, pick_device  # noqa: E402

# label, icl_task_type, shots, delimiter, random baseline (%), words of the query or context, choices (multiple
# choice; schema: context options), words of each choice (schema: of each option), words of the continuation
CORE_TASKS = [
    ("hellaswag_zeroshot", "multiple_choice", 0, " ", 25, 45, 4, 20, 0),
    ("jeopardy", "language_modeling", 10, "\nAnswer: ", 0, 25, 0, 0, 2),
    ("bigbench_qa_wikidata", "language_modeling", 10, " ", 0, 8, 0, 0, 2),
    ("arc_easy", "multiple_choice", 10, "\nAnswer: ", 25, 25, 4, 5, 0),
    ("arc_challenge", "multiple_choice", 10, "\nAnswer: ", 25, 30, 4, 6, 0),
    ("copa", "multiple_choice", 0, " ", 50, 10, 2, 7, 0),
    ("commonsense_qa", "multiple_choice", 10, " ", 20, 14, 5, 2, 0),
    ("piqa", "multiple_choice", 10, "\nAnswer: ", 50, 10, 2, 20, 0),
    ("openbook_qa", "multiple_choice", 0, " ", 25, 12, 4, 4, 0),
    ("lambada_openai", "language_modeling", 0, " ", 0, 75, 0, 0, 1),
    ("hellaswag", "multiple_choice", 10, " ", 25, 45, 4, 20, 0),
    ("winograd", "schema", 0, " ", 50, 0, 2, 10, 7),
    ("winogrande", "schema", 0, " ", 50, 0, 2, 14, 6),
    ("bigbench_dyck_languages", "language_modeling", 10, " ", 0, 25, 0, 0, 4),
    ("agi_eval_lsat_ar", "multiple_choice", 3, " ", 20, 180, 5, 12, 0),
    ("bigbench_cs_algorithms", "language_modeling", 10, " ", 0, 25, 0, 0, 1),
    ("bigbench_operators", "language_modeling", 10, " ", 0, 20, 0, 0, 1),
    ("bigbench_repeat_copy_logic", "language_modeling", 10, " ", 0, 15, 0, 0, 12),
    ("squad", "language_modeling", 10, " ", 0, 140, 0, 0, 3),
    ("coqa", "language_modeling", 0, " ", 0, 280, 0, 0, 3),
    ("boolq", "multiple_choice", 10, "\nAnswer: ", 62, 110, 2, 1, 0),
    ("bigbench_language_identification", "multiple_choice", 10, " ", 9.1, 18, 11, 1, 0),
]
WORDS = ("the a man woman people dog is are was then he she they it with on in into over of to and which "
         "water ball table kitchen field camera paint wall floor knife bowl red blue green city river year").split()


def synthetic_example(rng, kind, query, choices, choice_words, continuation):
    def words(n):
        return " ".join(rng.choice(WORDS) for _ in range(max(1, round(n * rng.uniform(0.7, 1.3)))))

    if kind == "multiple_choice":
        return {"query": words(query), "choices": [words(choice_words) for _ in range(choices)],
                "gold": rng.randrange(choices)}
    if kind == "schema":
        return {"context_options": [words(choice_words) for _ in range(choices)], "continuation": words(continuation),
                "gold": rng.randrange(choices)}
    return {"context": words(query), "continuation": words(continuation)}


def write_synthetic_bundle(folder, examples_per_task, seed=0):
    """DCLM's layout: core.yaml, eval_meta_data.csv, eval_data/<label>.jsonl."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "eval_data"))
    with open(os.path.join(folder, "core.yaml"), "w") as f:
        f.write("icl_tasks:\n")
        for label, kind, shots, delimiter, *_ in CORE_TASKS:
            f.write(f"- label: {label}\n  dataset_uri: {label}.jsonl\n  num_fewshot: [{shots}]\n"
                    f"  icl_task_type: {kind}\n  continuation_delimiter: {json.dumps(delimiter)}\n")
    with open(os.path.join(folder, "eval_meta_data.csv"), "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["Eval Task", "Random baseline"])
        rows.writerows((task[0], task[4]) for task in CORE_TASKS)
    for label, kind, _, _, _, *shape in CORE_TASKS:
        with open(os.path.join(folder, "eval_data", f"{label}.jsonl"), "w") as f:
            for _ in range(examples_per_task):
                f.write(json.dumps(synthetic_example(rng, kind, *shape)) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS))
    p.add_argument("--block_size", type=int, default=None,
                   help="the model's context (default: 256 for tiny, its preset's --seq_len; 1024 otherwise)")
    p.add_argument("--max_per_task", type=int, default=50)
    p.add_argument("--tasks", default=None, help="comma-separated labels (default: all 22)")
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    block_size = args.block_size or (256 if args.model == "tiny" else 1024)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=block_size, **MODEL_PRESETS[args.model])).to(device).eval()
    with tempfile.TemporaryDirectory() as folder:
        write_synthetic_bundle(folder, max(args.max_per_task, 11))
        t0 = time.time()
        tasks = core_eval.load_tasks(folder, args.tasks.split(",") if args.tasks else None, args.max_per_task)
        enc = get_tokenizer()
        rendered = [core_eval.render_examples(t, enc, range(len(t.examples))) for t in tasks]
        prepared = time.time() - t0
        with autocast_context(device.split(":")[0], args.dtype):
            result = core_eval.evaluate(model, tasks, enc, device, batch_size=args.batch_size, rendered=rendered)
    print(f"{args.model} (context {block_size}) | {device} {args.dtype} | torch threads {torch.get_num_threads()} | "
          f"--max_per_task {args.max_per_task} | reading and tokenizing {prepared:.1f} s")
    print(f"{'task':<34} {'shots':>5} {'rows':>5} {'tokens':>7} {'seconds':>8}")
    for task, examples in zip(tasks, rendered):
        rows = [tokens[-block_size:] for example_rows, _ in examples for tokens, _ in example_rows]
        r = result["tasks"][task.label]
        print(f"{task.label:<34} {task.shots:>5} {len(rows):>5} {sum(map(len, rows)):>7} {r['seconds']:>8.1f}")
    total = sum(r["seconds"] for r in result["tasks"].values())
    print(f"{'all':<34} {'':>5} {'':>5} {'':>7} {total:>8.1f}")


if __name__ == "__main__":
    main()
