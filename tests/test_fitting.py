"""The micro-batch that fits (nanogpt/fitting.py): --batch_size auto picks the largest that fits without changing
the run, a training step that runs out of memory runs again at half the micro-batch, and a micro-batch of 1 that
does not fit stops with one line and the last step saved. The out-of-memory is injected into the model's forward
(more rows than a limit raise torch.OutOfMemoryError, as a full GPU does); the references are the same runs with
the micro-batch given by hand, which gradient accumulation makes the same run (fp32 on a CPU: bit for bit)."""

import os
import re
import shutil

import pytest
import torch

import train_gpt2
from conftest import (TINY_FLAGS, assert_cli_error, count_validation_tokens, load_weights, make_shards, numbers_logged,
                      read_log, run_script, script_cli, torchrun)
from nanogpt.fitting import candidate_batch_sizes, smaller_batch_size, trial_step
from nanogpt.optimizers import OptimizerSettings
from oom_worker import failing_above

# 6 steps of 256 tokens: 8 rows of 32 a step, --model tiny's cap of 8 rows a micro-batch
RUN = ["--max_steps", "6", "--eval_every", "0", "--save_every", "2", "--total_batch_size", "256"]  # saves after 1, 3, 5


def tiny_run(data, log_dir, batch_size="auto"):
    """TINY_FLAGS' run with this --batch_size (None: none given)."""
    at = TINY_FLAGS.index("--batch_size")
    flags = TINY_FLAGS[:at] + TINY_FLAGS[at + 2:] + (["--batch_size", str(batch_size)] if batch_size else [])
    return [*flags, "--data_dir", data, "--log_dir", str(log_dir), *RUN]


