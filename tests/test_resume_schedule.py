"""What a resume that changes the learning-rate schedule's flags does (--schedule_change), step by step,
against the warmup-and-cosine schedule written out again here.

    python -m pytest -q tests/test_resume_schedule.py
"""

import math
import os
import re
import shutil
from pathlib import Path

import pytest

import train_gpt2
from conftest import TINY_FLAGS, assert_cli_error, assert_refused_before_any_work, read_log, script_cli

MAX_LR, MIN_LR, WARMUP = 3e-3, 3e-4, 2  # TINY_FLAGS' --max_lr and --warmup_steps; --min_lr_frac 0.1
LR_RE = re.compile(r"step\s+(\d+)/\d+ \| loss \S+ \| lr (\S+) \|")


def cosine(step, top, start, end):
    """From `top` at step `start` down to MIN_LR at step `end` along half a cosine."""
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * (step - start) / (end - start))) * (top - MIN_LR)


def schedule(step, max_steps, start=0):
    """Warmup from `start` to MAX_LR over WARMUP steps, then the cosine to MIN_LR at max_steps."""
    if step - start < WARMUP:
        return MAX_LR * (step - start + 1) / WARMUP
    return cosine(step, MAX_LR, start + WARMUP, max_steps) if step < max_steps else MIN_LR


def tmp_path_of(log_dir):
    return Path(log_dir).parent


def printed_rates(out):
    return {int(m.group(1)): float(m.group(2)) for m in LR_RE.finditer(out)}


def assert_rates(got, want):
    assert sorted(got) == sorted(want)
    for step in want:  # printed with 4 decimals of the mantissa: half a unit of the last is < 5e-5 of the value
        assert abs(got[step] - want[step]) <= 5e-5 * want[step], (step, got[step], want[step])


@pytest.fixture
def interrupted(shards, tmp_path, capsys, one_thread):
    """A 10-step run that died after step 4's checkpoint: its flags and log folder."""
    log_dir = str(tmp_path / "log")
    flags = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--eval_every", "0"]
    code, out, err = script_cli(capsys, train_gpt2.main, *flags, "--max_steps", "10", "--save_every", "5")
    assert code == 0, err
    assert_rates(printed_rates(out), {s: schedule(s, 10) for s in range(10)})
    os.remove(os.path.join(log_dir, "model_00009.pt"))
    return flags, log_dir


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["recompute", "stretch", "restart"])
def test_a_longer_run_on_resume_follows_the_schedule_chosen(interrupted, capsys, choice):
    flags, log_dir = interrupted
    code, out, err = script_cli(capsys, train_gpt2.main, *flags, "--resume", "--max_steps", "20", "--save_every", "4",
                                "--schedule_change", choice)
    assert code == 0, err
    before = schedule(5, 10)  # where the interrupted run's schedule was at the resume step
    want = {"recompute": {s: schedule(s, 20) for s in range(5, 20)},
            "stretch": {s: cosine(s, before, 5, 20) for s in range(5, 20)},
            "restart": {s: schedule(s, 20, start=5) for s in range(5, 20)}}[choice]
    assert_rates(printed_rates(out), want)
    said = next(line for line in out.splitlines() if "learning-rate schedule changes" in line)
    assert f"at step 5 the rate is {want[5]:.4e} ({before:.4e} under the checkpoint's settings)" in said
    assert sorted(read_log(log_dir)["train"]) == list(range(20))

    # a later resume that changes the settings again recomputes from where the schedule was moved
    if choice != "recompute":
        changed = str(tmp_path_of(log_dir) / "again")
        shutil.copytree(log_dir, changed)
        for name in ("model_00015.pt", "model_00019.pt"):
            os.remove(os.path.join(changed, name))
        code, out, err = script_cli(capsys, train_gpt2.main, *flags, "--log_dir", changed, "--resume", "--max_steps",
                                    "30", "--schedule_change", "recompute")
        assert code == 0, err
        again = {"stretch": {s: cosine(s, before, 5, 30) for s in range(12, 30)},
                 "restart": {s: schedule(s, 30, start=5) for s in range(12, 30)}}[choice]
        assert_rates(printed_rates(out), again)
        assert "the schedule of the new settings from step 5" in out

    # a later bare resume keeps the run's schedule, moved or not
    for name in ("model_00015.pt", "model_00019.pt"):
        os.remove(os.path.join(log_dir, name))
    code, out, err = script_cli(capsys, train_gpt2.main, *flags, "--resume")
    assert code == 0, err
    assert_rates(printed_rates(out), {s: want[s] for s in range(12, 20)})
    assert "schedule changes" not in out


