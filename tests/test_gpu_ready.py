"""What a GPU would be given, counted on the CPU: the graphs torch.compile makes of a run, and the host's work per
training step. Dynamo and AOTAutograd trace on a CPU exactly as on a GPU (only the code generation differs), so a
recording backend (Dynamo's graph and its example inputs noted, then AOTAutograd's eager backend) shows which
graphs a run compiles, when, and whether their shapes are static. A TorchDispatchMode sees every aten operation the
host issues, and those that make it wait for the device (a tensor's value read on the host).

    python -m pytest -q tests/test_gpu_ready.py
"""

import importlib.util
import os

import pytest
import torch

import train_gpt2
from conftest import ROOT, TINY_FLAGS, make_shards, optional_package, run_script, write_hellaswag
from nanogpt.run import Run

pytestmark = pytest.mark.xdist_group("gpu_ready")


# -----------------------------------------------------------------------------
# Graphs


class GraphRecorder:
    """torch.compile with a recording backend: each graph Dynamo hands over is noted with what was compiled (the
    training module, the evaluations' or another callable), whether any of its sizes is symbolic (dynamic), and how
    many training steps had been logged when it was compiled. Each torch.compile call gets a RecordingBackend of its
    own, equal to another call's when their settings are, as inductor's are (one backend: its wrappers compare by
    mode, options and dynamic): Dynamo's cache takes an equal backend as the same, so a function compiled by several
    calls (--fsdp's Block.forward, once per Block) has one graph for all of them, as on a GPU."""

    def __init__(self, monkeypatch):
        self.graphs, self.steps = [], 0
        compile_ = torch.compile
        log_step = Run.log_step

        def recording_compile(target, **kwargs):
            kind = {"GPT": "training", "SpeedrunGPT": "training", "Evaluated": "evaluation"}.get(
                type(target).__name__, getattr(target, "__qualname__", "other"))  # a method: "Block.forward"
            kwargs.pop("backend", None)
            return compile_(target, backend=RecordingBackend(self, kind, kwargs), **kwargs)

        def counting_log_step(run, *args, **kwargs):
            self.steps += 1
            return log_step(run, *args, **kwargs)

        monkeypatch.setattr(torch, "compile", recording_compile)
        monkeypatch.setattr(Run, "log_step", counting_log_step)
        torch._dynamo.reset()

    def of(self, kind):
        return [g for g in self.graphs if g["kind"] == kind]


class RecordingBackend:
    """GraphRecorder's backend for one torch.compile call: notes each graph, then AOTAutograd's eager backend runs
    it. Equal to another of the same recorder whose call had the same settings (Dynamo compares backends with ==)."""

    def __init__(self, recorder, kind, settings):
        self.recorder, self.kind, self.settings = recorder, kind, dict(settings)

    def __eq__(self, other):
        if not isinstance(other, RecordingBackend):
            return NotImplemented
        return other.recorder is self.recorder and other.settings == self.settings

    __hash__ = None  # (as inductor's wrapper: equal, not hashed)

    def __call__(self, gm, example_inputs):
        symbolic = any(isinstance(x, torch.SymInt) or (torch.is_tensor(x) and any(
            isinstance(s, torch.SymInt) for s in x.shape)) for x in example_inputs)
        self.recorder.graphs.append({"kind": self.kind, "dynamic": symbolic, "after_step": self.recorder.steps})
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_ready")
    return make_shards(str(tmp / "data")), write_hellaswag(str(tmp / "hellaswag.jsonl"), n=8)