def logs_and_weights_equal(a, b, step=5):
    assert numbers_logged(a) == numbers_logged(b)
    wa, wb = (load_weights(os.path.join(d, f"model_{step:05d}.pt")) for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_candidates_and_halving():
    assert candidate_batch_sizes(256, 32, 1, 8) == [8, 4, 2, 1]
    assert candidate_batch_sizes(24 * 32, 32, 2, 64) == [12, 6, 4, 3, 2, 1]  # 12 rows a process
    assert candidate_batch_sizes(96 * 32, 32, 1, 64) == [48, 24, 16, 12, 8, 6, 4, 3, 2, 1]  # 32 would not split 48
    assert candidate_batch_sizes(100, 32, 1, 8) == []  # not whole rows: check_batch_split names it
    assert [smaller_batch_size(b) for b in (8, 6, 3, 5, 2, 1)] == [4, 3, 1, 1, 1, None]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_the_trial_holds_what_a_real_step_holds_and_changes_nothing(kind):
    """A real micro-step after the first runs with AdamW's moments and the gradients alive: so does the trial's
    last forward; afterwards weights, gradients and optimizer state are as before. Muon's step in the trial runs
    no collective (a rank that ran out of memory never reaches it): here its process group is a stand-in that
    torch.distributed would refuse."""
    torch.manual_seed(0)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    settings = OptimizerSettings(kind, 1e-3, 0.1, flags={"muon_lr": 0.02})
    optimizer = model.configure_optimizers(settings, "cpu", process_group=object())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    held, forward = [], model.forward

    def watched(idx, targets=None):
        grads = all(p.grad is not None for p in model.parameters())
        held.append((len(optimizer.state) > 0, grads))
        return forward(idx, targets)

    model.forward = watched
    trial_step(model, optimizer, train_gpt2.batch_loss, batch_size=2, seq_len=8, device="cpu",
               autocast=torch.autocast("cpu", enabled=False))
    assert held[0] == (False, False) and held[-1] == (True, True)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


class CountingSGD(torch.optim.SGD):
    """An optimizer that keeps a counter and a running sum in its groups and a state of its own per parameter, as
    schedule-free AdamW and Adafactor-like optimizers do; its step changes them even at a rate of 0."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
            group["weight_sum"] = group.get("weight_sum", 0.0) + 0.5
            for p in group["params"]:
                self.state[p]["seen"] = self.state[p].get("seen", torch.zeros(())) + 1
        return super().step(closure)


def test_the_trial_puts_back_every_group_setting_and_all_optimizer_state():
    """What the trial's optimizer step makes or changes, in the groups and in the state, is put back as it was:
    a counter, a running sum, a state made by the step, and a state there before (a resumed optimizer's)."""
    torch.manual_seed(0)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    optimizer = CountingSGD([{"params": [p for p in model.parameters() if p.dim() == 2], "k": 7},
                             {"params": [p for p in model.parameters() if p.dim() < 2]}], lr=0.1, momentum=0.9)
    kept = model.lm_head.weight
    optimizer.state[kept]["seen"] = torch.tensor(3.0)
    before = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    trial_step(model, optimizer, train_gpt2.batch_loss, batch_size=2, seq_len=8, device="cpu",
               autocast=torch.autocast("cpu", enabled=False))
    assert [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups] == before
    assert list(optimizer.state) == [kept] and dict(optimizer.state[kept]) == {"seen": torch.tensor(3.0)}


def test_auto_picks_the_largest_that_fits_and_trains_the_same_run(tmp_path, monkeypatch, capsys):
    data = make_shards(str(tmp_path / "data"))
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_above(2))
    train_gpt2.main(tiny_run(data, tmp_path / "auto"))
    out = capsys.readouterr().out
    # one line: what was tried, what fit, and the split, which the header (micro_batches_per_step's) confirms
    assert "--batch_size auto: 8, 4 did not fit; micro-batch 2: 2 x 32 tokens x 1 process x 4 accumulation steps = " \
           "256 tokens a step\n" in out
    assert "total batch 256 tokens = 2 x 32 x 1 ranks x 4 accumulation steps" in out
    assert torch.load(os.path.join(tmp_path / "auto", "model_00005.pt"), weights_only=True)["args"]["batch_size"] == 2
    train_gpt2.main([*tiny_run(data, tmp_path / "by_hand", 2)])
    logs_and_weights_equal(str(tmp_path / "auto"), str(tmp_path / "by_hand"))


@pytest.mark.slow
def test_auto_when_everything_fits_takes_the_cap(tmp_path, capsys):
    data = make_shards(str(tmp_path / "data"))
    train_gpt2.main(tiny_run(data, tmp_path / "auto"))
    out = capsys.readouterr().out
    assert "total batch 256 tokens = 8 x 32 x 1 ranks x 1 accumulation steps" in out
    # said when the first candidate fits too
    assert "--batch_size auto: tried 8 first, it fits; micro-batch 8: 8 x 32 tokens x 1 process x 1 accumulation " \
           "step = 256 tokens a step\n" in out
    train_gpt2.main([*tiny_run(data, tmp_path / "by_hand", 8)])
    logs_and_weights_equal(str(tmp_path / "auto"), str(tmp_path / "by_hand"))


def test_nothing_fits_is_one_line(tmp_path, monkeypatch, capsys):
    data = make_shards(str(tmp_path / "data"))
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_above(0))
    result = script_cli(capsys, train_gpt2.main, *tiny_run(data, tmp_path / "log"))
    assert_cli_error(result, "not even a micro-batch of 1 fits", "--seq_len", "--recompute", "--loss_impl chunked")
    assert not (tmp_path / "log").exists()


def failing_once_at(call, limit_after):
    """A forward that raises at its call-th call (counting from 1), then fails above limit_after rows."""
    forward, calls = train_gpt2.GPT.forward, []

    def flaky(self, idx, *args, **kwargs):
        calls.append(idx.size(0))
        if len(calls) == call or (len(calls) > call and idx.size(0) > limit_after):
            raise torch.OutOfMemoryError("injected")
        return forward(self, idx, *args, **kwargs)
    return flaky


