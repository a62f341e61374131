"""nanogpt.arguments.estimated_bytes, the memory a training step needs, against a measurement: the peak of the
bytes the CPU allocator holds through real training steps (bench/memory_table.py's measure: the model and optimizer
of each recipe, run as train_gpt2.py's loop runs them, every allocation seen by torch.profiler) at a small shape; and
check_memory's refusal, which must let a run through that fits.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_memory_estimate.py
"""

import pytest
import torch

from nanogpt import arguments
from nanogpt.cli import UserError
from test_bench import load_bench

# 2 blocks of 64 at GPT-2's vocabulary, as the recipes have it: the loss head dominates, as in the GPT-2 models
SHAPE = "--n_layer 2 --n_embd 64 --n_head 2 --seq_len 32 --batch_size 2"
# What the formula leaves out are tensors of a few bytes per row (the loss, the chunked head's per-row sums and
# targets) and the optimizer's step counters: measured at most 0.002% (1.5 KB) of the peak at SHAPE; 1% is room. It
# counts only tensors alive at one moment, so it never exceeds the peak (beyond a few bytes).
TOLERANCE = 0.01


@pytest.fixture(scope="module")
def memory_table():
    return load_bench("memory_table")


def within_tolerance(estimate, measured):
    return measured * (1 - TOLERANCE) <= estimate <= measured * (1 + 1e-6)


def assert_estimate_is_the_measured_peak(memory_table, flags):
    argv = flags.split()
    measured = memory_table.measure(argv)["allocated"]
    estimate = memory_table.formula(*memory_table.model_and_flags(argv))
    assert within_tolerance(estimate, measured), (
        f"estimate {estimate} against a measured peak of {measured}: what a model's layers keep for backward is "
        "described in nanogpt/arguments.py's peak_bytes_by_moment; its parameters, their gradients and optimizer "
        "state are counted on the model (counted_parameters)")


RECIPES = ("gpt2", "modern", "speedrun")
OPTIONS = ("--dtype fp32", "--dtype bf16", "--dtype bf16 --recompute", "--dtype fp32 --loss_impl chunked",
           "--dtype bf16 --loss_impl chunked", "--dtype bf16 --recompute --loss_impl chunked")
QUICK = {("modern", "--dtype bf16 --recompute"), ("speedrun", "--dtype bf16 --loss_impl chunked")}  # and gpt2's below


@pytest.mark.parametrize("recipe, options", [
    pytest.param(r, o, marks=() if (r, o) in QUICK else pytest.mark.slow) for r in RECIPES for o in OPTIONS])
def test_the_estimate_is_the_measured_peak_of_a_training_steps_tensors(memory_table, recipe, options):
    assert_estimate_is_the_measured_peak(memory_table, f"--recipe {recipe} {SHAPE} {options}")


def test_a_new_matrix_counts_in_the_estimate_without_an_edit():
    """A 2-D weight added outside the blocks (a second head's projection, say) is counted on the model: its
    weight, gradient and optimizer state (AdamW's two moments, Muon's one), and under autocast its low-precision
    copy (a linear layer's), at every moment of the step."""
    import train_gpt2

    config = train_gpt2.GPTConfig(arch="llama", block_size=32, vocab_size=512, n_layer=2, n_head=2, n_embd=32)

    class WithProjection(train_gpt2.GPT):
        def __init__(self, config):
            super().__init__(config)
            self.projection = torch.nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)

    with torch.device("meta"):
        plain, more = (arguments.counted_parameters(cls(config)) for cls in (train_gpt2.GPT, WithProjection))
    n = 3 * config.n_embd**2
    for optimizer, state in (("adamw", 8), ("muon", 4)):
        for dtype, copy in (("fp32", 0), ("bf16", 2)):
            before, after = (arguments.peak_bytes_by_moment(config, p, 2, 32, dtype, optimizer) for p in (plain, more))
            grown = {k: after[k] - before[k] for k in before}
            assert grown["embedding gradient"] == grown["optimizer step"] == (8 + state) * n  # (no copy held)
            assert grown["head forward"] == (8 + state + copy) * n  # autocast's copies, all held at forward's end
            assert all(grown[k] in ((8 + state) * n, (8 + state + copy) * n) for k in grown), (optimizer, dtype)