def test_a_resume_that_changes_nothing_of_the_schedule_says_nothing(interrupted, capsys):
    flags, _ = interrupted
    code, out, err = script_cli(capsys, train_gpt2.main, *flags, "--resume", "--schedule_change", "stretch")
    assert code == 0, err
    assert "schedule changes" not in out
    assert_rates(printed_rates(out), {s: schedule(s, 10) for s in range(5, 10)})


def test_schedule_change_without_resume_is_refused(shards, tmp_path, capsys):
    result = script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--data_dir", shards, "--log_dir", tmp_path / "log",
                        "--max_steps", "2", "--schedule_change", "stretch")
    assert_cli_error(result, "--schedule_change stretch does nothing without --resume")
    assert not (tmp_path / "log").exists()


# -----------------------------------------------------------------------------
# --lr_schedule wsd: warm-up, stable, decay (a straight line over the last --warmdown_frac of the steps)


def wsd(step, max_steps, frac, start=0, top=None):
    """From `start`: a warmup to MAX_LR (or, given `top`, that rate held from the start, without a warmup), held
    until the later of the warmup's end and the last frac of max_steps, then a straight line to MIN_LR there."""
    warmup = WARMUP if top is None else 0
    if step - start < warmup:
        return MAX_LR * (step - start + 1) / WARMUP
    top = MAX_LR if top is None else top
    line_from = max(start + warmup, max_steps - round(frac * max_steps))
    if step >= max_steps:
        return MIN_LR
    return top if step < line_from else top - (top - MIN_LR) * (step - line_from) / (max_steps - line_from)


def test_wsd_holds_the_rate_then_goes_down_in_a_straight_line(shards, tmp_path, capsys, one_thread):
    code, out, err = script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--data_dir", shards, "--log_dir", tmp_path / "log",
                                "--eval_every", "0", "--max_steps", "10", "--lr_schedule", "wsd", "--warmdown_frac", "0.4")
    assert code == 0, err
    want = {s: wsd(s, 10, 0.4) for s in range(10)}
    assert [want[s] for s in (1, 5, 6, 9)] == [MAX_LR, MAX_LR, MAX_LR, MAX_LR - (MAX_LR - MIN_LR) * 3 / 4]
    assert_rates(printed_rates(out), want)


@pytest.mark.parametrize("choice", ["recompute", "stretch", "restart"])
def test_a_cosine_run_resumed_as_wsd_follows_the_schedule_chosen(interrupted, capsys, choice):
    flags, log_dir = interrupted
    code, out, err = script_cli(capsys, train_gpt2.main, *flags, "--resume", "--max_steps", "20", "--lr_schedule", "wsd",
                                "--warmdown_frac", "0.5", "--schedule_change", choice)
    assert code == 0, err
    before = schedule(5, 10)
    want = {"recompute": {s: wsd(s, 20, 0.5) for s in range(5, 20)},
            "stretch": {s: wsd(s, 20, 0.5, start=5, top=before) for s in range(5, 20)},
            "restart": {s: wsd(s, 20, 0.5, start=5) for s in range(5, 20)}}[choice]
    assert_rates(printed_rates(out), want)
    said = next(line for line in out.splitlines() if "learning-rate schedule changes" in line)
    assert f"at step 5 the rate is {want[5]:.4e} ({before:.4e} under the checkpoint's settings)" in said


@pytest.mark.parametrize("extra,named", [
    (["--warmdown_frac", "0.3"], "--warmdown_frac does nothing with --lr_schedule cosine"),
    (["--lr_schedule", "wsd", "--warmdown_frac", "1.5"], "--warmdown_frac 1.5: must be from 0 to 1"),
    (["--lr_schedule", "wsd", "--warmdown_frac", "-0.1"], "--warmdown_frac -0.1: must be a finite number >= 0"),
    # 0.1 of 2 steps rounds to 0 steps of warm-down: the rate would stay at --max_lr to the end
    (["--lr_schedule", "wsd", "--warmdown_frac", "0.1"], "is 0 step(s) of warm-down: too few"),
])
def test_bad_wsd_flags_are_one_line(shards, tmp_path, capsys, extra, named):
    assert_refused_before_any_work(capsys, shards, tmp_path, extra, named, max_steps=2)