@pytest.mark.slow
def test_a_step_out_of_memory_runs_again_at_half(tmp_path, monkeypatch, capsys):
    """Micro-batch 4 (2 micro-steps a step); the second micro-step of step 3 runs out of memory: step 3 runs again
    from its start at 2 (4 micro-steps), and the run goes on at 2. The reference: the same run at 4 up to its
    checkpoint after step 2, resumed with --batch_size 2. Then --resume after the retried run continues at 2."""
    data = make_shards(str(tmp_path / "data"))
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_once_at(2 * 3 + 2, limit_after=2))
    train_gpt2.main(tiny_run(data, tmp_path / "retried", 4))
    out = capsys.readouterr().out
    assert "step 3: out of memory at micro-batch 4; the step runs again from its start at 2" in out
    monkeypatch.undo()
    reference = tmp_path / "reference"
    train_gpt2.main([*tiny_run(data, reference, 4), "--max_steps", "3"])
    train_gpt2.main([*tiny_run(data, reference, 2), "--resume"])
    logs_and_weights_equal(str(tmp_path / "retried"), str(reference))
    # its checkpoint after step 3 holds micro-batch 2: resumed from it (a resume that tried 4 would run out of memory)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "retried", resumed, ignore=shutil.ignore_patterns("model_00005.pt"))
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_above(2))
    capsys.readouterr()
    train_gpt2.main([*tiny_run(data, resumed, None), "--resume"])
    out = capsys.readouterr().out
    assert "2 x 32 x 1 ranks x 4 accumulation steps" in out and "out of memory" not in out
    logs_and_weights_equal(str(tmp_path / "retried"), str(resumed))


def test_a_micro_batch_of_1_out_of_memory_stops_with_the_last_step_saved(tmp_path, monkeypatch, capsys):
    data = make_shards(str(tmp_path / "data"))
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_once_at(3 * 8 + 1, limit_after=0))  # step 3's first
    result = script_cli(capsys, train_gpt2.main, *tiny_run(data, tmp_path / "log", 1))
    assert_cli_error(result, "out of GPU memory at batch_size 1 x seq_len 32", "--seq_len", "--model", "--recompute",
                     "--loss_impl chunked")
    assert "stopping at step 3: saved" in result[1] and os.path.exists(tmp_path / "log" / "model_00002.pt")
    assert sorted(read_log(str(tmp_path / "log"))["train"]) == [0, 1, 2]


@pytest.mark.slow
def test_torchrun_processes_agree_on_the_smallest_fit(tmp_path):
    """Rank 0 fits 4 rows, rank 1 only 2: both train at 2, the run the same as micro-batch 2 given by hand."""
    data = make_shards(str(tmp_path / "data"))
    worker = os.path.join("tests", "oom_worker.py")
    flags = tiny_run(data, tmp_path / "auto")
    result = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", worker, *flags],
                        env={"OOM_ABOVE": "4,2"}, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--batch_size auto: 4 did not fit; micro-batch 2" in result.stdout
    assert "total batch 256 tokens = 2 x 32 x 2 ranks x 2 accumulation steps" in result.stdout
    by_hand = torchrun(2, *tiny_run(data, tmp_path / "by_hand", 2))
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    logs_and_weights_equal(str(tmp_path / "auto"), str(tmp_path / "by_hand"))


