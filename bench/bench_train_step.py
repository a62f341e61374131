"""
A training step on the CPU against build-nanogpt's, the same computation in one run: its train_gpt2.py
(../shared/gpu/build_nanogpt_train_gpt2.py, made runnable by make_reference.py, at a 2-layer, 64-wide
shape) and ours at the same shape, batch, data order and dtype, alternating A B B A ... on one thread;
per program the median ms/step of the steps after the first few, and ours as a speed ratio to it.

    python bench/bench_train_step.py --data_dir ../shared/bench_data                # bf16 autocast, as theirs
    python bench/bench_train_step.py --data_dir ../shared/bench_data --dtype fp32   # both in fp32
    python bench/bench_train_step.py --data_dir ../shared/bench_data --profile      # where our step's time goes
    python bench/bench_train_step.py --same_process --batch_size 8 --seq_len 32     # the models alone, one process

--same_process leaves the two programs' loops out: build-nanogpt's GPT class (the script's part above its
data loader) and ours, holding the same weights, each take a full step (forward, backward, clipping, AdamW)
on the same batch in one process, alternating, --steps times each; the medians and their ratio. Where the
two programs differ by more than this, the difference is in the loop or is the noise between processes.

--huge_pages ours|both runs ours, or both programs, with torch's THP_MEM_ALLOC_ENABLE=1 (CPU tensors of 2 MB and
more on huge pages, docs/speed.md); by default neither has it, as each runs out of the box.

A ratio from one run on one machine is the number; numbers from different runs are not compared. Run it on
a quiet machine (nothing else on the cores).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanogpt.shards import list_shards, read_shard  # noqa: E402
SHARED_GPU = os.path.join(os.path.dirname(ROOT), "shared", "gpu")
STEP_MS = re.compile(r"step +(\d+)(?:/\d+)? \| loss:? [\d.]+ .*?dt:? ([\d.]+) ?ms")


def npy_shards(data_dir, out):
    """The benchmark's shards as the .npy files build-nanogpt reads (same tokens, same order)."""
    os.makedirs(out, exist_ok=True)
    for split in ("train", "val"):
        for i, path in enumerate(list_shards(data_dir, split)):
            np.save(os.path.join(out, f"bench_{split}_{i:06d}.npy"), read_shard(path))


def reference_script(out, fp32):
    """build-nanogpt's script as make_reference.py makes it; fp32: its bf16 autocast turned off."""
    subprocess.run([sys.executable, os.path.join(SHARED_GPU, "make_reference.py"), out], check=True)
    if fp32:
        with open(out) as f:
            text = f.read()
        text = text.replace("with torch.autocast(device_type=device_type, dtype=torch.bfloat16):",
                            "with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=False):")
        with open(out, "w") as f:
            f.write(text)


def median_ms(text, skip):
    steps = [float(ms) for step, ms in STEP_MS.findall(text) if int(step) >= skip]
    return statistics.median(steps) if steps else float("nan")


