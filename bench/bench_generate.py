"""
Tokens/s of our GPT.generate against transformers' GPT2LMHeadModel.generate on the same weights (not
part of the tests).

    python bench/bench_generate.py                                  # d12 on the CPU, 1 and 2 threads
    python bench/bench_generate.py --busy 0,2                       # also with 2 CPU-burning processes
    python bench/bench_generate.py --baseline 92b8f71               # plus our generate as of that commit
    python bench/bench_generate.py --device cuda --dtype bf16 --threads 0
    python bench/bench_generate.py --int8_vs_hf --threads 1,2 --reps 5   # fp32 vs --int8 vs transformers

One sample (batch 1), a random prompt of --prompt_len tokens, greedy, --new_tokens new tokens with no
stop token, so every run makes the same number of tokens. Our model is a random d12 (GPT-2 124M shape,
vocabulary padded to 50304); export_hf writes it as a transformers directory (vocabulary 50257) and
transformers loads it from there, so both models hold the same weights. On a CPU "ours" is the model
as generate_tokens.py samples from it there (its Linear weights laid out by lay_out_for_cpu_sampling),
and "ours, nn.Linear layout" the model as built, for comparison. Like generate_tokens.py, the benchmark
asks torch for huge pages for its big CPU tensors (all contenders' weights; THP_MEM_ALLOC_ENABLE=0 in the
environment turns that off). For each --busy and --threads
setting the contenders run alternately (the order rotating), --reps times after a warm-up, and the
table shows the median tokens/s. Both must produce the same tokens; the table says whether they did.

--busy N starts N processes that spin on the CPU for the duration of that setting, to reproduce a
machine where other jobs compete for the cores. --baseline REV also times GPT.generate from
train_gpt2.py at git revision REV (same weights), so before/after numbers come from one run.

--int8_vs_hf (CPU): greedy decoding of the same random weights (GPT-2's 50257-token vocabulary, so
all three do the same arithmetic) three ways: GPT.generate in fp32 on the model as generate_tokens.py lays
it out on a CPU, GPT.generate on generate_tokens'
--int8 model, and transformers' GPT2LMHeadModel.generate (its own KV cache, do_sample=False, exactly
--new_tokens tokens). For each thread count in --threads, the three alternate within every rep, so
load from other processes hits them alike; the median of --reps is reported.
"""

import argparse
import copy
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from generate_tokens import lay_out_for_cpu_sampling, use_huge_pages  # noqa: E402
from nanogpt.cli import run_cli  # noqa: E402
from nanogpt.hf import export_hf, hf_to_our_state_dict  # noqa: E402
from nanogpt.runtime import autocast_context, pick_device  # noqa: E402
from nanogpt.tokenizer import GPT2_VOCAB_SIZE  # noqa: E402
from train_gpt2 import MODEL_PRESETS, GPT, GPTConfig  # noqa: E402


