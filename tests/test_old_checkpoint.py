"""A checkpoint written by an earlier version of the program (tests/data/before_restructure, made on
another machine) still resumes, and the sibling scripts still load it.

    python -m pytest -q tests/test_old_checkpoint.py
"""

import os
import shutil

from conftest import ROOT, make_shards, read_log, script_cli

import generate_tokens
import train_gpt2

SAVED = os.path.join(ROOT, "tests", "data", "before_restructure")
# Step 2 starts from the checkpoint's weights, read exactly: its loss differs from the one recorded on the
# machine that made the file only by the rounding of one step's arithmetic on this one (~1e-7 of a loss of
# ~10.8 per operation; 1e-4 leaves room for the ~100 operations of a forward pass at this size).
LOSS_TOL = 1e-4


def test_a_checkpoint_from_before_resumes_and_loads(tmp_path, capsys, one_thread):
    data = make_shards(str(tmp_path / "data"))  # the same shards the file's run read (a fixed seed)
    log_dir = str(tmp_path / "log")
    shutil.copytree(SAVED, log_dir, ignore=shutil.ignore_patterns("README.md"))
    recorded = read_log(SAVED)
    with open(os.path.join(log_dir, "log.txt"), "w") as f:  # the log as the run left it after step 1
        f.writelines(line for line in open(os.path.join(SAVED, "log.txt")) if int(line.split()[0]) <= 1)
    code, out, err = script_cli(capsys, train_gpt2.main, "--data_dir", data, "--log_dir", log_dir, "--resume")
    assert code == 0, err
    assert "resuming from" in out and "model_00001.pt at step 2" in out
    got = read_log(log_dir)
    assert sorted(got["train"]) == [0, 1, 2] and sorted(got["val"]) == [0, 2]
    assert abs(got["train"][2] - recorded["train"][2]) <= LOSS_TOL, (got, recorded)
    assert abs(got["val"][2] - recorded["val"][2]) <= LOSS_TOL + 5e-5  # printed to 4 decimals

    code, out, err = script_cli(capsys, generate_tokens.main, "--checkpoint", os.path.join(SAVED, "model_00001.pt"),
                                "--device", "cpu", "--prompt", "Hello", "--num_samples", "1", "--max_new_tokens", "3")
    assert code == 0 and "--- sample 1/1 ---" in out, err


def test_a_checkpoint_from_before_the_wsd_schedule_was_a_cosines(tmp_path, capsys, one_thread):
    """Its arguments have no --lr_schedule: asking for wsd on resume is a change of the schedule, said as one."""
    data = make_shards(str(tmp_path / "data"))
    log_dir = str(tmp_path / "log")
    shutil.copytree(SAVED, log_dir, ignore=shutil.ignore_patterns("README.md"))
    code, out, err = script_cli(capsys, train_gpt2.main, "--data_dir", data, "--log_dir", log_dir, "--resume",
                                "--lr_schedule", "wsd", "--warmdown_frac", "0.7", "--eval_every", "0")
    assert code == 0, err
    assert "the learning-rate schedule changes: at step 2" in out
    assert "--resume: --lr_schedule changes from cosine to wsd" in out
