"""
The peak memory of training steps: measured on the CPU, computed by nanogpt.arguments.estimated_bytes, and
docs/speed.md's "Memory" tables (markdown, on stdout). Not part of the tests.

    python bench/memory_table.py check      # measured against the formula at small shapes (~40 minutes, 2 cores)
    python bench/memory_table.py gpu        # computed: d12 and d24 at T=1024, micro-batch 1-64, bf16; the picks
    python bench/memory_table.py measure --recipe modern --n_layer 2 --n_embd 64 --n_head 2 --seq_len 64 \
        --batch_size 4 --dtype bf16 [--recompute] [--loss_impl chunked] [--vocab_size 4096] [--fake]

A measurement takes train_gpt2.py's flags: the model of its GPTConfig (make_gpt), the recipe's optimizer
(configure_optimizers, as set_up makes it), --recompute and --loss_impl, and runs training steps as train_gpt2.py's
loop runs them (2 optimizer steps of 2 micro-steps: the second micro-step holds the first's gradients and the
optimizer's state) in a fresh process, on the CPU, eagerly, in --dtype (bf16: autocast, as on a GPU). Its peaks:
- allocated: of the bytes the CPU allocator holds (torch.profiler's memory events: every allocation, those inside
  kernels too);
- tensors: of the live tensors as torch.distributed._tools.mem_tracker.MemTracker sees them at the operators (not
  what a kernel allocates inside it); with --fake, under FakeTensorMode, which allocates nothing, so shapes of any
  size can be traced (it matches the real run's MemTracker byte for byte at small shapes);
- rss: the process's resident memory (VmHWM) less its resident memory before the model was built, with glibc told
  to give every block of 64 KiB or more its own mapping, returned when freed, so that it follows the tensors (it
  adds what is not a tensor: the autograd graph, oneDNN's and OpenMP's buffers).
--vocab_size here may be below the tokenizer's 50,257 (train_gpt2.py refuses it): a small vocabulary weighs the
blocks against the loss head.
"""

import argparse
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
from contextlib import nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanogpt.arguments import GPU_CONTEXT_BYTES, GPU_FRAGMENTATION, fits_on_gpu  # noqa: E402
from nanogpt.optimizers import OptimizerSettings  # noqa: E402

GiB = 2**30
MiB = 2**20
# glibc: blocks of 64 KiB and more mapped on their own and unmapped when freed (save_memory.py does the same)
MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
STEPS, MICRO_STEPS = 2, 2


