"""
Tokens/s of GPT.generate with and without the KV cache, both in one run (not part of the tests).

    python bench/bench_generate.py                        # d12 (GPT-2 124M shape, random init) on the CPU
    python bench/bench_generate.py --device cuda --dtype bf16 --new_tokens 500
    python bench/bench_generate.py --int8_vs_hf --threads 1,2 --reps 5   # fp32 vs --int8 vs transformers

One sample, a prompt of --prompt_len tokens, --new_tokens sampled tokens (temperature 1, top_k 50,
no stop token, so every rep makes the same number of tokens); the median of --reps runs after a
warm-up. Without the cache every step runs the whole sequence so far through the model.

--int8_vs_hf (CPU): greedy decoding of the same random weights (GPT-2's 50257-token vocabulary, so
all three do the same arithmetic) three ways: GPT.generate in fp32, GPT.generate on generate_tokens'
--int8 model, and transformers' GPT2LMHeadModel.generate (its own KV cache, do_sample=False, exactly
--new_tokens tokens). For each thread count in --threads, the three alternate within every rep, so
load from other processes hits them alike; the median of --reps is reported.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_gpt2 import GPT2_VOCAB_SIZE, MODEL_PRESETS, GPT, GPTConfig, autocast_context, export_hf, pick_device, run_cli  # noqa: E402


def time_generate(model, idx, new_tokens, use_cache, device_type, dtype, seed):
    torch.manual_seed(seed)
    if device_type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with autocast_context(device_type, dtype):
        out = model.generate(idx, new_tokens, temperature=1.0, top_k=50, use_cache=use_cache)
    if device_type == "cuda":
        torch.cuda.synchronize()
    assert out.size(1) == idx.size(1) + new_tokens
    return time.perf_counter() - t0


def int8_vs_hf(args):
    """fp32 vs int8 vs transformers, greedy, on the CPU; prints a markdown table."""
    import copy
    import platform
    import tempfile

    from transformers import GPT2LMHeadModel

    from generate_tokens import quantize_int8

    torch.manual_seed(0)
    fp32 = GPT(GPTConfig(**MODEL_PRESETS[args.model], vocab_size=GPT2_VOCAB_SIZE)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(fp32, os.path.join(tmp, "hf"))
        hf = GPT2LMHeadModel.from_pretrained(os.path.join(tmp, "hf")).eval()
    int8 = quantize_int8(copy.deepcopy(fp32))
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    n = args.new_tokens

    def ours(model):
        return lambda: model.generate(idx, n, temperature=0)

    def transformers_generate():
        return hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=50256)

    runs = {"fp32 (GPT.generate)": ours(fp32), "int8 (--int8)": ours(int8), "transformers fp32": transformers_generate}
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"{args.model} (vocab {GPT2_VOCAB_SIZE}): {fp32.num_params() / 1e6:.1f}M parameters | {cpu}, {os.cpu_count()} cores | "
          f"torch {torch.__version__} | greedy, batch 1, prompt {args.prompt_len}, {n} new tokens | reps {args.reps}")
    with torch.no_grad():
        outs = {name: fn()[0, args.prompt_len:] for name, fn in runs.items()}  # warm-up, and the tokens
    ref = outs["fp32 (GPT.generate)"]
    for name, out in outs.items():
        assert out.numel() == n, (name, out.numel())
        same = (out == ref).tolist()
        first = same.index(False) if False in same else n
        print(f"  {name}: first {first} of {n} greedy tokens equal fp32's")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {name: [] for name in runs}
        with torch.no_grad():
            for _ in range(args.reps):
                for name, fn in runs.items():  # alternate, so a busy moment hits all three alike
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            t = statistics.median(ts)
            rows.append((threads, name, t, n / t))
            print(f"  {threads} thread(s), {name}: " + ", ".join(f"{x:.2f}s" for x in ts), flush=True)
    print("\n| threads | generate | median s | tokens/s |\n| --- | --- | --- | --- |")
    for threads, name, t, tps in rows:
        print(f"| {threads} | {name} | {t:.2f} | {tps:.1f} |")
    try:
        print(f"\nload average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    except OSError:
        pass


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="d12", choices=sorted(MODEL_PRESETS))
    p.add_argument("--prompt_len", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--int8_vs_hf", action="store_true", help="CPU: greedy fp32 vs --int8 vs transformers' generate")
    p.add_argument("--threads", default="1,2", help="with --int8_vs_hf: torch thread counts to time, comma-separated")
    args = p.parse_args()
    if args.int8_vs_hf:
        args.threads = [int(t) for t in args.threads.split(",")]
        int8_vs_hf(args)
        return
    device = pick_device(args.device)
    device_type = device.split(":")[0]

    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL_PRESETS[args.model])).to(device).eval()
    idx = torch.randint(0, 50257, (1, args.prompt_len), device=device)
    print(f"{args.model}: {model.num_params() / 1e6:.1f}M parameters | device {device} ({torch.get_num_threads()} threads on cpu) | "
          f"dtype {args.dtype} | prompt {args.prompt_len} | new tokens {args.new_tokens} | reps {args.reps}")
    rows = []
    for use_cache in (True, False):
        # warm-up; on a GPU the whole length, so first-use kernel loading for each length is not timed
        time_generate(model, idx, 8 if device_type == "cpu" else args.new_tokens, use_cache, device_type, args.dtype, 0)
        times = [time_generate(model, idx, args.new_tokens, use_cache, device_type, args.dtype, r) for r in range(args.reps)]
        t = statistics.median(times)
        rows.append((use_cache, t, args.new_tokens / t))
        print(f"  {'with' if use_cache else 'without'} cache: " + ", ".join(f"{x:.2f}s" for x in times), flush=True)
    print("\n| generate | median s | tokens/s |\n| --- | --- | --- |")
    for use_cache, t, tps in rows:
        print(f"| {'with KV cache' if use_cache else 'without cache'} | {t:.2f} | {tps:.1f} |")
    print(f"\nspeed-up from the cache: {rows[0][2] / rows[1][2]:.1f}x")


if __name__ == "__main__":
    run_cli(main)