def test_fsdp_on_a_gpu_takes_the_largest_micro_batch_the_formula_fits_in_its_free_memory():
    """--fsdp takes no trial: on a GPU its micro-batch is the largest whose estimated peak (sharded weights and
    state) fits the free memory, by the rule of docs/speed.md's table of cards. d24 at 64 x 1024 needs ~99 GiB a
    rank (docs/speed.md "Memory"): an 80 GB card takes less, a larger free memory never a smaller one, and sharding
    across more ranks never a smaller one either."""
    from nanogpt import arguments
    from nanogpt.fitting import largest_batch_size

    GiB = 2**30
    args = train_gpt2.parse_args(["--model", "d24", "--fsdp", "--dtype", "bf16"])
    config = train_gpt2.model_config(args)
    with torch.device("meta"):
        params = arguments.counted_parameters(train_gpt2.make_gpt(config))

    def pick(free_gib, world_size=8):
        return largest_batch_size(args, 64, config, params, "bf16", "cuda", world_size, world_size,
                                  free_gpu_bytes=lambda: free_gib * GiB)[0]

    sizes = (24, 40, 80, 160)
    picks = [pick(gib) for gib in sizes]
    assert picks[2] < 64 and picks == sorted(picks) and picks[-1] == 64, picks
    for gib, b in zip(sizes, picks):  # the pick fits, and the next candidate up (twice it, here) would not
        fits = [arguments.fits_on_gpu(arguments.run_estimated_bytes(config, params, args, size, "bf16", "cuda",
                                                                    shards=8), gib * GiB) for size in (b, 2 * b)]
        assert fits[0] and (b == 64 or not fits[1]), (gib, b, fits)
    assert pick(40, world_size=2) <= pick(40, world_size=8)

@pytest.mark.slow
def test_processes_that_see_different_memory_agree_on_the_smallest_micro_batch(tmp_path):
    """torchrun, 2 gloo processes on a CPU: each picks the micro-batches to try from the memory it sees (one sees
    plenty, the other too little for any); they agree on the smaller pick and train it together, as --fsdp's
    formula pick must on GPUs whose free memory differs (ranks running different numbers of micro-steps hang)."""
    from nanogpt import arguments

    data = make_shards(str(tmp_path / "data"))
    flags = [*tiny_run(data, tmp_path / "log", "auto"), "--max_steps", "2"]
    args = train_gpt2.parse_args(flags)
    config = train_gpt2.model_config(args)
    with torch.device("meta"):
        params = arguments.counted_parameters(train_gpt2.make_gpt(config))
    # two processes of rank 1's machine: room for micro-batch 1 each, not 2 (the largest of a 2-process share is 4)
    little = 2 * arguments.cpu_process_bytes(arguments.run_estimated_bytes(config, params, args, 1, "fp32", "cpu"))
    assert 2 * arguments.cpu_process_bytes(arguments.run_estimated_bytes(config, params, args, 2, "fp32", "cpu")) > little
    result = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                         os.path.join(os.path.dirname(__file__), "torchrun_worker.py"), *flags],
                        env={"AVAILABLE_BYTES": f"{2**40},{little}"}, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    # by pattern, not by line: another rank's print writes its text and its newline apart, and may come between
    trained = sorted(re.findall(r"rank \d trains micro-batch \d+", result.stdout))
    assert trained == ["rank 0 trains micro-batch 1", "rank 1 trains micro-batch 1"], result.stdout


def test_the_batch_ramp_is_the_same_at_any_micro_batch(tmp_path, monkeypatch, capsys):
    """A --batch_size_warmup_tokens ramp is fixed in tokens when the run starts, in steps of the largest micro-batch
    it may take: --batch_size auto's pick (2 of the cap 8) and an out-of-memory retry at step 1 (8 -> 4) train the
    tokens of each step that the run given micro-batch 8 by hand trains, and the checkpoint keeps the ramp."""
    data = make_shards(str(tmp_path / "data"))
    ramp = ["--total_batch_size", "1024", "--batch_size_warmup_tokens", "1024", "--max_steps", "5", "--save_every", "0"]

    def batches(batch_size, log_dir):
        train_gpt2.main([*tiny_run(data, tmp_path / log_dir, batch_size), *ramp])
        out = capsys.readouterr().out
        return [int(line.split("| batch ")[1].split()[0]) for line in out.splitlines() if "| batch " in line], out

    want = [256, 256, 512, 1024, 1024]  # 256 + 768 x seen / 1024, in whole 256s (8 rows of 32); then the full 1024
    assert batches(8, "by_hand")[0] == want
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_above(2))
    steps, out = batches("auto", "auto")
    assert "micro-batch 2" in out and steps == want
    monkeypatch.undo()
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_once_at(2, limit_after=4))  # step 1's first micro-step
    steps, out = batches(8, "retried")
    assert "step 1: out of memory at micro-batch 8" in out and steps == want
    by_hand = read_log(str(tmp_path / "by_hand"))["train"]
    for run in ("auto", "retried"):
        got = read_log(str(tmp_path / run))["train"]
        assert all(abs(got[s] - by_hand[s]) < 1e-5 for s in by_hand), (run, got, by_hand)
    assert torch.load(tmp_path / "retried" / "model_00004.pt", weights_only=True)["ramp"] == {"start": 256, "unit": 256}


