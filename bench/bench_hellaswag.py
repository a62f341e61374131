"""
Time hellaswag.py's scoring: batched (many examples per forward pass) against one example (4 rows)
at a time, on synthetic HellaSwag-shaped examples and a randomly initialised model. Not a test.

    python bench/bench_hellaswag.py                          # d12 (124M) on this machine, 100 examples
    python bench/bench_hellaswag.py --device cuda --dtype bf16 --compile --limit 2000 --batch_sizes 1,16,32,64

Random weights score like chance, but the time per example depends only on the shapes. The synthetic
examples have HellaSwag-like lengths (contexts of 15-75 words, endings of 8-40 words); the real val
split's lengths differ somewhat, so the seconds for 10,042 examples are an extrapolation.
"""

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanogpt import hellaswag_eval  # noqa: E402
from train_gpt2 import MODEL_PRESETS, GPT, GPTConfig, autocast_context, get_tokenizer, pick_device  # noqa: E402

WORDS = ("the a man woman person dog child group people is are was then now he she they it his her their "
         "with on in into over under of to and but while after before slowly quickly carefully holds puts "
         "takes runs walks jumps throws catches shows talks begins continues water ball rope bike car table "
         "kitchen field camera hair paint wall floor board piece knife bowl").split()


def synthetic_examples(n, seed=0):
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return [{"ctx": words(15, 75).capitalize() + ".", "endings": [words(8, 40) + "." for _ in range(4)], "label": rng.randrange(4)}
            for _ in range(n)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--model", default="d12", choices=sorted(MODEL_PRESETS))
    p.add_argument("--limit", type=int, default=100, help="synthetic examples")
    p.add_argument("--batch_sizes", default="1,8", help="examples per forward pass to time; 1 = one example at a time (unbucketed)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    device = pick_device(args.device)
    device_type = device.split(":")[0]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL_PRESETS[args.model])).to(device).eval()
    if args.compile:
        model = torch.compile(model)
    enc = get_tokenizer()
    examples = synthetic_examples(args.limit)
    rendered = [hellaswag_eval.render(ex, enc) for ex in examples]
    t0 = time.time()
    for ex in examples:
        hellaswag_eval.render(ex, enc)
    render_s = time.time() - t0
    tokens = sum(len(c) + len(e) for c, ends, _ in rendered for e in ends)
    print(f"{args.model} | device {device} | dtype {args.dtype} | compile {args.compile} | {len(examples)} examples | "
          f"{tokens / (4 * len(examples)):.1f} tokens per row | threads {torch.get_num_threads()} | rendering {render_s:.2f} s")
    reference = None
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        pad = 1 if bs == 1 else None  # one at a time = build-nanogpt: pad to the longest of the 4 rows
        passes = 2 if (args.compile or device_type == "cuda") else 1  # on a GPU the first pass compiles / warms up
        for p in range(passes):
            t0, c0 = time.time(), time.process_time()
            with autocast_context(device_type, args.dtype):
                sums, _ = hellaswag_eval.score(model, rendered, device, bs, pad)
            if device_type == "cuda":
                torch.cuda.synchronize()
            dt, cpu = time.time() - t0, time.process_time() - c0
            if p < passes - 1:
                print(f"  batch {bs:3d}: first pass {dt:.2f} s (compile / warm-up)")
        same = "" if reference is None else f" | same picks as batch {reference[0]}: {bool((sums.argmin(1) == reference[1].argmin(1)).all())}"
        reference = reference or (bs, sums)
        cpu_note = f" (process CPU {cpu:.1f} s)" if device_type == "cpu" else ""
        print(f"  batch {bs:3d}: {dt:.2f} s{cpu_note} | {len(examples) / dt:.1f} examples/s | "
              f"10,042 examples ~ {10042 * dt / len(examples):.1f} s{same}")

if __name__ == "__main__":
    main()