def vm_kb(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def model_and_flags(argv):
    """train_gpt2's parsed flags and the GPTConfig they make, with bench's --vocab_size (any size) over it."""
    import train_gpt2

    vocab_size = None
    if "--vocab_size" in argv:
        i = argv.index("--vocab_size")
        vocab_size, argv = int(argv[i + 1]), argv[:i] + argv[i + 2:]
    args = train_gpt2.parse_args(argv)
    args.dtype = "fp32" if args.dtype == "auto" else args.dtype  # the CPU's; fp16 autocast is a GPU's
    config = train_gpt2.model_config(args)
    if vocab_size:
        config = dataclasses.replace(config, vocab_size=vocab_size)
    return args, config


def parameter_counts(config):
    import torch
    import train_gpt2
    from nanogpt.arguments import counted_parameters

    with torch.device("meta"):
        return counted_parameters(train_gpt2.make_gpt(config))


def formula(args, config, device_type="cpu", moments=False):
    """nanogpt.arguments' estimate for these flags on device_type (moments: every moment's, by name)."""
    from nanogpt.arguments import estimated_bytes, peak_bytes_by_moment

    estimate = peak_bytes_by_moment if moments else estimated_bytes
    return estimate(config, parameter_counts(config), args.batch_size, args.seq_len, args.dtype, args.optimizer,
                    args.recompute, args.loss_impl, device_type)


def measure(argv, fake=False):
    """The peaks of training steps run by the flags argv (train_gpt2.py's, and --vocab_size) in this process, in
    bytes: allocated (the CPU allocator's, from torch.profiler's memory events), tensors (MemTracker's) and rss;
    with fake, tensors only, under FakeTensorMode."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.profiler import ProfilerActivity, profile

    import train_gpt2
    from nanogpt.fitting import local_optimizers
    from nanogpt.runtime import autocast_context
    from nanogpt.sharding import clip_grad_norm

    args, config = model_and_flags(argv)
    B, T = args.batch_size, args.seq_len
    torch.manual_seed(0)
    gc.collect()  # tensors made before (in an earlier measure() of this process) freed now, not while it counts
    if not fake:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here
        rss_before = vm_kb("VmRSS")
    allocations = nullcontext() if fake else profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with allocations as profiler, FakeTensorMode() if fake else nullcontext():
        model = train_gpt2.make_gpt(config)
        model.recompute, model.loss_impl = args.recompute, args.loss_impl
        optimizer = model.configure_optimizers(OptimizerSettings.of(args), "cpu")
        tracker = MemTracker()
        tracker.track_external(model, *local_optimizers(optimizer))
        autocast = autocast_context("cpu", args.dtype)
        with tracker:
            for _step in range(STEPS):
                for _micro_step in range(MICRO_STEPS):  # as train_gpt2.py's loop: its objective, batch_loss
                    x = torch.zeros((B, T), dtype=torch.long)
                    y = torch.zeros((B, T), dtype=torch.long)
                    with autocast:
                        loss, _ = train_gpt2.batch_loss(model, x, y)
                    loss = loss / MICRO_STEPS
                    loss.backward()
                    tracker.reset_mod_stats()  # (it keeps per-module statistics of one forward and backward)
                clip_grad_norm(model, args.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        peak = tracker.get_tracker_snapshot("peak")
    result = {"tensors": sum(device["Total"] for device in peak.values())}
    if not fake:
        result["rss"] = (vm_kb("VmHWM") - rss_before) * 1024
        # every allocation and free of the CPU allocator, those inside kernels too, which MemTracker (it sees the
        # operators' inputs and outputs) does not see: logsumexp's temporary of its input's size, say
        held = result["allocated"] = 0
        events = [e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        for event in sorted(events, key=lambda e: e.start_ns()):
            held += event.nbytes()
            result["allocated"] = max(result["allocated"], held)
    return result


def measure_in_subprocess(argv, fake=False):
    """measure() in a fresh process with MEASURE_ENV (what one process's allocator holds does not carry over)."""
    command = [sys.executable, os.path.abspath(__file__), "measure", *argv, "--json"] + (["--fake"] if fake else [])
    out = subprocess.run(command, env={**os.environ, **MEASURE_ENV}, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -----------------------------------------------------------------------------
# the check: measured against the formula

SHAPES = {  # name: flags (heads of 32 channels)
    "2x64, T=64, B=4": "--n_layer 2 --n_embd 64 --n_head 2 --seq_len 64 --batch_size 4",
    "4x256, T=256, B=2, V=8192": "--n_layer 4 --n_embd 256 --n_head 8 --seq_len 256 --batch_size 2 --vocab_size 8192",
    "d12, T=128, B=2": "--model d12 --seq_len 128 --batch_size 2",
}
RECIPE_FLAGS = {"gpt2": "--recipe gpt2", "modern": "--recipe modern", "speedrun": "--recipe speedrun"}
OPTIONS = {"": "", "recompute": "--recompute", "chunked": "--loss_impl chunked",
           "recompute, chunked": "--recompute --loss_impl chunked"}
# beyond the grid: two chunks of the chunked head (BT = 16,384 rows at GPT-2's vocabulary); a tiny vocabulary, where
# a recomputed block's backward is the peak
EXTRA = [("2x64, T=1024, B=16", "gpt2", "chunked", "--n_layer 2 --n_embd 64 --n_head 2 --seq_len 1024 --batch_size 16"),
         ("2x64, T=48, B=5, V=320", "modern", "recompute",
          "--n_layer 2 --n_embd 64 --n_head 2 --seq_len 48 --batch_size 5 --vocab_size 320")]


def check_cases():
    for shape, flags in SHAPES.items():
        for recipe in RECIPE_FLAGS:
            for option in OPTIONS:
                yield shape, recipe, option, flags
    for shape, recipe, option, flags in EXTRA:
        yield shape, recipe, option, flags


def check(dtypes, limit=None):
    print("| shape | recipe | options | dtype | allocated (MiB) | MemTracker (MiB) | RSS - allocated (MiB) | "
          "formula (MiB) | formula / allocated - 1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    errors = []
    for i, (shape, recipe, option, flags) in enumerate(check_cases()):
        if limit is not None and i >= limit:
            break
        for dtype in dtypes:
            argv = f"{RECIPE_FLAGS[recipe]} {OPTIONS[option]} {flags} --dtype {dtype}".split()
            measured = measure_in_subprocess(argv)
            computed = formula(*model_and_flags(argv))
            errors.append(computed / measured["allocated"] - 1)
            print(f"| {shape} | {recipe} | {option or '-'} | {dtype} | {measured['allocated'] / MiB:.1f} | "
                  f"{measured['tensors'] / MiB:.1f} | {(measured['rss'] - measured['allocated']) / MiB:+.1f} | "
                  f"{computed / MiB:.1f} | {errors[-1]:+.3%} |", flush=True)
    print(f"\nformula / allocated - 1: from {min(errors):+.3%} to {max(errors):+.3%} over {len(errors)} measurements")


# -----------------------------------------------------------------------------
# the GPU tables: computed

MODELS = ("d12", "d24")
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
VARIANTS = {"gpt2": "--recipe gpt2", "gpt2 recompute": "--recipe gpt2 --recompute",
            "gpt2 chunked": "--recipe gpt2 --loss_impl chunked",
            "gpt2 both": "--recipe gpt2 --recompute --loss_impl chunked",
            "modern": "--recipe modern", "modern recompute": "--recipe modern --recompute",
            "modern chunked": "--recipe modern --loss_impl chunked",
            "modern both": "--recipe modern --recompute --loss_impl chunked",
            "speedrun": "--recipe speedrun", "speedrun recompute": "--recipe speedrun --recompute",
            "speedrun chunked": "--recipe speedrun --loss_impl chunked",
            "speedrun both": "--recipe speedrun --recompute --loss_impl chunked"}
CARDS_GIB = (24, 40, 80)
# (cells where the peak is not logsumexp's temporary inside the kernel, which tracing does not see)
TRACED = [("d12", "gpt2", 1), ("d12", "gpt2", 8), ("d12", "modern chunked", 16), ("d24", "modern recompute", 4),
          ("d24", "speedrun both", 16)]


def gpu_argv(model, variant, batch_size):
    return f"--model {model} {VARIANTS[variant]} --seq_len 1024 --batch_size {batch_size} --dtype bf16".split()


def fits(peak_bytes, card_gib):
    return fits_on_gpu(peak_bytes, card_gib * GiB)


def gpu(trace=True):
    computed = {}
    for model in MODELS:
        print(f"\n{model}, T=1024, bf16 autocast, no torch.compile: the computed peak in GiB by micro-batch\n")
        print("| recipe | options | " + " | ".join(map(str, BATCH_SIZES)) + " |")
        print("| --- | --- |" + " --- |" * len(BATCH_SIZES))
        for variant, flags in VARIANTS.items():
            row = []
            for b in BATCH_SIZES:
                args, config = model_and_flags(gpu_argv(model, variant, b))
                computed[model, variant, b] = formula(args, config, "cuda")
                row.append(f"{computed[model, variant, b] / GiB:.1f}")
            options = " ".join(f for f in flags.split()[2:]) or "-"
            print(f"| {variant.split()[0]} | {options} | " + " | ".join(row) + " |")
    print(f"\nThe micro-batch --batch_size auto would take (computed: the largest of {', '.join(map(str, BATCH_SIZES))} "
          f"whose peak x {1 + GPU_FRAGMENTATION:.2f} + {GPU_CONTEXT_BYTES / GiB:g} GiB fits; 524,288 tokens a step on one "
          "GPU):\n")
    print("| model | recipe | " + " | ".join(f"{c} GiB" for c in CARDS_GIB) + " |")
    print("| --- | --- |" + " --- |" * len(CARDS_GIB))
    for model in MODELS:
        for recipe in ("gpt2", "modern", "speedrun"):
            picks = [max([b for b in BATCH_SIZES if fits(computed[model, recipe, b], c)], default=None)
                     for c in CARDS_GIB]
            print(f"| {model} | {recipe} | " + " | ".join(str(p) if p else "none" for p in picks) + " |")
    if trace:
        print("\nThe formula against the real model's tensors traced under FakeTensorMode at these shapes (CPU "
              "kernels):\n")
        print("| model | variant | micro-batch | traced (GiB) | formula (GiB) | formula / traced |")
        print("| --- | --- | --- | --- | --- | --- |")
        for model, variant, b in TRACED:
            traced = measure_in_subprocess(gpu_argv(model, variant, b), fake=True)["tensors"]
            on_cpu = formula(*model_and_flags(gpu_argv(model, variant, b)))  # the CPU's AdamW, as traced
            print(f"| {model} | {variant} | {b} | {traced / GiB:.3f} | {on_cpu / GiB:.3f} | {on_cpu / traced - 1:+.3%} |",
                  flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("check", "gpu", "measure"))
    p.add_argument("--fake", action="store_true", help="measure: under FakeTensorMode (no RSS)")
    p.add_argument("--json", action="store_true", help="measure: one line of JSON")
    p.add_argument("--dtypes", default="fp32,bf16", help="check: the dtypes measured")
    p.add_argument("--limit", type=int, help="check: only the first N cases")
    p.add_argument("--no_trace", action="store_true", help="gpu: without the FakeTensorMode cross-check")
    known, rest = p.parse_known_args()
    if known.what == "measure":
        result = measure(rest, known.fake)
        args, config = model_and_flags(rest)
        result["formula"] = formula(args, config)
        if known.json:
            print(json.dumps(result))
        else:
            moments = formula(args, config, moments=True)
            for name, value in result.items():
                print(f"{name}: {value / MiB:.2f} MiB")
            print("formula's moments: " + ", ".join(f"{k} {v / MiB:.2f} MiB" for k, v in moments.items()))
    elif known.what == "check":
        check(known.dtypes.split(","), known.limit)
    else:
        gpu(trace=not known.no_trace)


if __name__ == "__main__":
    main()