def compiled_run(shards, log_dir, *extra, hellaswag=True):
    """TINY_FLAGS compiled, 3 steps, validation and HellaSwag (its own batch shapes) at step 0 and the last step."""
    data, hellaswag_data = shards
    flags = [f for f in TINY_FLAGS if f != "--no_compile"]
    scored = ["--hellaswag_every", "2", "--hellaswag_data", hellaswag_data] if hellaswag else []
    train_gpt2.main([*flags, "--compile", "--data_dir", data, "--log_dir", str(log_dir), "--max_steps", "3",
                     "--eval_every", "2", *scored, "--save_every", "0", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["gpt2", "speedrun"])
@pytest.mark.parametrize("batch", [["--batch_size", "4"], ["--batch_size", "auto"]], ids=["explicit", "auto"])
def test_training_compiles_one_static_graph_whatever_the_evaluations_do(shards, tmp_path, monkeypatch, recipe, batch):
    recorder = GraphRecorder(monkeypatch)
    compiled_run(shards, tmp_path / "log", "--recipe", recipe, *[f for f in batch])
    training, evaluation = recorder.of("training"), recorder.of("evaluation")
    assert len(training) == 1, recorder.graphs  # the --batch_size auto trial's graph is the one training runs
    assert not training[0]["dynamic"]
    # the evaluations at step 0 ran first, on graphs of their own (HellaSwag's shapes make theirs dynamic)
    assert evaluation and all(g["after_step"] == 0 for g in evaluation), recorder.graphs
    assert any(g["dynamic"] for g in evaluation)  # the recorder can tell a dynamic graph


@pytest.mark.slow
@pytest.mark.parametrize("lever", [["--fp8"], ["--loss_impl", "fused"]], ids=["fp8", "fused"])
def test_the_speed_levers_compile_one_static_training_graph(shards, tmp_path, monkeypatch, lever):
    """--fp8 (torchao's layers, emulated here) and --loss_impl fused (one custom op; Triton's interpreter here): the
    training graph is one, static, compiled before step 0, as the plain run's."""
    name = lever[-1].lstrip("-")
    if not optional_package({"fp8": "torchao", "fused": "liger_kernel"}[name]):
        pytest.skip(f"the package of {' '.join(lever)} is not installed")
    if name == "fused":  # (the interpreter's gaps, as tests/test_fused_head.py fills them)
        from test_fused_head import interpret_as_compiled

        interpret_as_compiled(monkeypatch)
    recorder = GraphRecorder(monkeypatch)
    data, _ = shards
    flags = [f for f in TINY_FLAGS if f != "--no_compile"]
    train_gpt2.main([*flags, "--compile", "--data_dir", data, "--log_dir", str(tmp_path / "log"), "--max_steps", "2",
                     "--total_batch_size", "128", "--eval_every", "0", "--save_every", "0", *lever])
    training = recorder.of("training")
    assert len(training) == 1 and not training[0]["dynamic"] and training[0]["after_step"] == 0, recorder.graphs


@pytest.mark.slow
def test_a_micro_batch_that_did_not_fit_leaves_training_a_static_graph(shards, tmp_path, monkeypatch):
    from oom_worker import failing_above

    recorder = GraphRecorder(monkeypatch)
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_above(2))
    compiled_run(shards, tmp_path / "log", "--batch_size", "auto", hellaswag=False)  # (HellaSwag's rows: > 2)
    training = recorder.of("training")
    # the candidates that did not fit (8, 4) raise before their graph is whole; the one that fits is compiled once,
    # before any step, with static shapes, and training runs it
    assert training and all(not g["dynamic"] and g["after_step"] == 0 for g in training), recorder.graphs


@pytest.mark.slow
def test_under_ddp_the_micro_batch_trial_compiles_the_graph_ddp_splits(shards, tmp_path):
    """torchrun (gloo, one process): Dynamo's DDP optimizer splits training's graph at the gradient buckets (a graph a
    piece) with an explicit micro-batch; --batch_size auto's trial compiles the graph training then runs, so it must
    compile it inside DDP too: the same pieces, not one unsplit graph whose all-reduce waits for the whole backward."""
    data, _ = shards
    flags = [f for f in TINY_FLAGS if f != "--no_compile"]
    counts = {}
    for batch in ("4", "auto"):
        result = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                             os.path.join(ROOT, "tests", "torchrun_worker.py"), *flags, "--compile", "--batch_size",
                             batch, "--data_dir", data, "--log_dir", str(tmp_path / batch), "--max_steps", "2",
                             "--eval_every", "0", "--save_every", "0"], env={"COUNT_GRAPHS": "1"}, timeout=400)
        assert result.returncode == 0, result.stdout + result.stderr
        counts[batch] = int(result.stdout.split("training graphs ")[1].split()[0])
    assert counts["4"] > 1, counts  # the tiny model's buckets split it
    assert counts["auto"] == counts["4"], counts


