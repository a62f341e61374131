"""
Peak resident memory (RSS) per rank of 2-process training and of its checkpoint save, for plain DDP,
--zero 1 and --fsdp (not part of the tests).

    python bench/save_memory.py                          # the 96M shape: 8 layers, 768 wide, T=64
    python bench/save_memory.py --modes zero --n_layer 2 --n_embd 64 --n_head 2
    python bench/save_memory.py --max_steps 3 --save_every 1     # what rank 0 keeps between saves

For each mode it runs `torchrun --standalone --nproc_per_node=2` on this file, which trains
--max_steps steps (2) of train_gpt2.py on the CPU (fp32, no compile, B=2, T=64, evals off) on shards
made by tests/conftest.make_shards, with a checkpoint after the last step and every --save_every
steps. Each process reads VmHWM, the kernel's high-water mark of its resident memory, at the
borders of these phases, and resets it at each (`5` into /proc/self/clear_refs):

    train   from the start to the first save (the model, the steps, the optimizer state)
    gather  gathered_state_dicts gathering the state on rank 0 (every rank takes part)
    after   from there to the next save or the end: rank 0 writes the file (the others wait),
            then any further steps

The processes run with MALLOC_MMAP_THRESHOLD_=65536 and OMP_NUM_THREADS=1: glibc would otherwise keep
freed blocks of up to 32 MB inside the process, hiding what sharding frees (docs/scale.md).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE_RE = re.compile(r"^save_memory rank (\d+):((?: \w+ \d+)+)$", re.M)
MODES = {"ddp": [], "zero": ["--zero", "1"], "fsdp": ["--fsdp"]}


def peak_rss_kb():
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(argv):
    """One torchrun process: train_gpt2's run, with the peaks taken around gathered_state_dicts."""
    sys.path.insert(0, ROOT)
    import train_gpt2
    from nanogpt import run
    from nanogpt.cli import run_cli

    peaks = []  # (phase, kB), in order
    gather, summary = run.gathered_state_dicts, run.run_summary

    def measured_gather(*args, **kwargs):
        peaks.append(("after" if peaks else "train", peak_rss_kb()))
        reset_peak()
        states = gather(*args, **kwargs)
        peaks.append(("gather", peak_rss_kb()))
        reset_peak()
        return states

    def measured_summary(*args, **kwargs):  # every rank calls it once the last save is done
        peaks.append(("after", peak_rss_kb()))
        print(f"save_memory rank {os.environ['RANK']}:" + "".join(f" {phase} {kb}" for phase, kb in peaks),
              file=sys.stderr, flush=True)
        return summary(*args, **kwargs)

    run.gathered_state_dicts, run.run_summary = measured_gather, measured_summary  # where Run looks them up
    run_cli(lambda: train_gpt2.main(argv))


def run_mode(mode, args, data, work):
    flags = ["--device", "cpu", "--dtype", "fp32", "--no_compile", "--n_layer", str(args.n_layer), "--n_head",
             str(args.n_head), "--n_embd", str(args.n_embd), "--seq_len", "64", "--batch_size", "2",
             "--total_batch_size", "256", "--max_steps", str(args.max_steps), "--save_every", str(args.save_every),
             "--eval_every", "0", "--hellaswag_every", "0",
             "--sample_every", "0", "--data_dir", data, "--log_dir", os.path.join(work, mode), *MODES[mode]]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             os.path.abspath(__file__), "--worker", *flags],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{mode}: torchrun failed\n{result.stderr[-3000:]}")
    found = sorted((int(rank), phases.split()) for rank, phases in LINE_RE.findall(result.stderr))
    if [rank for rank, _ in found] != [0, 1]:
        sys.exit(f"{mode}: no measurement from each rank\n{result.stderr[-3000:]}")
    return found


def main():
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--n_layer", type=int, default=8)
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--save_every", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import make_shards

    with tempfile.TemporaryDirectory() as work:
        data = make_shards(os.path.join(work, "data"))
        print("peak RSS per rank, MB (VmHWM, reset between phases)")
        for mode in args.modes:
            for rank, phases in run_mode(mode, args, data, work):
                print(f"{mode:6} rank {rank}:" + "".join(f" {name} {int(kb) / 1024:6.0f}"
                                                          for name, kb in zip(phases[::2], phases[1::2])), flush=True)


if __name__ == "__main__":
    main()
