"""A stdout that cannot be written (a full disk; /dev/full here): every script ends with one line saying so,
exit code 1, no traceback and no 'Exception ignored' at interpreter exit, whether Python buffers stdout or not
(PYTHONUNBUFFERED). Another file's OSError is not mistaken for it, and a reader that left (`| head`) is quiet.

    python -m pytest -q tests/test_stdout.py
"""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_FLAGS, make_shards, write_hellaswag

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
pytestmark = pytest.mark.slow

FULL = "error: cannot write to standard output (No space left on device)"


def run(args, stdout, buffered, stdin=subprocess.DEVNULL):
    """(exit code, stderr) of `python args...` with stdout opened on the given path."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    with open(stdout, "w") as out:
        r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdin=stdin, stdout=out,
                           stderr=subprocess.PIPE, text=True, timeout=300)
    return r.returncode, r.stderr


def assert_stdout_error(code, err):
    assert code == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert errors == [FULL] and err.strip().splitlines()[-1] == FULL, err


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Cheap inputs of every script: a small log, a random tiny HF GPT-2 with 2 HellaSwag examples, shards, a .txt."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64)).save_pretrained(str(d / "hf"))
    (d / "log.txt").write_text("0 train 10.9\n1 train 9.5\n1 val 9.7\n")
    (d / "doc.txt").write_text("It is a truth universally acknowledged. " * 100)
    return {"dir": d, "hf": str(d / "hf"), "hellaswag": write_hellaswag(str(d / "hs.jsonl"), n=2),
            "shards": make_shards(str(d / "shards")), "log": str(d / "log.txt"), "doc": str(d / "doc.txt")}


SCRIPTS = {
    "plot_log": lambda i, tmp: ["plot_log.py", i["log"], "--out", str(tmp / "plot.png")],
    "hellaswag": lambda i, tmp: ["hellaswag.py", "--init_from", i["hf"], "--data", i["hellaswag"], "--device", "cpu"],
    "generate": lambda i, tmp: ["generate_tokens.py", "--init_from", i["hf"], "--num_samples", "1",
                                "--max_new_tokens", "2", "--device", "cpu"],
    "fineweb": lambda i, tmp: ["fineweb.py", "--input", i["doc"], "--output_dir", str(tmp / "shards"),
                               "--shard_size", "200"],
    "train": lambda i, tmp: ["train_gpt2.py", *TINY_FLAGS, "--data_dir", i["shards"], "--log_dir", str(tmp / "log"),
                             "--max_steps", "2"],
    "--help": lambda i, tmp: ["plot_log.py", "--help"],
}


# plot_log (fast) with stdout buffered and not; each other script once, one way or the other
CASES = [("plot_log", True), ("plot_log", False), ("--help", True), ("--help", False), ("fineweb", True),
         ("train", False), ("hellaswag", True), ("generate", False)]


@pytest.mark.parametrize("script, buffered", CASES, ids=[f"{s}-{'buffered' if b else 'unbuffered'}" for s, b in CASES])
def test_a_full_stdout_is_one_line(inputs, tmp_path, script, buffered):
    assert_stdout_error(*run(SCRIPTS[script](inputs, tmp_path), "/dev/full", buffered))
    if script == "train":  # the run itself went on to its end: all steps logged, the last one checkpointed
        assert os.path.isfile(tmp_path / "log" / "model_00001.pt")
        assert [ln.split()[:2] for ln in (tmp_path / "log" / "log.txt").read_text().splitlines() if " train " in ln] \
            == [["0", "train"], ["1", "train"]]


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_other_oserrors_are_not_taken_for_stdout(tmp_path, buffered):
    """An OSError of another file is the script's own to report (here: unhandled, a traceback), even while
    stdout is /dev/full, as long as nothing failed to reach stdout; a script's one-line error stays its own."""
    script = tmp_path / "script.py"
    script.write_text("import errno, sys\nfrom nanogpt.cli import UserError, run_cli\n"
                      "def main():\n"
                      "    if sys.argv[1] == 'user':\n"
                      "        raise UserError('bad flag')\n"
                      "    raise OSError(errno.ENOSPC, 'No space left on device', 'model.pt')\n"
                      "run_cli(main)\n")
    for stdout in (os.devnull, "/dev/full"):
        code, err = run([str(script), "oserror"], stdout, buffered)
        assert code == 1 and "Traceback" in err and "model.pt" in err and "standard output" not in err, err
        code, err = run([str(script), "user"], stdout, buffered)
        assert code == 2 and err == "error: bad flag\n", err


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_stdout_failure_a_script_reports_as_its_own_is_named_as_stdout(tmp_path, buffered):
    """fineweb.py turns any OSError while making shards into 'cannot write shards ...'; when the OSError was
    stdout's, the line says so instead (and a reader that left, `| head`, ends quietly with 141)."""
    script = tmp_path / "script.py"
    script.write_text("from nanogpt.cli import UserError, run_cli\n"
                      "def main():\n"
                      "    try:\n"
                      "        for i in range(100000):\n"
                      "            print(f'wrote shard {i}', flush=True)\n"
                      "    except OSError as e:\n"
                      "        raise UserError(f'cannot write shards ({e})') from None\n"
                      "run_cli(main)\n")
    assert_stdout_error(*run([str(script)], "/dev/full", buffered))
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(f"{sys.executable} {script} | head -1; exit ${{PIPESTATUS[0]}}", shell=True,
                       executable="/bin/bash", cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 141 and r.stderr == "" and r.stdout == "wrote shard 0\n", (r.returncode, r.stderr)


def test_output_written_through_the_buffer_is_caught_at_the_last_flush(tmp_path):
    """Bytes written to sys.stdout.buffer (buffered stdout) fail only when flushed: at exit, one line."""
    script = tmp_path / "script.py"
    script.write_text("import sys\nfrom nanogpt.cli import run_cli\n"
                      "run_cli(lambda: sys.stdout.buffer.write(b'x' * 100))\n")
    assert_stdout_error(*run([str(script)], "/dev/full", buffered=True))
    code, err = run([str(script)], os.devnull, buffered=True)
    assert code == 0 and err == "", err