# -----------------------------------------------------------------------------
# The host's work per training step


def host_work_of(shards, tmp_path, n_layer, *extra):
    """bench/host_work.py's counts of the second of three eager steps (2 micro-steps each), evaluations off."""
    spec = importlib.util.spec_from_file_location("host_work", os.path.join(ROOT, "bench", "host_work.py"))
    host_work = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_work)
    data, _ = shards
    flags = [*TINY_FLAGS, "--n_layer", str(n_layer), "--data_dir", data, "--log_dir", str(tmp_path / f"log{n_layer}"),
             "--max_steps", "3", "--total_batch_size", "256", "--batch_size", "4", "--seq_len", "32",
             "--eval_every", "0", "--save_every", "0", *extra]
    return host_work.count_ours(flags)[1]


@pytest.mark.parametrize("recipe", ["gpt2", "speedrun"])
def test_a_step_waits_once_and_its_host_work_does_not_grow_with_the_model(shards, tmp_path, recipe):
    """With the GPU's AdamW (fused): no read of a device value before the optimizer's step, one in all (the step's
    loss, norm and verdict, after it); the operations outside the model and the optimizer, and the fused AdamW's,
    the same for 2 and 4 layers; Muon's at most 6 more per matrix added (its stacks are per shape)."""
    small, large = (host_work_of(shards, tmp_path, n, "--recipe", recipe, "--fused_adamw") for n in (2, 4))
    for step in (small, large):
        assert step["host reads before the optimizer"] == 0, step
        assert 1 <= step["host reads"] <= 3, step
    assert small["host ops"] == large["host ops"], (small, large)
    assert large["model ops"] > small["model ops"]  # the counter sees the model's work grow
    matrices_added = 2 * (6 if recipe == "speedrun" else 4)  # per block: q, k, v, out, fc, proj; GPT-2: qkv, out, fc, proj
    assert large["optimizer ops"] - small["optimizer ops"] <= 6 * matrices_added, (small, large)
    if recipe == "gpt2":
        assert large["optimizer ops"] == small["optimizer ops"]


def test_the_cpus_foreach_adamw_is_decided_on_the_host(shards, tmp_path):
    """The CPU's default AdamW (foreach, build-nanogpt's numbers) cannot take found_inf: the host reads the verdict
    before the step, its one read there (a CPU does not wait for it)."""
    step = host_work_of(shards, tmp_path, 2)
    assert step["host reads before the optimizer"] == 1, step


def test_fsdp_compiles_the_blocks_and_the_head_for_training_only(tmp_path, monkeypatch):
    """Under --fsdp each Block's forward and the root's head and loss are compiled (static shapes) for training:
    one graph serves every Block (each Block's torch.compile call gets an equal backend, as inductor's are), so a
    model one Block deeper than Dynamo's recompile limit compiles no more, where a graph per Block would hit the
    limit; calls without gradients (the evaluations, samples) run them eagerly and compile nothing, so their shapes
    never reach the training graphs. FSDP2 over a one-process gloo group, the recording backend of the graphs' test."""
    import torch.distributed as dist

    from nanogpt.sharding import shard_model

    recorder = GraphRecorder(monkeypatch)
    n_layer = torch._dynamo.config.recompile_limit + 1
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = shard_model(train_gpt2.GPT(train_gpt2.GPTConfig(block_size=16, n_layer=n_layer, n_head=2, n_embd=32)),
                            "fp32", "cpu", use_compile=True)
        x = torch.randint(0, 50257, (2, 16))
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # (else Dynamo would run the rest eagerly)
            for _ in range(2):
                model(x, x.roll(1, 1))[1].backward()
        trained = len(recorder.graphs)
        with torch.no_grad():
            logits, _ = model(torch.randint(0, 50257, (3, 7)))  # an evaluation's other shape
    finally:
        dist.destroy_process_group()
    # one graph for the Blocks' forward and one for the head's, both static; nothing more without gradients
    assert sorted(g["kind"] for g in recorder.graphs) == ["Block.forward", "GPT.head"], recorder.graphs
    assert not any(g["dynamic"] for g in recorder.graphs)
    assert len(recorder.graphs) == trained and logits.shape == (3, 7, model.config.vocab_size)
