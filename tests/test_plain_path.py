"""The plain path (fixed data order, plain loss, fp32 on CPU) is frozen: a tiny run with validation
and a resume in the middle writes exactly the log.txt it wrote before the code was restructured.

The expected text below was produced by the code of commit cb442cf (whose training reproduces
build-nanogpt's train_gpt2.py loss for loss); any change to the plain path's numerics, data order,
schedule, resume or log format shows here as a diff.

    python -m pytest -q tests/test_plain_path.py
"""

import os

from conftest import TINY_FLAGS, make_shards, run_script

EXPECTED_LOG = """\
0 val 10.8432
0 train 10.844112
1 train 10.686963
2 train 10.477660
3 val 10.3210
3 train 10.322443
4 train 10.184232
5 train 10.060719
6 val 9.9497
6 train 9.951423
7 train 9.864673
8 train 9.807301
9 val 9.7697
9 train 9.771167
"""


def test_tiny_fp32_run_with_a_resume_logs_the_recorded_bytes(tmp_path):
    data = make_shards(str(tmp_path / "data"))
    log_dir = str(tmp_path / "log")
    cmd = ["train_gpt2.py", *TINY_FLAGS, "--data_dir", data, "--log_dir", log_dir, "--max_steps", "10",
           "--eval_every", "3", "--save_every", "4", "--total_batch_size", "512"]
    first = run_script(cmd)
    assert first.returncode == 0, first.stderr
    os.remove(os.path.join(log_dir, "model_00009.pt"))  # as if the run died after step 7's checkpoint
    resumed = run_script([*cmd, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout and "model_00007.pt" in resumed.stdout
    with open(os.path.join(log_dir, "log.txt")) as f:
        assert f.read() == EXPECTED_LOG
