"""The micro-batch that fits (nanogpt/fitting.py): --batch_size auto picks the largest that fits without changing
the run, a training step that runs out of memory runs again at half the micro-batch, and a micro-batch of 1 that
does not fit stops with one line and the last step saved. The out-of-memory is injected into the model's forward
(more rows than a limit raise torch.OutOfMemoryError, as a full GPU does); the references are the same runs with
the micro-batch given by hand, which gradient accumulation makes the same run (fp32 on a CPU: bit for bit)."""

import os
import shutil

import pytest
import torch

import train_gpt2
from conftest import (TINY_FLAGS, assert_cli_error, load_weights, make_shards, read_log, run_script, script_cli,
                      torchrun)
from nanogpt.fitting import candidate_batch_sizes, smaller_batch_size, trial_step
from oom_worker import failing_above

# 6 steps of 256 tokens: 8 rows of 32 a step, --model tiny's cap of 8 rows a micro-batch
RUN = ["--max_steps", "6", "--eval_every", "0", "--save_every", "2", "--total_batch_size", "256"]  # saves after 1, 3, 5


def tiny_run(data, log_dir, batch_size="auto"):
    """TINY_FLAGS' run with this --batch_size (None: none given)."""
    at = TINY_FLAGS.index("--batch_size")
    flags = TINY_FLAGS[:at] + TINY_FLAGS[at + 2:] + (["--batch_size", str(batch_size)] if batch_size else [])
    return [*flags, "--data_dir", data, "--log_dir", str(log_dir), *RUN]


def logs_and_weights_equal(a, b, step=5):
    assert open(os.path.join(a, "log.txt")).read() == open(os.path.join(b, "log.txt")).read()
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
    optimizer = model.configure_optimizers(0.1, 1e-3, "cpu", kind, 0.02, process_group=object())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    held, forward = [], model.forward

    def watched(idx, targets=None):
        grads = all(p.grad is not None for p in model.parameters())
        held.append((len(optimizer.state) > 0, grads))
        return forward(idx, targets)

    model.forward = watched
    trial_step(model, optimizer, train_gpt2.batch_loss, batch_size=2, seq_len=8, device="cpu", autocast=torch.autocast("cpu", enabled=False))
    assert held[0] == (False, False) and held[-1] == (True, True)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


def test_auto_picks_the_largest_that_fits_and_trains_the_same_run(tmp_path, monkeypatch, capsys):
    data = make_shards(str(tmp_path / "data"))
    monkeypatch.setattr(train_gpt2.GPT, "forward", failing_above(2))
    train_gpt2.main(tiny_run(data, tmp_path / "auto"))
    out = capsys.readouterr().out
    assert "--batch_size auto: 8, 4 did not fit; micro-batch 2" in out
    assert "total batch 256 tokens = 2 x 32 x 1 ranks x 4 accumulation steps" in out
    assert torch.load(os.path.join(tmp_path / "auto", "model_00005.pt"), weights_only=True)["args"]["batch_size"] == 2
    train_gpt2.main([*tiny_run(data, tmp_path / "by_hand", 2)])
    logs_and_weights_equal(str(tmp_path / "auto"), str(tmp_path / "by_hand"))


@pytest.mark.slow
def test_auto_when_everything_fits_takes_the_cap(tmp_path, capsys):
    data = make_shards(str(tmp_path / "data"))
    train_gpt2.main(tiny_run(data, tmp_path / "auto"))
    assert "total batch 256 tokens = 8 x 32 x 1 ranks x 1 accumulation steps" in capsys.readouterr().out
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