# A shape where the blocks' activations, not the loss head, are most of the peak (a vocabulary of 256: logits ~40%
# of it at 512 tokens, the blocks' activations ~35%): what each model option makes its layers keep shows here.
BLOCKS_SHAPE = "--n_layer 2 --n_embd 64 --n_head 2 --seq_len 128 --batch_size 4 --vocab_size 256"
MODEL_OPTIONS = [f"--recipe {recipe} {option}".strip() for recipe, options in (
    ("gpt2", ["", "--mlp_act swiglu", "--mlp_act relu2", "--logit_softcap 15", "--zero_init"]),
    ("modern", ["", "--mlp_act relu2", "--mlp_act gelu", "--tie_embeddings", "--n_kv_head 1", "--qk_norm",
                "--logit_softcap 15"]),
    ("speedrun", ["", "--no_x0_mix", "--no_value_embeds", "--no_unet_skips", "--logit_softcap 0", "--mlp_act swiglu",
                  "--no_qk_norm", "--n_layer 3"])) for option in options]


@pytest.mark.parametrize("options, dtype", [
    pytest.param(o, d, marks=() if (o, d) in {("--recipe modern --qk_norm", "bf16"), ("--recipe gpt2", "fp32")}
                 else pytest.mark.slow)
    for o in MODEL_OPTIONS for d in (("fp32", "bf16") if o.count("--") == 1 else ("bf16",))])
def test_the_estimate_follows_each_model_option_where_the_blocks_dominate(memory_table, options, dtype):
    assert_estimate_is_the_measured_peak(memory_table, f"{BLOCKS_SHAPE} {options} --dtype {dtype}")


