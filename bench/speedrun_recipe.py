"""
--recipe speedrun against --recipe modern and GPT-2's recipe, measured fairly (docs/recipes.md): the same
shape, tokens and data for every run; each recipe at the best of three rates of its main learning rate
(GPT-2 + AdamW: --max_lr; modern and speedrun: --muon_lr); then a ladder (the speedrun's techniques added one
at a time, from the tuned modern recipe) and a leave-one-out table (each removed from the tuned speedrun
recipe), and a second seed of the headline runs.

    python bench/speedrun_recipe.py --data_dir ../shared/bench_data --jobs 2             # everything (hours)
    python bench/speedrun_recipe.py --data_dir ../shared/bench_data --stage tune         # the rates only
    python bench/speedrun_recipe.py --data_dir ../shared/bench_data --timing_steps 8     # ms/step, quiet machine

Each run is `python train_gpt2.py` with the shared flags, the recipe's and the variant's, into its own folder
under --out; a run whose log is complete is kept (delete its folder to redo it). Every run's validation curve,
its CPU time (user + system, of its process), parameters and FLOPs per token go to OUT/results.json; the
tables to OUT/speedrun.md; the curves to OUT/speedrun.png.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_recipes import read_log, tokens_to_reach  # noqa: E402

RATES = {"gpt2": ("--max_lr", (1e-3, 3e-3, 6e-3)), "modern": ("--muon_lr", (0.01, 0.02, 0.04)),
         "speedrun": ("--muon_lr", (0.01, 0.02, 0.04, 0.08))}  # 0.04 was best of the first three: one more above
GPT2_WARMUP = 0.1  # GPT-2's and modern's warm-up as a share of the steps (715 of 19073 is ~4%, far too few here)
# the ladder: each rung adds techniques to the one before, from the tuned modern recipe to the full speedrun
LADDER = [
    ("modern (tuned)", None),
    ("+ the speedrun's optimizer set-up: rates by role, wsd, momentum warm-up, no clipping",
     ["--recipe", "speedrun", "--arch", "llama"]),
    ("+ the speedrun block: ReLU², QK-norm, zero-init projections, RMSNorm without gains",
     ["--recipe", "speedrun", "--logit_softcap", "0", "--no_x0_mix", "--no_unet_skips", "--no_value_embeds"]),
    ("+ logit softcap 15", ["--recipe", "speedrun", "--no_x0_mix", "--no_unet_skips", "--no_value_embeds"]),
    ("+ x0 mixed into every block", ["--recipe", "speedrun", "--no_unet_skips", "--no_value_embeds"]),
    ("+ U-net skips", ["--recipe", "speedrun", "--no_value_embeds"]),
    ("+ value embeddings (= speedrun, tuned)", ["--recipe", "speedrun"]),
]
# those the ladder does not add one by one come first (runs go in order; a partial table is a shorter one)
LEAVE_ONE_OUT = [
    ("no QK-norm", ["--no_qk_norm"]),
    ("no zero-init projections", ["--no_zero_init"]),
    ("SwiGLU instead of ReLU²", ["--mlp_act", "swiglu"]),
    ("no Muon momentum warm-up", ["--muon_momentum_warmup", "0"]),
    ("cosine instead of wsd", ["--lr_schedule", "cosine"]),
    ("gradient clipping at 1.0", ["--grad_clip", "1.0"]),
    ("no logit softcap", ["--logit_softcap", "0"]),
    ("no x0 mix", ["--no_x0_mix"]),
    ("no U-net skips", ["--no_unet_skips"]),
]
SECOND_SEED = 1338


def shared_flags(args):
    return ["--model", "tiny", "--n_layer", str(args.n_layer), "--n_head", str(args.n_head), "--n_embd", str(args.n_embd),
            "--seq_len", str(args.seq_len), "--batch_size", str(args.batch_size),
            "--total_batch_size", str(args.batch_size * args.seq_len), "--max_steps", str(args.steps),
            "--eval_every", str(args.eval_every), "--val_steps", str(args.val_steps), "--hellaswag_every", "0",
            "--sample_every", "0", "--save_every", "0", "--loss_impl", "chunked", "--device", "cpu", "--dtype", "fp32",
            "--no_compile", "--data_dir", args.data_dir, *args.extra.split()]


def recipe_flags(recipe, rate, args):
    flag, _ = RATES[recipe]
    warmup = [] if recipe == "speedrun" else ["--warmup_steps", str(round(GPT2_WARMUP * args.steps))]
    adamw = ["--max_lr", str(args.adamw_lr)] if recipe == "modern" else []  # modern's AdamW at GPT-2's tuned rate
    return ["--recipe", recipe, flag, str(rate), *warmup, *adamw]


def model_facts(flags):
    """(parameters, training FLOPs per token) of the model a command line makes, built on the meta device."""
    import torch

    import train_gpt2

    args = train_gpt2.parse_args(flags)
    config = train_gpt2.model_config(args)
    with torch.device("meta"):
        model = train_gpt2.make_gpt(config)
    return model.num_params(), model.flops_per_token(args.seq_len)


def start(name, flags, args, threads):
    """Start a run unless its log is complete; (name, process or None, started at)."""
    log_dir = os.path.join(args.out, name)
    if os.path.isfile(os.path.join(log_dir, "result.json")):
        return name, None, 0.0
    os.makedirs(log_dir, exist_ok=True)
    out = open(os.path.join(log_dir, "stdout.txt"), "w")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *shared_flags(args), *flags,
                                "--log_dir", log_dir, "--overwrite"], stdout=out, stderr=subprocess.STDOUT, env=env)
    print(f"{name}: started ({' '.join(flags)})", flush=True)
    return name, process, time.time()


def finish(name, process, started, flags, args):
    """Wait for a run; write and return its result (validation curve by tokens trained before each evaluation)."""
    log_dir = os.path.join(args.out, name)
    if process is not None:
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode:
            sys.exit(f"{name} failed; see {os.path.join(log_dir, 'stdout.txt')}")
        tokens_per_step = args.batch_size * args.seq_len
        params, flops = model_facts([*shared_flags(args), *flags])
        val = read_log(os.path.join(log_dir, "log.txt"))["val"]
        result = {"flags": flags, "cpu_seconds": usage.ru_utime + usage.ru_stime, "wall_seconds": time.time() - started,
                  "parameters": params, "flops_per_token": flops,
                  "val": {str(step * tokens_per_step): loss for step, loss in sorted(val.items())}}
        with open(os.path.join(log_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(f"{name}: done, final val {list(result['val'].values())[-1]:.4f}, "
              f"{result['cpu_seconds'] / 60:.0f} CPU minutes", flush=True)
    with open(os.path.join(log_dir, "result.json")) as f:
        return json.load(f)


def run_all(runs, args):
    """runs: {name: flags}; at most --jobs at once, each on cores // jobs threads."""
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    pending, running, results = list(runs.items()), [], {}
    while pending or running:
        while pending and len(running) < args.jobs:
            name, flags = pending.pop(0)
            running.append((*start(name, flags, args, threads), flags))
        name, process, started, flags = running.pop(0)
        results[name] = finish(name, process, started, flags, args)
    return results