def test_validation_reads_the_same_tokens_after_a_retry_and_a_resume(tmp_path, monkeypatch, capsys):
    """Micro-batch 4, validated every 2 steps: step 3 runs out of memory and the run goes on at 2, validation too (its
    batches of 4 rows read in pieces of 2); resumed from the checkpoint after step 3 (micro-batch 2), the log is the
    uninterrupted one's, and its validation losses are those of the run that never ran out of memory."""
    data = make_shards(str(tmp_path / "data"))
    evals = ["--eval_every", "2"]  # steps 0, 2, 4, 5; 2 forwards each (--val_steps 2)
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_once_at(2 + 2 + 2 + 2 + 2 + 1, limit_after=2))  # step 3's
    train_gpt2.main([*tiny_run(data, tmp_path / "retried", 4), *evals])
    assert "step 3: out of memory at micro-batch 4" in capsys.readouterr().out
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "retried", resumed, ignore=shutil.ignore_patterns("model_00005.pt"))
    monkeypatch.undo()
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_above(2))
    train_gpt2.main([*tiny_run(data, resumed, None), *evals, "--resume"])
    assert numbers_logged(resumed) == numbers_logged(tmp_path / "retried")
    monkeypatch.undo()
    train_gpt2.main([*tiny_run(data, tmp_path / "reference", 4), *evals])
    val, want = (read_log(str(tmp_path / d))["val"] for d in ("resumed", "reference"))
    assert val.keys() == want.keys() == {0, 2, 4, 5} and all(abs(val[s] - want[s]) < 2e-4 for s in want), (val, want)


def failing_optimizer_step(call, after_update):
    """AdamW's step, raising torch.OutOfMemoryError at its call-th call: before it changes anything (AdamW making its
    state), or after_update (as one that ran out of memory half-way through its parameters would have changed some)."""
    step, calls = torch.optim.AdamW.step, []

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call and not after_update:
            raise torch.OutOfMemoryError("injected")
        result = step(self, *args, **kwargs)
        if len(calls) == call:
            raise torch.OutOfMemoryError("injected")
        return result
    return flaky