def test_a_run_that_fits_is_let_through_and_one_that_does_not_is_refused(memory_table, monkeypatch):
    """With memory between the measured peaks of micro-batches 2 and 4 (CPU, fp32: what the refusal sees), and the
    process's margin beside them (CPU_PROCESS_MARGIN: what it holds beyond its tensors once it trains, which the test
    under a real cgroup below checks), check_memory lets the run of 2 start and refuses the run of 4."""
    import train_gpt2

    peaks = {}
    for batch_size in (2, 4):
        argv = f"--recipe gpt2 {SHAPE} --dtype fp32 --batch_size {batch_size}".split()
        peaks[batch_size] = memory_table.measure(argv)["allocated"]
        assert within_tolerance(memory_table.formula(*memory_table.model_and_flags(argv)), peaks[batch_size])
    assert peaks[2] < peaks[4]
    monkeypatch.setattr(arguments, "available_memory_bytes",
                        lambda: (peaks[2] + peaks[4]) // 2 + arguments.CPU_PROCESS_MARGIN)
    for batch_size in (2, 4):
        args = train_gpt2.parse_args(f"--recipe gpt2 {SHAPE} --batch_size {batch_size}".split())
        config = train_gpt2.model_config(args)
        with torch.device("meta"):
            params = arguments.counted_parameters(train_gpt2.make_gpt(config))
        if batch_size == 4:
            with pytest.raises(UserError, match="needs at least"):
                arguments.check_memory(config, params, args, "fp32", "cpu", 1)
        else:
            arguments.check_memory(config, params, args, "fp32", "cpu", 1)


@pytest.mark.parametrize("model, fix", [("d12", "or use --model tiny"),
                                        ("tiny", "or use a smaller --n_layer/--n_embd")])
def test_the_refusal_offers_a_smaller_model_than_the_runs(model, fix, monkeypatch):
    """--model tiny is offered to a run that does not have it; a tiny run is told to shrink its shape."""
    import train_gpt2

    args = train_gpt2.parse_args(["--model", model, "--device", "cpu"])
    config = train_gpt2.model_config(args)
    with torch.device("meta"):
        params = arguments.counted_parameters(train_gpt2.make_gpt(config))
    monkeypatch.setattr(arguments, "available_memory_bytes", lambda: 4 * params.total)  # the weights, no more
    with pytest.raises(UserError, match="needs at least") as refusal:
        arguments.check_memory(config, params, args, "fp32", "cpu", 1)
    assert str(refusal.value).endswith(fix), str(refusal.value)


def fake_machine(tmp, cgroup_lines, files, mem_available_kb=64 * 2**20):
    """A /proc and a /sys/fs/cgroup of a machine with 64 GiB available (unless told): (proc, cgroup root)."""
    proc, root = tmp / "proc", tmp / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {2 * mem_available_kb} kB\nMemAvailable: {mem_available_kb} kB\n")
    (proc / "self" / "cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text + "\n")
    return str(proc), str(root)


GIB = 2**30


@pytest.mark.parametrize("cgroup_lines,files,room", [
    # cgroup v2: the job's 8 GiB limit above a step's unlimited cgroup, 3 GiB of it used
    (["0::/job/step"], {"job/memory.max": str(8 * GIB), "job/memory.current": str(3 * GIB),
                        "job/step/memory.max": "max", "job/step/memory.current": str(GIB)}, 5 * GIB),
    # v2 inside a container (its cgroup seen as /): the smaller of two limits
    (["0::/"], {"memory.max": str(2 * GIB), "memory.current": str(GIB // 2)}, GIB + GIB // 2),
    # cgroup v1: docker --memory 4g, its path outside the container not mounted inside (the root is the container's)
    (["4:memory:/docker/abc", "0::/"], {"memory/memory.limit_in_bytes": str(4 * GIB),
                                         "memory/memory.usage_in_bytes": str(GIB)}, 3 * GIB),
    # no limits: v1's huge number, v2's "max"; the machine's MemAvailable then
    (["4:memory:/", "0::/"], {"memory/memory.limit_in_bytes": "9223372036854771712",
                              "memory/memory.usage_in_bytes": str(GIB), "memory.max": "max",
                              "memory.current": str(GIB)}, None),
])
def test_available_memory_is_the_smaller_of_the_machine_and_its_cgroup(tmp_path, cgroup_lines, files, room):
    proc, root = fake_machine(tmp_path, cgroup_lines, files)
    assert arguments.cgroup_room(proc, root) == room
    assert arguments.available_memory_bytes(proc, root) == (room or 64 * GIB)
    proc, root = fake_machine(tmp_path / "small", cgroup_lines, files, mem_available_kb=2**20)  # 1 GiB available
    assert arguments.available_memory_bytes(proc, root) == min(room or GIB, GIB)


def child_memory_cgroup(name):
    """A new memory cgroup under this process's own (v1 or v2), where the machine lets this process make one and set
    its limit (root, a writable hierarchy): (its folder, the file of its limit); else the test is skipped."""
    import os

    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        pytest.skip("no /proc/self/cgroup")
    places = [(os.path.join("/sys/fs/cgroup/memory", path.lstrip("/")), "memory.limit_in_bytes")
              for _, controllers, path in lines if "memory" in controllers.split(",")]
    places += [(os.path.join("/sys/fs/cgroup", path.lstrip("/")), "memory.max")
               for _, controllers, path in lines if controllers == ""]
    for parent, limit_file in places:
        folder = os.path.join(parent, name)
        try:
            os.mkdir(folder)
        except OSError:
            continue
        if os.path.exists(os.path.join(folder, limit_file)):
            return folder, limit_file
        os.rmdir(folder)
    pytest.skip("cannot make a memory cgroup here (not root, or no writable cgroup hierarchy with memory)")


@pytest.mark.slow
def test_a_cpu_run_under_a_container_limit_is_refused_in_one_line_or_finishes_never_killed(tmp_path):
    """Under a real memory cgroup's limit (docker --memory, Kubernetes, Slurm: the kernel kills a process that passes
    it, with no word), a CPU run of --model tiny either finishes or is refused in one line before any work: at
    limits from well below its resident peak to well above it, never killed. The run's own processes only: a cgroup
    made for the test under this process's, removed after."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    folder, limit_file = child_memory_cgroup(f"nanogpt-test-{os.getpid()}")
    argv = [sys.executable, os.path.join(ROOT, "train_gpt2.py"), "--model", "tiny", "--batch_size", "2",
            "--seq_len", "64", "--total_batch_size", "128", "--max_steps", "2", "--eval_every", "0",
            "--device", "cpu", "--dtype", "fp32", "--no_compile"]
    outcomes = {}
    try:
        for limit_mb in (440, 500, 650, 900, 1200):
            with open(os.path.join(folder, limit_file), "w") as f:
                f.write(str(limit_mb * 2**20))

            def enter_cgroup():
                with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

            result = subprocess.run([*argv, "--log_dir", str(tmp_path / f"log{limit_mb}")], cwd=ROOT,
                                    env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), capture_output=True,
                                    text=True, timeout=600, preexec_fn=enter_cgroup)
            lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
            if result.returncode == 2 and len(lines) == 1 and "this run needs at least" in lines[0]:
                outcomes[limit_mb] = "refused"
            elif result.returncode == 0:
                outcomes[limit_mb] = "finished"
            else:
                outcomes[limit_mb] = f"exit {result.returncode}: {result.stderr[-300:]!r}"
    finally:
        os.rmdir(folder)
    assert set(outcomes.values()) == {"refused", "finished"}, outcomes
    assert list(outcomes.values()) == sorted(outcomes.values(), reverse=True), outcomes  # refused below, then finishes
