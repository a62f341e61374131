"""A resume that says a setting changes changes it. Each setting a --resume may change that the optimizer holds is
applied to the restored optimizer: the resumed run is compared, weights and optimizer state bit for bit, with the
straight run whose optimizer was given the new value at the resume step (its param groups set there, as a run that
had the new value from that step on). A checkpoint written before a flag existed says the change too.

    python -m pytest -q tests/test_resume_changes.py
"""

import functools
import math
import os
import shutil

import pytest
import torch

from conftest import ROOT, TINY_FLAGS, make_shards, script_cli

import train_gpt2
from nanogpt.optimizers import MUON_MOMENTUM, muon_momentum_warmup

RESUME_AT = 3  # --save_every 3 of a 6-step run: the checkpoints after steps 2 and 5; the resume takes steps 3-5


def adamw_groups(optimizer):
    return getattr(optimizer, "adamw", optimizer).param_groups


def set_weight_decay(value, optimizer):
    for group in adamw_groups(optimizer):
        if group["weight_decay"]:  # the decayed groups (the biases' and gains' stay at 0)
            group["weight_decay"] = value


def set_fused(optimizer):
    for group in adamw_groups(optimizer):
        group["fused"], group["foreach"] = True, None  # as torch.optim.AdamW(..., fused=True) makes them


def set_momentum_warmup(steps, optimizer):
    optimizer.before_step = functools.partial(muon_momentum_warmup, steps) if steps else None
    if not steps:
        optimizer.matrices.param_groups[0]["momentum"] = MUON_MOMENTUM[1]


def set_muon_lr(rate, max_lr, optimizer):
    group = optimizer.matrices.param_groups[0]  # (the step's rate is set already: it changes with the scale)
    group["lr"] *= rate / max_lr / group["lr_scale"]
    group["lr_scale"] = rate / max_lr


MUON = ["--optimizer", "muon", "--muon_lr", "0.02"]
CASES = {  # id: (the run's flags, the flags the resume changes, what they change in the optimizer at the resume step)
    "weight_decay": ([], ["--weight_decay", "0.5"], functools.partial(set_weight_decay, 0.5)),
    "weight_decay_muon": (MUON, ["--weight_decay", "0.5"], functools.partial(set_weight_decay, 0.5)),
    "fused_adamw": ([], ["--fused_adamw"], set_fused),
    "muon_momentum_warmup_off": ([*MUON, "--muon_momentum_warmup", "5"], ["--muon_momentum_warmup", "0"],
                                 functools.partial(set_momentum_warmup, 0)),
    "muon_momentum_warmup_on": (MUON, ["--muon_momentum_warmup", "5"], functools.partial(set_momentum_warmup, 5)),
    "muon_lr": (MUON, ["--muon_lr", "0.05"], functools.partial(set_muon_lr, 0.05, 3e-3)),
}


def the_state(path):
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return ckpt["model"], ckpt["optimizer"]


def assert_same(a, b, where=""):
    """Two state dicts alike: the same keys, tensors equal bit for bit, other values equal."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), getattr(b, "keys", lambda: b)())
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_setting_changed_on_resume_is_the_optimizers_from_the_resume_step(case, tmp_path, monkeypatch, one_thread):
    flags, changed, change = CASES[case]
    data = make_shards(str(tmp_path / "data"))
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    step_if_finite, steps = train_gpt2.step_if_finite, []

    def changing_at_resume(optimizer, *rest):  # the straight run, given the new value from step RESUME_AT on
        if len(steps) == RESUME_AT:
            change(optimizer)
        steps.append(len(steps))
        return step_if_finite(optimizer, *rest)

    monkeypatch.setattr(train_gpt2, "step_if_finite", changing_at_resume)
    train_gpt2.main([*TINY_FLAGS, *flags, "--data_dir", data, "--log_dir", straight, "--max_steps", "6",
                     "--save_every", "3", "--eval_every", "0"])
    monkeypatch.setattr(train_gpt2, "step_if_finite", step_if_finite)
    assert steps == list(range(6))
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("model_00005.pt"))
    train_gpt2.main(["--log_dir", resumed, "--resume", *changed])
    assert_same(the_state(os.path.join(straight, "model_00005.pt")), the_state(os.path.join(resumed, "model_00005.pt")))


def test_a_checkpoint_from_before_the_flag_says_the_change_and_makes_it(tmp_path, capsys, one_thread):
    """tests/data/before_restructure's arguments have no --fused_adamw: its run had the default (fused on CUDA, the
    foreach AdamW on a CPU); asking for it on resume is a change, said and made."""
    data = make_shards(str(tmp_path / "data"))
    log_dir = str(tmp_path / "log")
    shutil.copytree(os.path.join(ROOT, "tests", "data", "before_restructure"), log_dir,
                    ignore=shutil.ignore_patterns("README.md"))
    code, out, err = script_cli(capsys, train_gpt2.main, "--data_dir", data, "--log_dir", log_dir, "--resume",
                                "--fused_adamw", "--eval_every", "0")
    assert code == 0, err
    assert "--resume: --fused_adamw changes from unset (the default) to True" in out
    _, optimizer = the_state(os.path.join(log_dir, "model_00002.pt"))
    assert all(group["fused"] for group in optimizer["param_groups"])


@pytest.mark.slow
def test_a_batch_warmup_start_changed_on_resume_is_the_ramps_from_the_resume_step(tmp_path, monkeypatch, one_thread):
    """--batch_size_start on resume: the ramp goes on from the new start (at the checkpoint's rounding unit), as in
    the straight run whose ramp was given that start at the resume step."""
    data = make_shards(str(tmp_path / "data"))
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    batches, steps = train_gpt2.micro_batches_per_step, []  # (the loop's name of nanogpt.fitting's)

    def changing_at_resume(*numbers, start=None, unit=None):
        if numbers[0] == math.inf:  # (the header's: the full batch's)
            return batches(*numbers)
        steps.append(len(steps))
        return batches(*numbers, start=384 if len(steps) > RESUME_AT else start, unit=unit)

    monkeypatch.setattr(train_gpt2, "micro_batches_per_step", changing_at_resume)
    train_gpt2.main([*TINY_FLAGS, "--data_dir", data, "--log_dir", straight, "--max_steps", "6", "--save_every", "3",
                     "--eval_every", "0", "--total_batch_size", "512", "--batch_size_warmup_tokens", "4000",
                     "--batch_size_start", "128"])
    monkeypatch.setattr(train_gpt2, "micro_batches_per_step", batches)
    assert steps == list(range(6))
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("model_00005.pt"))
    train_gpt2.main(["--log_dir", resumed, "--resume", "--batch_size_start", "384"])
    assert_same(the_state(os.path.join(straight, "model_00005.pt")), the_state(os.path.join(resumed, "model_00005.pt")))
    assert (torch.load(os.path.join(resumed, "model_00005.pt"), weights_only=True)["tokens"]
            == torch.load(os.path.join(straight, "model_00005.pt"), weights_only=True)["tokens"])