def test_out_of_memory_in_the_optimizer_step_saves_only_untouched_weights(tmp_path, monkeypatch, capsys):
    """Step 3's optimizer step runs out of memory: before any weight changed, the state after step 2 is saved (the
    checkpoint a run of 3 steps writes) and one line names what helps (--zero 1, --fsdp, a smaller --model); after
    the update began, nothing is saved and the line names the last good checkpoint (after step 1)."""
    data = make_shards(str(tmp_path / "data"))
    train_gpt2.main([*tiny_run(data, tmp_path / "reference", 4), "--max_steps", "3"])
    for after_update in (False, True):
        log_dir = tmp_path / f"after_update_{after_update}"
        monkeypatch.setattr(torch.optim.AdamW, "step", failing_optimizer_step(4, after_update))
        result = script_cli(capsys, train_gpt2.main, *tiny_run(data, log_dir, 4))
        monkeypatch.undo()
        assert_cli_error(result, "out of memory in the optimizer's step at step 3", "--zero 1", "--fsdp", "--model")
        assert sorted(read_log(str(log_dir))["train"]) == [0, 1, 2]
        if after_update:
            assert "last good checkpoint: " + os.path.join(str(log_dir), "model_00001.pt") in result[2]
            assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00001.pt"]
        else:
            assert "--resume continues from " + os.path.join(str(log_dir), "model_00002.pt") in result[2]
            saved, want = (torch.load(d / "model_00002.pt", weights_only=True)
                           for d in (log_dir, tmp_path / "reference"))
            assert all(torch.equal(saved["model"][k], want["model"][k]) for k in want["model"])
            assert saved["loader"] == want["loader"] and saved["tokens"] == want["tokens"]
            a, b = saved["optimizer"]["state"], want["optimizer"]["state"]  # (the groups' lr: each step sets its own)
            assert a.keys() == b.keys() and all(torch.equal(a[i][k], b[i][k]) for i in b for k in b[i])


def test_out_of_memory_in_muons_step_offers_no_sharding(tmp_path, monkeypatch, capsys):
    """Under --optimizer muon, which --zero 1 and --fsdp refuse, the line names a smaller --model only."""
    data = make_shards(str(tmp_path / "data"))
    monkeypatch.setattr(torch.optim.AdamW, "step", failing_optimizer_step(2, False))  # (Muon steps AdamW beside it)
    code, _, err = script_cli(capsys, train_gpt2.main, *tiny_run(data, tmp_path / "log", 4), "--optimizer", "muon")
    assert_cli_error((code, _, err), "out of memory in the optimizer's step at step 1", "cannot be sharded",
                     "pick a smaller --model")
    assert "--zero 1 or --fsdp (torchrun)" not in err


def failing_save(calls):
    """torch.save that writes a few bytes and raises torch.OutOfMemoryError at these calls (counting from 1), as one
    that ran out of memory copying the state to the host would; the others save."""
    save, made = torch.save, []

    def flaky(obj, f, *args, **kwargs):
        made.append(1)
        if len(made) in calls:
            f.write(b"partial")
            raise torch.OutOfMemoryError("injected")
        return save(obj, f, *args, **kwargs)
    return flaky


def test_out_of_memory_writing_a_checkpoint_tries_once_more(tmp_path, monkeypatch, capsys):
    """Checkpoints after steps 1, 3 and 5: the first write runs out of memory once and is tried again, the run the
    same as one that never did; where step 3's runs out of memory twice, one line, and step 1's checkpoint intact."""
    data = make_shards(str(tmp_path / "data"))
    train_gpt2.main(tiny_run(data, tmp_path / "reference", 4))
    monkeypatch.setattr(torch, "save", failing_save({1}))
    train_gpt2.main(tiny_run(data, tmp_path / "once", 4))
    logs_and_weights_equal(str(tmp_path / "once"), str(tmp_path / "reference"))
    monkeypatch.setattr(torch, "save", failing_save({2, 3}))
    result = script_cli(capsys, train_gpt2.main, *tiny_run(data, tmp_path / "twice", 4))
    assert_cli_error(result, "out of memory writing " + os.path.join(str(tmp_path / "twice"), "model_00003.pt"),
                     "earlier checkpoints are intact", "model_00001.pt")
    assert sorted(os.listdir(tmp_path / "twice")) == ["log.txt", "model_00001.pt"]
    kept, want = (load_weights(tmp_path / d / "model_00001.pt") for d in ("twice", "reference"))
    assert all(torch.equal(kept[k], want[k]) for k in want)


@pytest.mark.parametrize("evaluation,flags,fix", [
    ("HellaSwag", ["--hellaswag_every", "2", "--hellaswag_data", None], "pass --hellaswag_every 0"),
    ("samples", ["--sample_every", "2"], "pass --sample_every 0")])