def final(result):
    return list(result["val"].values())[-1]


def best(results, recipe):
    """The tuned run of a recipe: the rate whose final validation loss is lowest."""
    runs = {rate: results[f"{recipe}@{rate}"] for rate in RATES[recipe][1] if f"{recipe}@{rate}" in results}
    return min(runs, key=lambda rate: final(runs[rate]))


def report(results, args):
    tune = {recipe: best(results, recipe) for recipe in RATES}
    tuned = {recipe: results[f"{recipe}@{rate}"] for recipe, rate in tune.items()}
    gpt2_final, modern_final = final(tuned["gpt2"]), final(tuned["modern"])

    def reach(result, target, of):
        tokens, base = tokens_to_reach(result["val"], target), tokens_to_reach(of["val"], target)
        return f"{tokens / base:.0%}" if tokens else "not reached"

    def cpu_share(result, target, of):
        tokens, base = tokens_to_reach(result["val"], target), tokens_to_reach(of["val"], target)
        if not tokens:
            return "-"
        per_token = result["cpu_seconds"] / args.steps, of["cpu_seconds"] / args.steps
        return f"{tokens * per_token[0] / (base * per_token[1]):.0%}"

    def row(label, r):
        return (f"| {label} | {r['parameters']:,} | {r['flops_per_token'] / 1e6:.1f} | {final(r):.4f} | "
                f"{reach(r, gpt2_final, tuned['gpt2'])} | {reach(r, modern_final, tuned['modern'])} | "
                f"{cpu_share(r, modern_final, tuned['modern'])} | {r['cpu_seconds'] / args.steps:.1f} |")

    head = ("| run | parameters | MFLOP/token | final val loss | tokens to GPT-2's final loss (share of GPT-2's) | "
            "tokens to modern's final loss (share of modern's) | CPU time to modern's final loss (share) | "
            "CPU s/step |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [f"Shape: {args.n_layer} layers x {args.n_embd} wide, {args.n_head} heads, context {args.seq_len}; "
             f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens ({args.steps * args.batch_size * args.seq_len:,}"
             " tokens); validation every {} steps on {} batches.".format(args.eval_every, args.val_steps), "",
             "## Each recipe at its best rate", "", "| recipe | rate | final val loss |", "| --- | --- | --- |"]
    for recipe, (flag, rates) in RATES.items():
        for rate in rates:
            if f"{recipe}@{rate}" in results:
                mark = " (best)" if rate == tune[recipe] else ""
                lines.append(f"| {recipe} | {flag} {rate}{mark} | {final(results[f'{recipe}@{rate}']):.4f} |")
    lines += ["", "## Headline", "", head]
    lines += [row(f"{recipe} ({RATES[recipe][0]} {tune[recipe]})", tuned[recipe]) for recipe in RATES]
    for recipe in ("modern", "speedrun"):
        if f"{recipe}@seed2" in results:
            lines.append(row(f"{recipe}, seed {SECOND_SEED}", results[f"{recipe}@seed2"]))
    lines += ["", "## Ladder: each row adds to the one above", "", head]
    for i, (label, _) in enumerate(LADDER):
        r = tuned["modern"] if i == 0 else tuned["speedrun"] if i == len(LADDER) - 1 else results.get(f"ladder{i}")
        if r:
            lines.append(row(label, r))
    lines += ["", "## Leave one out: the tuned speedrun recipe without each part", "", head,
              row("speedrun (tuned)", tuned["speedrun"])]
    if "ladder5" in results:  # the ladder's rung before value embeddings is the recipe without them
        lines.append(row("no value embeddings", results["ladder5"]))
    for label, _ in LEAVE_ONE_OUT:
        if f"loo:{label}" in results:
            lines.append(row(label, results[f"loo:{label}"]))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "speedrun.md"), "w") as f:
        f.write(text)
    print(text)
    plot(results, tuned, os.path.join(args.out, "speedrun.png"))