def same_process(args):
    """Both GPTs, the same weights and batch, a full fp32 step each, alternating in this process."""
    import torch

    from train_gpt2 import GPT, GPTConfig

    with tempfile.TemporaryDirectory() as work:
        reference = os.path.join(work, "reference.py")
        reference_script(reference, fp32=True)
        with open(reference) as f:
            source = f.read()
    classes = {}  # the script up to its data loader: imports, the model, its config
    exec(compile(source[: source.index("\nimport numpy as np")], "build_nanogpt_model", "exec"), classes)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = dict(vocab_size=50304, n_layer=2, n_head=2, n_embd=64, block_size=1024)
    models = {"build-nanogpt": classes["GPT"](classes["GPTConfig"](**shape)), "ours": GPT(GPTConfig(**shape))}
    models["ours"].load_state_dict(models["build-nanogpt"].state_dict())
    x, y = torch.randint(0, 50257, (2, args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(1))

    def stepper(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=False)

        def step():
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step

    steps = {name: stepper(model) for name, model in models.items()}
    times = {name: [] for name in steps}
    for i in range(args.skip + args.steps):
        for name in steps if i % 2 else reversed(steps):
            t0 = time.perf_counter()
            steps[name]()
            if i >= args.skip:
                times[name].append((time.perf_counter() - t0) * 1e3)
    ref, our = statistics.median(times["build-nanogpt"]), statistics.median(times["ours"])
    print(f"same process, fp32, {args.threads} thread(s), {args.batch_size} x {args.seq_len}, {args.steps} steps each: "
          f"build-nanogpt {ref:.2f} ms/step, ours {our:.2f} ms/step, ours at {ref / our:.3f}x its speed")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", default=os.path.join(ROOT, "bench_data"))
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--total_batch_size", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="steps left out of the median (warm-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="instead: cProfile of our steps, top 25 by own time")
    p.add_argument("--huge_pages", choices=["none", "ours", "both"], default="none",
                   help="which programs run with THP_MEM_ALLOC_ENABLE=1 (torch's huge pages for big CPU tensors)")
    p.add_argument("--same_process", action="store_true",
                   help="instead: both models' steps in this process, alternating (fp32; no data folder needed)")
    args = p.parse_args(argv)
    args.data_dir = os.path.abspath(args.data_dir)  # the programs run in a temporary folder, not here
    return args


def train_flags(args, work):
    """Our train_gpt2.py's flags for the benchmark's run, its log in work."""
    return ["--model", "tiny", "--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--batch_size", str(args.batch_size),
            "--seq_len", str(args.seq_len), "--total_batch_size", str(args.total_batch_size), "--max_steps",
            str(args.steps), "--no_shuffle", "--eval_every", "0", "--hellaswag_every", "0", "--sample_every", "0",
            "--save_every", "0", "--device", "cpu", "--dtype", args.dtype, "--no_compile", "--data_dir", args.data_dir,
            "--log_dir", os.path.join(work, "ourlog"), "--overwrite"]


def main():
    args = parse_args()
    if args.same_process:
        same_process(args)
        return
    work = tempfile.mkdtemp(prefix="bench_step_")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), REF_TINY="1", REF_B=str(args.batch_size),
               REF_T=str(args.seq_len), REF_TOTAL=str(args.total_batch_size), REF_STEPS=str(args.steps),
               REF_DATA=os.path.join(work, "npy"), REF_LOG=os.path.join(work, "reflog"))
    ours = [os.path.join(ROOT, "train_gpt2.py"), *train_flags(args, work)]
    if args.profile:
        subprocess.run([sys.executable, "-m", "cProfile", "-s", "tottime", *ours], env=env, check=True)
        return
    npy_shards(args.data_dir, env["REF_DATA"])
    reference = os.path.join(work, "reference.py")
    reference_script(reference, args.dtype == "fp32")
    programs = {"build-nanogpt": [sys.executable, reference], "ours": [sys.executable, *ours]}
    envs = {name: dict(env, THP_MEM_ALLOC_ENABLE="1" if args.huge_pages in (name, "both") else "0")
            for name in ("build-nanogpt", "ours")}
    times = {name: [] for name in programs}
    order = list(programs)
    for round_ in range(args.rounds):
        for name in order if round_ % 2 == 0 else reversed(order):
            done = subprocess.run(programs[name], env=envs[name], capture_output=True, text=True, cwd=work)
            if done.returncode:
                sys.exit(f"{name} failed: {done.stderr[-2000:]}")
            times[name].append(median_ms(done.stdout, args.skip))
            print(f"round {round_ + 1}: {name} {times[name][-1]:.2f} ms/step", flush=True)
    ref, our = statistics.median(times["build-nanogpt"]), statistics.median(times["ours"])
    print("huge pages: " + ", ".join(f"{name} {'on' if e['THP_MEM_ALLOC_ENABLE'] == '1' else 'off'}"
                                     for name, e in envs.items()))
    print(f"{args.dtype}, {args.threads} thread(s), {args.total_batch_size} tokens/step ({args.batch_size} x "
          f"{args.seq_len}): build-nanogpt {ref:.2f} ms/step, ours {our:.2f} ms/step, ours at {ref / our:.3f}x its speed")


if __name__ == "__main__":
    main()
