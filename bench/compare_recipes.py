"""
GPT-2's recipe against the options beyond it (docs/recipes.md): the same model shape trained on the same
tokens, once per variant, with the validation loss every --eval_every steps; then one PNG of validation
loss against tokens, and a table of each variant's final loss, the tokens it needs to reach the baseline's
final validation loss, and its median ms per step.

    python bench/compare_recipes.py --data_dir ../shared/bench_data              # the four variants
    python bench/compare_recipes.py --data_dir ../shared/bench_data --only llama_muon --extra="--muon_lr 0.04" --tag lr04
    python bench/compare_recipes.py --data_dir ../shared/bench_data --timing_steps 12   # ms/step, on a quiet machine

Each variant is `python train_gpt2.py` with the flags below and its own --log_dir under --out; a variant
whose log.txt is complete is not run again (delete its folder to redo it). Results: OUT/results.json,
OUT/recipes.png, OUT/recipes.md.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {  # name: the flags that make it (the baseline first)
    "gpt2_adamw": [],
    "llama_adamw": ["--arch", "llama"],
    "gpt2_muon": ["--optimizer", "muon"],
    "llama_muon": ["--arch", "llama", "--optimizer", "muon"],
}
SUMMARY_RE = re.compile(r"median ([\d.]+) ms/step over the last (\d+)")


def common_flags(args):
    """The shape, batch and schedule every variant shares."""
    return ["--model", "tiny", "--n_layer", str(args.n_layer), "--n_head", str(args.n_head), "--n_embd", str(args.n_embd),
            "--seq_len", str(args.seq_len), "--batch_size", str(args.batch_size),
            "--total_batch_size", str(args.batch_size * args.seq_len), "--max_steps", str(args.steps),
            "--warmup_steps", str(args.warmup_steps), "--max_lr", str(args.max_lr), "--eval_every", str(args.eval_every),
            "--val_steps", str(args.val_steps), "--hellaswag_every", "0", "--sample_every", "0", "--save_every", "0",
            "--loss_impl", "chunked", "--device", "cpu", "--dtype", "fp32", "--no_compile", "--data_dir", args.data_dir]


def read_log(path):
    out = {}
    with open(path) as f:
        for line in f:
            step, kind, value = line.split()[:3]
            out.setdefault(kind, {})[int(step)] = float(value)
    return out


def run_variant(name, flags, args):
    log_dir = os.path.join(args.out, name)
    log_file = os.path.join(log_dir, "log.txt")
    stdout_file = os.path.join(log_dir, "stdout.txt")
    if os.path.isfile(log_file) and args.steps - 1 in read_log(log_file).get("val", {}) and os.path.isfile(stdout_file):
        print(f"{name}: done before, kept")
    else:
        print(f"{name}: training ({' '.join(flags) or 'the GPT-2 recipe'})", flush=True)
        os.makedirs(log_dir, exist_ok=True)
        t0 = time.time()
        with open(stdout_file, "w") as out:
            done = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *common_flags(args), *flags,
                                   "--log_dir", log_dir, "--overwrite"], stdout=out, stderr=subprocess.STDOUT)
        if done.returncode:
            sys.exit(f"{name} failed; see {stdout_file}")
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
    with open(stdout_file) as f:
        text = f.read()
    ms, timed = SUMMARY_RE.search(text).groups()
    params = int(re.search(r"\| ([\d,]+) parameters", text).group(1).replace(",", ""))
    val = read_log(log_file)["val"]
    tokens_per_step = args.batch_size * args.seq_len
    return {"flags": flags, "ms_per_step": float(ms), "timed_steps": int(timed), "parameters": params,
            "val": {str((step + 1) * tokens_per_step): loss for step, loss in sorted(val.items())}}


def time_variants(args, names):
    """ms per step of each variant, measured apart from the long runs (which another job may have slowed):
    --timing_steps steps each, in the order A B C D then D C B A; per variant the mean of its two medians
    (each over the steps after the first two)."""
    times = {name: [] for name in names}
    for name in [*names, *reversed(names)]:
        log_dir = os.path.join(args.out, f"timing_{name}")
        flags = common_flags(args)
        flags[flags.index("--max_steps") + 1] = str(args.timing_steps)
        flags[flags.index("--eval_every") + 1] = "0"
        done = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *flags, *VARIANTS[name],
                               "--log_dir", log_dir, "--overwrite"], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"timing {name} failed: {done.stderr[-2000:]}")
        step_ms = [float(m) for m in re.findall(r"dt ([\d.]+)ms", done.stdout)][2:]
        times[name].append(sorted(step_ms)[len(step_ms) // 2])
        print(f"timing {name}: median {times[name][-1]:.0f} ms/step", flush=True)
    return {name: sum(t) / len(t) for name, t in times.items()}


def tokens_to_reach(curve, target):
    """The tokens at which a validation curve first reaches `target`, linearly between evaluations; None if never."""
    points = sorted((int(t), v) for t, v in curve.items())
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if v1 <= target:
            return t1 if v0 == v1 else t0 + (t1 - t0) * (v0 - target) / (v0 - v1)
    return None


def report(results, baseline, args):
    timing = os.path.join(args.out, "timing.json")
    quiet = json.load(open(timing)) if os.path.isfile(timing) else {}  # ms/step measured apart, when there is one
    target = list(results[baseline]["val"].values())[-1]
    base_tokens = tokens_to_reach(results[baseline]["val"], target)
    lines = [f"Shape: {args.n_layer} layers x {args.n_embd} wide, {args.n_head} heads; {args.steps} steps of "
             f"{args.batch_size} x {args.seq_len} tokens; AdamW max lr {args.max_lr}, warmup {args.warmup_steps}, cosine "
             "to 10%.", "",
             f"| variant | parameters | final val loss | tokens to reach {baseline}'s final {target:.4f} | share of "
             f"{baseline}'s | ms/step | CPU time to reach it, share of {baseline}'s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        reach = tokens_to_reach(r["val"], target)
        share = f"{reach / base_tokens:.0%}" if reach else "not reached"
        lines.append(f"| {name} {' '.join(r['flags'])} | {r['parameters']:,} | {list(r['val'].values())[-1]:.4f} | "
                     f"{f'{reach:,.0f}' if reach else 'not reached'} | {share} | "
                     f"{quiet[name] if name in quiet else r['ms_per_step']:.0f}{'' if name in quiet else ' *'} | "
                     f"{f'{reach / base_tokens * quiet[name] / quiet[baseline]:.0%}' if reach and name in quiet and baseline in quiet else '-'} |")
    if any(name not in quiet for name in results):
        lines += ["", "ms/step: measured apart, on a quiet machine (--timing_steps); * the long run's median, which "
                  "other jobs on the machine may have slowed"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "recipes.md"), "w") as f:
        f.write(text)
    print(text)


def plot(results, path):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for name, r in results.items():
        tokens = [int(t) / 1e6 for t in r["val"]]
        ax.plot(tokens, list(r["val"].values()), marker=".", label=f"{name} (last {list(r['val'].values())[-1]:.3f})")
    ax.set_xlabel("tokens trained on (millions)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=min(8.0, max(v for r in results.values() for v in list(r["val"].values())[1:])))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", default=os.path.join(ROOT, "bench_data"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "recipes"))
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup_steps", type=int, default=30)
    p.add_argument("--max_lr", type=float, default=3e-3)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--val_steps", type=int, default=8)
    p.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="run only these variants")
    p.add_argument("--extra", default="", help="flags added to every variant run, given with '=': --extra=--tie_embeddings")
    p.add_argument("--tag", default="", help="a suffix for the variants' folders when --extra changes them")
    p.add_argument("--timing_steps", type=int, default=0,
                   help="instead: time each variant over this many steps, twice, in alternating order")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.timing_steps:
        times = time_variants(args, [n for n in VARIANTS if not args.only or n in args.only])
        with open(os.path.join(args.out, "timing.json"), "w") as f:
            json.dump(times, f, indent=1)
        print("\n".join(f"| {name} | {ms:.0f} |" for name, ms in times.items()))
        return
    results = {}
    for name, flags in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        key = f"{name}_{args.tag}" if args.tag else name
        results[key] = run_variant(key, flags + args.extra.split(), args)
    path = os.path.join(args.out, "results.json")
    everything = json.load(open(path)) if os.path.isfile(path) else {}
    everything.update(results)
    with open(path, "w") as f:
        json.dump(everything, f, indent=1)
    main_variants = {k: v for k, v in everything.items() if k in VARIANTS}
    if "gpt2_adamw" in main_variants:
        plot(main_variants, os.path.join(args.out, "recipes.png"))
        report(everything, "gpt2_adamw", args)


if __name__ == "__main__":
    main()