def plot(results, tuned, path):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    curves = [(recipe, f"{recipe} (tuned)", "-", r) for recipe, r in tuned.items()]
    curves += [(recipe, f"{recipe}, seed {SECOND_SEED}", "--", results[f"{recipe}@seed2"])
               for recipe in ("modern", "speedrun") if f"{recipe}@seed2" in results]
    colors = {recipe: f"C{i}" for i, recipe in enumerate(RATES)}  # a recipe's seeds in one colour
    for recipe, label, linestyle, r in curves:
        tokens = [int(t) / 1e6 for t in r["val"]]
        ax.plot(tokens, list(r["val"].values()), marker=".", label=f"{label}: {final(r):.3f}", linestyle=linestyle,
                color=colors[recipe])
    ax.set_xlabel("tokens trained on (millions)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=min(8.0, max(v for *_, r in curves for v in list(r["val"].values())[1:])))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def finished_runs(out):
    """{name: result} of every run under out that finished."""
    results = {}
    for name in sorted(os.listdir(out)):
        if os.path.isfile(os.path.join(out, name, "result.json")):
            with open(os.path.join(out, name, "result.json")) as f:
                results[name] = json.load(f)
    return results


def time_runs(args):
    """CPU ms per step of the three tuned recipes, apart from the long runs: --timing_steps steps each, on all
    cores, in the order A B C C B A; per recipe the mean of its two medians (each over the steps after the first
    two)."""
    results = finished_runs(args.out)
    names = [f"{recipe}@{best(results, recipe)}" for recipe in RATES]
    times = {name: [] for name in names}
    for name in [*names, *reversed(names)]:
        flags = [*shared_flags(args), *results[name]["flags"]]
        flags[flags.index("--max_steps") + 1] = str(args.timing_steps)
        flags[flags.index("--eval_every") + 1] = "0"
        done = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), *flags, "--log_dir",
                               os.path.join(args.out, "timing"), "--overwrite"], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"timing {name} failed: {done.stderr[-2000:]}")
        step_ms = sorted(float(m) for m in re.findall(r"dt ([\d.]+)ms", done.stdout)[2:])
        times[name].append(step_ms[len(step_ms) // 2])
        print(f"timing {name}: median {times[name][-1]:.0f} ms/step", flush=True)
    with open(os.path.join(args.out, "timing.json"), "w") as f:
        json.dump({name: sum(t) / len(t) for name, t in times.items()}, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", default=os.path.join(ROOT, "bench_data"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "speedrun"))
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval_every", type=int, default=20)
    p.add_argument("--val_steps", type=int, default=4)
    p.add_argument("--adamw_lr", type=float, default=3e-3, help="modern's AdamW rate (GPT-2's best, when known)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each on cores / jobs threads)")
    p.add_argument("--extra", default="", help="flags added to every run, given with '=', e.g. on a GPU: "
                                               "--extra='--device cuda --dtype bf16 --compile' (they win)")
    p.add_argument("--stage", choices=["tune", "all", "report"], default="all",
                   help="report: only the tables and plot, from the runs under --out that finished")
    p.add_argument("--timing_steps", type=int, default=0, help="instead: time the tuned recipes (quiet machine)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.timing_steps:
        return time_runs(args)
    if args.stage == "report":
        results = finished_runs(args.out)
    else:
        runs = {f"{recipe}@{rate}": recipe_flags(recipe, rate, args) for recipe, (_, rates) in RATES.items()
                for rate in rates}
        results = run_all(runs, args)
    if args.stage == "all":
        speedrun = recipe_flags("speedrun", best(results, "speedrun"), args)
        more = {"speedrun@seed2": [*speedrun, "--seed", str(SECOND_SEED)],
                "modern@seed2": [*recipe_flags("modern", best(results, "modern"), args), "--seed", str(SECOND_SEED)]}
        more.update({f"ladder{i}": [*speedrun, *flags[2:]] for i, (_, flags) in enumerate(LADDER) if 0 < i < len(LADDER) - 1})
        more.update({f"loo:{label}": [*speedrun, *flags] for label, flags in LEAVE_ONE_OUT})
        results.update(run_all(more, args))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    report(results, args)


if __name__ == "__main__":
    main()
