"""
HellaSwag accuracy of a GPT-2 model: the validation split, rendered as in build-nanogpt, scored many
examples per forward pass.

    python hellaswag.py --checkpoint log/model_19072.pt     # ours (a file, or the newest in a folder)
    python hellaswag.py --init_from gpt2                    # OpenAI's GPT-2 124M (HF weights)
    python hellaswag.py --init_from gpt2 --style harness    # lm-evaluation-harness's prompt and acc_norm
    torchrun --standalone --nproc_per_node=8 hellaswag.py --init_from gpt2-xl   # split over 8 GPUs

Each example is a context and 4 endings; the model scores every ending by the cross-entropy of the
ending's tokens given the context, and picks the lowest:
- acc_norm (build-nanogpt's headline number): the mean loss per ending token;
- acc: the summed loss (the plain log-likelihood of the ending).
With --style harness the text is preprocessed the way lm-evaluation-harness does it (activity label
as a prefix, WikiHow [title]/[step] marks removed) and acc_norm divides the summed loss by the
ending's length in characters instead, so the numbers compare with the harness's.

The val split (10,042 examples) is downloaded once into hellaswag/ beside this file (--cache_dir
to put it elsewhere); offline, pass a local HellaSwag .jsonl with --data. --dtype is fp32 by default
(the exact number; auto/bf16 is faster on a GPU), and the model is compiled on CUDA unless
--no_compile. The examples, their rendering and scoring are nanogpt/hellaswag_eval.py's, which the
training loop calls too.
"""

import time

import torch

from nanogpt.cli import CLIParser, UserError, add_system_flags, add_weights_flags, run_cli
from nanogpt.evaluation import evaluation_run, out_of_memory_said
from nanogpt.hellaswag_eval import DEFAULT_CACHE_DIR, STYLES, evaluate, examples_from_rank0
from nanogpt.tokenizer import get_tokenizer
from train_gpt2 import load_model, setup_distributed


def build_parser():
    p = CLIParser(description="HellaSwag accuracy of our checkpoint or of HF GPT-2 weights.")
    add_weights_flags(p)
    p.add_argument("--data", default=None,
                   help="a local HellaSwag-format .jsonl (default: the val split, downloaded once into --cache_dir)")
    p.add_argument("--cache_dir", default=DEFAULT_CACHE_DIR, help="where the downloaded val split is kept")
    p.add_argument("--batch_size", type=int, default=None,
                   help="examples (of 4 rows) per forward pass (default: 32 on cuda, 8 elsewhere)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N examples (default: all)")
    p.add_argument("--style", default="nanogpt", choices=STYLES,
                   help="nanogpt: build-nanogpt's rendering; harness: lm-evaluation-harness's")
    add_system_flags(p, dtype_default="fp32", compile_help="default: on for CUDA, off elsewhere; pays off for the "
                     "full split", dtype_help="autocast dtype: fp32 is exact; bf16 is what the training loop uses; auto = "
                     "bf16 on CUDA GPUs that have it, else fp16; fp32 on cpu/mps")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("checkpoint", "init_from", "data", "cache_dir", "device"):
        if getattr(args, name) == "":
            raise UserError(f"--{name} is empty; see --help")
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError(f"--batch_size {args.batch_size}: must be at least 1")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    with evaluation_run(args, setup_distributed, load_model) as run:  # torchrun: one share per process
        examples = examples_from_rank0(args.data, args.limit, run.ddp, run.rank, run.device, args.cache_dir)
        if run.master:
            print(f"{len(examples)} examples | style {args.style} | {run.header}")
        t0 = time.time()
        batch = min(args.batch_size or (32 if run.device_type == "cuda" else 8), len(examples))
        with out_of_memory_said(run.device, f"{batch} examples per pass"), run.autocast:
            result = evaluate(run.model, examples, get_tokenizer(), run.device, run.rank, run.world_size,
                              args.batch_size, args.style, progress=run.master)
        if run.device_type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.time() - t0
        if run.master:
            print(f"acc {result['acc']:.4f} ({result['correct']}/{result['total']}) | "
                  f"acc_norm {result['acc_norm']:.4f} ({result['correct_norm']}/{result['total']}) | {elapsed:.1f} s")
        return result


if __name__ == "__main__":
    run_cli(main)
