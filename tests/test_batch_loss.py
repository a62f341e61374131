"""One place for a micro-batch's loss (train_gpt2.batch_loss): the loop, the --batch_size auto trial and validation
all take it from there, and a number it adds to its dict reaches the step line and the trackers without an edit
of the loop."""

import inspect

import train_gpt2
from conftest import RUN_KINDS, TINY_FLAGS, make_shards, read_log
from nanogpt.runlog import RunLog


def test_a_number_the_objective_adds_is_logged_and_every_caller_uses_it(tmp_path, monkeypatch, capsys):
    data = make_shards(str(tmp_path / "data"))
    loss_of, callers, tracked = train_gpt2.batch_loss, [], []

    def with_a_number(model, x, y):  # a researcher's new term, logged beside the loss
        callers.append(inspect.stack()[1].function)
        loss, numbers = loss_of(model, x, y)
        return loss, {**numbers, "twice": 2 * loss}

    record = RunLog.record
    monkeypatch.setattr(train_gpt2, "batch_loss", with_a_number)
    monkeypatch.setattr(RunLog, "record", lambda log, step, line, scalars: (tracked.append(scalars),
                                                                              record(log, step, line, scalars))[1])
    at = TINY_FLAGS.index("--batch_size")  # auto: the trial runs on a CPU too
    train_gpt2.main([*TINY_FLAGS[:at], *TINY_FLAGS[at + 2:], "--batch_size", "auto", "--data_dir", data,
                     "--log_dir", str(tmp_path / "log"), "--max_steps", "3", "--eval_every", "2"])
    assert {"forward_backward", "train", "validation_loss"} <= set(callers)  # the trial's, the loop's, validation's
    steps = [s for s in tracked if "train/loss" in s]
    assert len(steps) == 3 and all(s["train/twice"] == 2 * s["train/loss"] for s in steps)  # averaged as the loss is
    assert "| twice " in capsys.readouterr().out
    # log.txt: build-nanogpt's lines, and those that describe the run
    assert sorted(set(read_log(str(tmp_path / "log"))) - set(RUN_KINDS)) == ["train", "val"]
