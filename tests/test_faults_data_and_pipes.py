"""Shards that change under a running trainer, a pipe as HellaSwag data under torchrun, HellaSwag endings that
clean to nothing: each ends in one line, with the progress saved where there was progress to save.

    python -m pytest -q tests/test_faults_data_and_pipes.py
"""

import json
import os
import re
import subprocess
import sys
import threading

import pytest

import hellaswag
from conftest import (ROOT, TINY_FLAGS, assert_cli_error, make_shards, read_log, run_script, script_cli, train,
                      write_hellaswag)
from nanogpt.checkpoints import find_checkpoints, load_checkpoint

pytestmark = pytest.mark.slow  # subprocess runs and torchrun: the full suite's


def run_until(cmd, line_start, then):
    """Run train_gpt2.py; when a stdout line starts with line_start, call then() and let the run go on.
    (exit code, stdout, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if then is not None and line.startswith(line_start):
            then()
            then = None
    return proc.wait(timeout=300), "".join(out), proc.stderr.read()


def assert_saved_the_last_step(log_dir, stdout):
    saved = find_checkpoints(log_dir)
    assert len(saved) == 1 and "saved" in stdout, stdout[-2000:]
    step = load_checkpoint(saved[0])["step"]
    assert sorted(read_log(log_dir)["train"]) == list(range(step + 1))
    assert not os.path.exists(os.path.join(log_dir, "run.lock"))
    return step


def test_a_validation_shard_gone_mid_run_saves_the_progress_first(tmp_path):
    """It stopped with one line but without the save a training shard's failure gets, losing the steps since the
    last checkpoint; and it said to remove the file from the folder."""
    data = make_shards(str(tmp_path / "data"))
    val = os.path.join(data, "test_val_000000.bin")
    log_dir = str(tmp_path / "log")
    cmd = ["train_gpt2.py", *TINY_FLAGS, "--data_dir", data, "--log_dir", log_dir, "--max_steps", "50",
           "--eval_every", "4", "--save_every", "0"]
    code, out, err = run_until(cmd, "step     5/", lambda: os.rename(val, val + ".away"))
    assert code == 2 and err.count("\n") == 1 and "the shard is gone" in err and "Traceback" not in err, err
    assert "stopping at step 8: saved" in out
    assert assert_saved_the_last_step(log_dir, out) == 7
    os.rename(val + ".away", val)  # put back, the run goes on from there
    code, _, err = run_until(["train_gpt2.py", "--log_dir", log_dir, "--resume", "--max_steps", "10"], "", None)
    assert code == 0, err
    assert sorted(read_log(log_dir)["train"]) == list(range(10))


@pytest.mark.parametrize("order", [[], ["--no_shuffle"]])
def test_a_training_shard_truncated_in_place_mid_run_is_one_line_not_sigbus(tmp_path, order):
    """The memory-mapped loader read past the file's new end: SIGBUS, exit 135, no message, nothing saved, the
    lock file left behind."""
    data = make_shards(str(tmp_path / "data"), train_tokens=(20000,))
    shard = os.path.join(data, "test_train_000001.bin")
    log_dir = str(tmp_path / "log")
    cmd = ["train_gpt2.py", *TINY_FLAGS, *order, "--data_dir", data, "--log_dir", log_dir, "--max_steps", "60",
           "--eval_every", "0", "--save_every", "0"]

    def truncate():
        with open(shard, "r+b") as f:
            f.truncate(4096)

    code, out, err = run_until(cmd, "step     3/", truncate)
    assert code == 2 and err.count("\n") == 1 and "shrank while the run read it" in err, (code, err)
    assert assert_saved_the_last_step(log_dir, out) >= 3


def test_a_pipe_as_hellaswag_data_under_torchrun_is_read_once(tmp_path, shards):
    """Every rank opened the pipe: the second waited forever for a writer. Rank 0 reads it and shares it; the
    counts are those of the same file read in one process."""
    train(shards, str(tmp_path / "log"), "--max_steps", "1", "--eval_every", "0")
    data = write_hellaswag(str(tmp_path / "hs.jsonl"), n=8)
    pipe = tmp_path / "hs.fifo"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_bytes(open(data, "rb").read()))  # blocks until one reader
    writer.start()
    both = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "hellaswag.py",
                       "--checkpoint", str(tmp_path / "log"), "--data", str(pipe), "--device", "cpu"])
    writer.join(timeout=60)
    assert both.returncode == 0, both.stderr[-3000:]
    one = run_script(["hellaswag.py", "--checkpoint", str(tmp_path / "log"), "--data", data, "--device", "cpu"])
    assert one.returncode == 0, one.stderr
    counts = [re.findall(r"\((\d+)/8\)", line) for line in both.stdout.splitlines() + one.stdout.splitlines()
              if "acc_norm" in line]
    assert len(counts) == 2 and counts[0] == counts[1] and len(counts[0]) == 2, counts


def test_a_harness_ending_that_cleans_to_nothing_is_one_line(tmp_path, capsys, shards):
    """It scored as a loss of 0, so it always won, and acc_norm divided by its 0 characters (NaN)."""
    train(shards, str(tmp_path / "log"), "--max_steps", "1", "--eval_every", "0")
    example = {"ind": 1, "activity_label": "Cooking", "ctx_a": "A man stands.", "ctx_b": "he",
               "ctx": "A man stands. he", "endings": ["walks away.", "[header]", "sits down.", "jumps."], "label": 0}
    path = tmp_path / "hs.jsonl"
    path.write_text(json.dumps(example) + "\n")
    result = script_cli(capsys, hellaswag.main, "--checkpoint", tmp_path / "log", "--data", path, "--device", "cpu",
                        "--style", "harness")
    assert_cli_error(result, "ending 2 is empty after lm-evaluation-harness's cleanup")
    code, out, err = script_cli(capsys, hellaswag.main, "--checkpoint", tmp_path / "log", "--data", path, "--device",
                                "cpu")
    assert code == 0 and "acc_norm" in out, err  # build-nanogpt's rendering scores it as written