def int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def load_baseline(rev, state_dict, config, device):
    """GPT from train_gpt2.py as of git revision rev, holding state_dict."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:train_gpt2.py"], capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), f"train_gpt2_{rev.replace('/', '_')}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("train_gpt2_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.GPT(module.GPTConfig(**vars(config)))
    model.load_state_dict(state_dict)
    return model.to(device).eval()


class Burners:
    """n processes spinning on the CPU while the with-block runs."""

    def __init__(self, n):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.5 if self.n else 0)  # let them get going
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait()


def int8_vs_hf(args):
    """fp32 vs int8 vs transformers, greedy, on the CPU; prints a markdown table."""
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
    lay_out_for_cpu_sampling(fp32)  # as generate_tokens.py samples in fp32 on a CPU
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    n = args.new_tokens

    def ours(model):
        return lambda: model.generate(idx, n, temperature=0)

    def transformers_generate():
        return hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=50256)

    runs = {"fp32 (generate_tokens.py)": ours(fp32), "int8 (--int8)": ours(int8), "transformers fp32": transformers_generate}
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
    ref = outs["fp32 (generate_tokens.py)"]
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
    p.add_argument("--reps", type=int, default=5, help="timed runs of each contender per setting (median reported)")
    p.add_argument("--threads", type=int_list, default=[1, 2], help="comma-separated torch.set_num_threads values; 0 = leave as is")
    p.add_argument("--busy", type=int_list, default=[0], help="comma-separated numbers of CPU-burning background processes")
    p.add_argument("--baseline", default=None, metavar="REV", help="also time GPT.generate of train_gpt2.py at this git revision")
    p.add_argument("--no_hf", action="store_true", help="leave out transformers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--int8_vs_hf", action="store_true", help="CPU: greedy fp32 vs --int8 vs transformers' generate")
    args = p.parse_args()
    use_huge_pages()  # as generate_tokens.py samples (before the first tensor); THP_MEM_ALLOC_ENABLE=0: off
    if args.int8_vs_hf:
        int8_vs_hf(args)
        return
    device = pick_device(args.device)
    device_type = device.split(":")[0]

    torch.manual_seed(0)
    config = GPTConfig(**MODEL_PRESETS[args.model])
    ours = GPT(config).eval()
    contenders = {"ours": ours}
    if args.baseline:
        contenders[f"ours@{args.baseline}"] = load_baseline(args.baseline, ours.state_dict(), config, device)
    if not args.no_hf:
        from transformers import GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        hf_dir = os.path.join(tempfile.mkdtemp(), "hf")
        export_hf(ours, hf_dir)
        hf = GPT2LMHeadModel.from_pretrained(hf_dir).to(device).eval()
        hf.generation_config.eos_token_id = None  # never stop early: both make --new_tokens tokens
        hf.generation_config.pad_token_id = 0
        # the import helper maps the HF weights back onto ours: a check that both hold the same model
        back = hf_to_our_state_dict(hf.state_dict())
        for k, v in ours.state_dict().items():
            assert torch.equal(back[k].to(v.device), v[: back[k].size(0)]), k
        contenders["transformers"] = hf
    ours.to(device)
    if device_type == "cpu":  # "ours" is what generate_tokens.py samples from on a CPU; the layout as built beside it
        rest = {k: v for k, v in contenders.items() if k != "ours"}
        contenders = {"ours": lay_out_for_cpu_sampling(copy.deepcopy(ours)), "ours, nn.Linear layout": ours, **rest}

    idx = torch.randint(0, 50257, (1, args.prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    attention_mask = torch.ones_like(idx)

    def generate(name, n):
        model = contenders[name]
        with torch.no_grad(), autocast_context(device_type, args.dtype):
            if name == "transformers":
                return model.generate(idx, attention_mask=attention_mask, max_new_tokens=n, do_sample=False)
            return model.generate(idx, n, temperature=0)

    def timed(name):
        if device_type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(name, args.new_tokens)
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        assert out.shape == (1, args.prompt_len + args.new_tokens), out.shape
        return args.new_tokens / dt, out

    default_threads = torch.get_num_threads()
    names = list(contenders)
    print(f"{args.model}: {ours.num_params() / 1e6:.1f}M parameters | device {device} | dtype {args.dtype} | batch 1 | "
          f"prompt {args.prompt_len} | greedy, {args.new_tokens} new tokens | median of {args.reps} | torch {torch.__version__}"
          + (f" | {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""), flush=True)
    rows = []
    for busy in args.busy:
        for threads in args.threads:
            torch.set_num_threads(threads or default_threads)
            with Burners(busy):
                for name in names:
                    generate(name, 8)  # warm-up
                speeds, outs = {n: [] for n in names}, {}
                for rep in range(args.reps):
                    for name in names[rep % len(names) :] + names[: rep % len(names)]:  # alternate, rotating the order
                        tps, outs[name] = timed(name)
                        speeds[name].append(tps)
            same = all(torch.equal(outs[n], outs[names[0]]) for n in names)
            med = {n: statistics.median(v) for n, v in speeds.items()}
            rows.append((busy, torch.get_num_threads(), med, same))
            print(f"  busy {busy}, threads {torch.get_num_threads()}: "
                  + " | ".join(f"{n} " + " ".join(f"{x:.1f}" for x in speeds[n]) for n in names), flush=True)
    torch.set_num_threads(default_threads)

    ratio = "transformers" in names and len(names) > 1
    print("\ntokens/s, median")
    print("| busy | threads | " + " | ".join(names) + (" | ours / transformers" if ratio else "") + " | same tokens |")
    print("| --- " * (3 + len(names) + ratio) + "|")
    for busy, threads, med, same in rows:
        cells = [f"{med[n]:.1f}" for n in names] + ([f"{med['ours'] / med['transformers']:.2f}x"] if ratio else [])
        print(f"| {busy} | {threads} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    run_cli(main)
