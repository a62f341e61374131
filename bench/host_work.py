"""
What a training step asks of the host, counted on the CPU: the aten operations it issues (in the model's forward
and backward, in the optimizer's step, and around them) and the reads of a tensor's value on the host, each of
which makes a GPU's host wait for the device. Ours (train_gpt2.py, eager) beside build-nanogpt's loop
(../shared/gpu/build_nanogpt_train_gpt2.py, made runnable by make_reference.py), the same d12 model at a small batch
(operations do not depend on the batch's size), evaluations off.

    python bench/host_work.py                      # the table of docs/speed.md ("What a step asks of the host")
    python bench/host_work.py --n_layer 2 --n_embd 64 --n_head 2 --runs ours   # a quick look

A step runs from its first forward to the next step's first forward (its data for the next step included);
"before the optimizer" is from that first forward to the optimizer's step. tests/test_gpu_ready.py holds ours to it.
"""

import argparse
import collections
import contextlib
import os
import runpy
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# aten operations whose result the host reads (on a GPU each one waits for the device to get there)
HOST_READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "allclose", "masked_select"}


class HostWork(TorchDispatchMode):
    """Counts, per training step, the aten operations by phase (model: inside a module's forward or a backward;
    optimizer: inside an optimizer's step; host: the rest) and the host's reads of a tensor's value, with those before
    the optimizer's step apart. Tensor.tolist() reads without an aten operation on a CPU: it is patched to count as
    one read. Use it as a context around a run; `steps` holds a Counter a step."""

    def __init__(self, optimizer_classes=()):
        super().__init__()
        self.steps, self.phase, self.depth, self.optimizer_started = [], "host", 0, False
        self.optimizer_classes = (torch.optim.AdamW, *optimizer_classes)
        self.patches = contextlib.ExitStack()

    def __enter__(self):
        self.wrap(torch.nn.Module, "__call__", "model")
        self.wrap(torch.Tensor, "backward", "model")
        for cls in self.optimizer_classes:
            self.wrap(cls, "step", "optimizer")
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.read()
            with self.paused():
                return tolist(tensor)
        self.patch(torch.Tensor, "tolist", counted_tolist)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.patches.close()
        return out

    def patch(self, owner, name, value):
        if name in owner.__dict__:
            self.patches.callback(setattr, owner, name, owner.__dict__[name])
        else:  # inherited (AdamW's step is Adam's)
            self.patches.callback(delattr, owner, name)
        setattr(owner, name, value)

    def wrap(self, owner, name, phase):
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if self.depth == 0:
                self.enter(phase)
            self.depth += 1
            try:
                return inner(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.phase = "host"
        self.patch(owner, name, wrapped)

    def enter(self, phase):
        if phase == "model" and (not self.steps or self.optimizer_started):  # a step's first forward
            self.steps.append(collections.Counter())
            self.optimizer_started = False
        if phase == "optimizer":
            self.optimizer_started = True
        self.phase = phase

    @contextlib.contextmanager
    def paused(self):
        phase, self.phase = self.phase, None
        try:
            yield
        finally:
            self.phase = phase

    def read(self):
        if self.steps and self.phase is not None:
            self.steps[-1]["host reads"] += 1
            if not self.optimizer_started:
                self.steps[-1]["host reads before the optimizer"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.phase is not None and self.steps:
            self.steps[-1][f"{self.phase} ops"] += 1
            if func.overloadpacket.__name__ in HOST_READS:
                self.read()
        return func(*args, **(kwargs or {}))


def count_ours(flags, optimizer_classes=None):
    """HostWork's steps of train_gpt2.main(flags), in this process."""
    import train_gpt2
    from nanogpt.muon import Muon
    from nanogpt.optimizers import MatricesWithAdamW

    with HostWork(optimizer_classes or (Muon, MatricesWithAdamW)) as work:
        train_gpt2.main(flags)
    return work.steps


def count_build_nanogpt(data_dir, log_dir, B, T, total, steps):
    """HostWork's steps of build-nanogpt's train_gpt2.py (its d12, eager on the CPU, fp32), in this process."""
    bench = load_bench("bench_train_step")
    npy = os.path.join(log_dir, "npy")
    bench.npy_shards(data_dir, npy)
    script = os.path.join(log_dir, "reference.py")
    bench.reference_script(script, fp32=True)
    os.environ.update(REF_DATA=npy, REF_LOG=os.path.join(log_dir, "ref"), REF_B=str(B), REF_T=str(T),
                      REF_TOTAL=str(total), REF_STEPS=str(steps))
    with HostWork() as work:
        runpy.run_path(script, run_name="__main__")
    return work.steps


def load_bench(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KEYS = ("host reads before the optimizer", "host reads", "model ops", "optimizer ops", "host ops")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", default=os.path.join(ROOT, "..", "shared", "bench_data"))
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--n_head", type=int, default=12)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--runs", default="build-nanogpt,ours,ours-fused,speedrun-fused")
    args = p.parse_args(argv)
    B, T, steps = 1, 64, 3
    total = 2 * B * T  # two micro-steps
    shape = ["--n_layer", str(args.n_layer), "--n_head", str(args.n_head), "--n_embd", str(args.n_embd)]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--data_dir", os.path.abspath(args.data_dir), "--batch_size", str(B), "--seq_len", str(T),
                  "--total_batch_size", str(total), "--max_steps", str(steps), "--device", "cpu", "--dtype", "fp32",
                  "--no_compile", "--eval_every", "0", "--hellaswag_every", "0", "--sample_every", "0",
                  "--save_every", "0", "--no_shuffle", *shape]
        runs = {"ours": [], "ours-fused": ["--fused_adamw"], "speedrun-fused": ["--recipe", "speedrun", "--fused_adamw"]}
        for name in args.runs.split(","):
            log_dir = os.path.join(tmp, name)
            if name == "build-nanogpt":
                if (args.n_layer, args.n_head, args.n_embd) != (12, 12, 768):
                    sys.exit("build-nanogpt's script trains its d12 only")
                rows[name] = count_build_nanogpt(args.data_dir, log_dir, B, T, total, steps)
            else:
                rows[name] = count_ours([*common, *runs[name], "--log_dir", log_dir])
    print(f"per training step (the second of {steps}; {total // (B * T)} micro-steps), eager on the CPU:")
    print("| run | " + " | ".join(KEYS) + " |")
    print("|" + " --- |" * (len(KEYS) + 1))
    for name, steps_of_run in rows.items():
        step = steps_of_run[1]
        print(f"| {name} | " + " | ".join(str(step[k]) for k in KEYS) + " |")


if __name__ == "__main__":
    main()