def test_out_of_memory_in_an_evaluation_of_the_loop_names_its_flag(tmp_path, monkeypatch, capsys, evaluation, flags,
                                                                   fix):
    """HellaSwag's or the samples' forward runs out of memory at step 2: the line names the flag that turns that
    evaluation off (the run's --batch_size does not size it), and the state after step 1 is saved."""
    from conftest import write_hellaswag

    data = make_shards(str(tmp_path / "data"))
    flags = [str(write_hellaswag(tmp_path / "hs.jsonl")) if f is None else f for f in flags]
    forward, trained = train_gpt2.GPT.forward, []

    def training_only(self, *args, **kwargs):  # after steps 0 and 1 (two micro-steps each)
        if not self.training and len(trained) >= 4:
            raise torch.OutOfMemoryError("injected")
        trained.extend([1] if self.training else [])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(train_gpt2.GPT, "forward", training_only)
    monkeypatch.setattr(train_gpt2.GPT, "decode_step", failing_above(-1))  # sampling's step (every call fails)
    result = script_cli(capsys, train_gpt2.main, *tiny_run(data, tmp_path / "log", 4), *flags)
    scored = "HellaSwag" if evaluation == "HellaSwag" else "4 samples"
    assert_cli_error(result, f"scoring {scored} in the training loop", fix)
    assert "lower --batch_size" not in result[2] and os.path.exists(tmp_path / "log" / "model_00001.pt")


@pytest.mark.parametrize("fail_at,untouched", [(3, True), (None, False)])
def test_an_optimizer_step_that_fails_making_its_state_is_told_from_one_that_changed_weights(monkeypatch, fail_at,
                                                                                              untouched):
    """AdamW's first step makes its state group by group, updating each group once its state is made: out of memory
    in the first group's state changes no weight (and the state it made is dropped); in the second group's, the
    first group's weights have changed. weights_untouched says which, checked against the weights themselves."""
    from nanogpt.fitting import update_count_now, weights_untouched

    torch.manual_seed(0)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    optimizer = model.configure_optimizers(OptimizerSettings(max_lr=1e-3, weight_decay=0.1), "cpu")
    x = torch.randint(0, 64, (2, 8))
    model(x, x)[1].backward()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    first_group = len(optimizer.param_groups[0]["params"])
    fail_at = fail_at or 2 * first_group + 1  # exp_avg and exp_avg_sq of each: the first of the second group
    zeros_like, made = torch.zeros_like, []

    def failing(*args, **kwargs):
        made.append(1)
        if len(made) == fail_at:
            raise torch.OutOfMemoryError("injected")
        return zeros_like(*args, **kwargs)

    before = update_count_now(optimizer)
    monkeypatch.setattr(torch, "zeros_like", failing)
    with pytest.raises(torch.OutOfMemoryError):
        optimizer.step()
    monkeypatch.undo()
    changed = any(not torch.equal(p, weights[name]) for name, p in model.named_parameters())
    assert weights_untouched(optimizer, before) == untouched == (not changed)
    assert not optimizer.state if untouched else len(optimizer.state) >= first_group


def test_the_header_gives_the_validation_rows_auto_fixed_not_its_pick(tmp_path, monkeypatch, capsys):
    """Under --batch_size auto validation reads batches of the largest micro-batch (8 rows here), whatever the trial
    picks (2): the header's validation tokens are those the val loader hands out, counted as it does."""
    data = make_shards(str(tmp_path / "data"))
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_above(2))
    read = count_validation_tokens(monkeypatch)
    train_gpt2.main([*tiny_run(data, tmp_path / "auto"), "--eval_every", "1", "--max_steps", "1"])
    out = capsys.readouterr().out
    assert "micro-batch 2" in out
    assert f"\nvalidation {sum(read):,} tokens every 1 steps = 2 val_steps x 8 x 32 x 1 ranks\n" in out, (read, out)
