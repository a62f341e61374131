"""One place for a micro-batch's loss (train_gpt2.batch_loss): the loop, the --batch_size auto trial and validation
all take it from there, and a number it adds to its dict reaches the step line, the trackers and log.txt (which
plot_log.py draws) without an edit of the loop, build-nanogpt's own lines unchanged.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_batch_loss.py
"""

import inspect
import os

import pytest

import plot_log
import train_gpt2
from conftest import RUN_KINDS, TINY_FLAGS, build_nanogpt_lines, make_shards, read_log
from nanogpt.runlog import RunLog


def test_a_number_the_objective_adds_is_logged_and_every_caller_uses_it(tmp_path, monkeypatch, capsys):
    data = make_shards(str(tmp_path / "data"))
    loss_of, callers, tracked = train_gpt2.batch_loss, [], []

    def with_a_number(model, x, y, args=None):  # a researcher's new term, logged beside the loss
        callers.append(inspect.stack()[1].function)
        loss, numbers = loss_of(model, x, y, args)
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
    # log.txt: build-nanogpt's lines, the number's, and those that describe the run
    assert sorted(set(read_log(str(tmp_path / "log"))) - set(RUN_KINDS)) == ["train", "twice", "val"]


def with_numbers(numbers):
    """batch_loss, logging numbers(loss) beside the loss."""
    loss_of = train_gpt2.batch_loss

    def objective(model, x, y, args=None):
        loss, logged = loss_of(model, x, y, args)
        return loss, {**logged, **numbers(loss)}
    return objective


def test_a_logged_number_is_a_line_of_log_txt_that_plot_log_draws(tmp_path, monkeypatch):
    """Each number batch_loss logs is `<step> <name> <value>` in log.txt, after the step's train line; the lines of
    the run without it (build-nanogpt's train and val) are the same, byte for byte; plot_log.py draws it."""
    data = make_shards(str(tmp_path / "data"))
    flags = [*TINY_FLAGS, "--data_dir", data, "--max_steps", "3", "--eval_every", "2"]
    train_gpt2.main([*flags, "--log_dir", str(tmp_path / "plain")])
    monkeypatch.setattr(train_gpt2, "batch_loss", with_numbers(lambda loss: {"half_loss": loss / 2, "aux": loss * 0}))
    train_gpt2.main([*flags, "--log_dir", str(tmp_path / "numbers")])
    plain = build_nanogpt_lines(str(tmp_path / "plain")).splitlines()
    lines = build_nanogpt_lines(str(tmp_path / "numbers")).splitlines()
    assert [line for line in lines if line.split()[1] not in ("half_loss", "aux")] == plain
    kinds = [line.split()[1] for line in lines]
    trains = [i for i, kind in enumerate(kinds) if kind == "train"]
    assert all(kinds[i + 1 : i + 3] == ["half_loss", "aux"] for i in trains)  # right after the step's own line
    log = read_log(str(tmp_path / "numbers"))
    assert log["half_loss"].keys() == log["train"].keys() == {0, 1, 2}
    for step, loss in log["train"].items():  # printed to 6 decimals and 6 significant digits: the rounding between
        assert abs(log["half_loss"][step] - loss / 2) <= 5e-7 / 2 + 5e-6 * loss / 2
        assert log["aux"][step] == 0
    figure = plot_log.build_figure(plot_log.parse_log(os.path.join(tmp_path, "numbers", "log.txt")))
    loss_panel = figure.axes[0]  # a kind ending in loss joins the losses; any other kind gets a panel of its own
    half = [line for line in loss_panel.get_lines() if line.get_label().startswith("half_loss")]
    assert len(half) == 1 and list(half[0].get_xdata()) == [0, 1, 2]
    assert [ax.get_title() for ax in figure.axes] == ["loss", "aux"]


@pytest.mark.parametrize("name", ["val", "two words", "z-loss", ""])
def test_a_number_log_txt_cannot_hold_is_refused_by_name(tmp_path, monkeypatch, name):
    data = make_shards(str(tmp_path / "data"))
    monkeypatch.setattr(train_gpt2, "batch_loss", with_numbers(lambda loss: {name: loss}))
    with pytest.raises(ValueError, match=f"a number named {name!r}"):
        train_gpt2.main([*TINY_FLAGS, "--data_dir", data, "--log_dir", str(tmp_path / "log"), "--max_steps", "1"])
