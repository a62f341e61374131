"""Exact resume, preemption by real signals, crash-safe files, non-finite steps, bad input."""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import train_gpt2
from nanogpt.checkpoints import find_checkpoints, load_checkpoint
from nanogpt.shards import read_shard, write_shard
from conftest import (ROOT, TINY_FLAGS, assert_one_line_error, assert_same_norms, build_nanogpt_lines, load_weights,
                      make_shards, max_weight_diff, numbers_logged, read_log, run_script, torchrun, train,
                      truncate_half)

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
pytestmark = pytest.mark.slow


def log_text(log_dir):
    with open(os.path.join(log_dir, "log.txt")) as f:
        return f.read()


RUN = ["--max_steps", "8", "--eval_every", "2", "--save_every", "4", "--total_batch_size", "512"]


def test_resume_reproduces_the_uninterrupted_run(shards, tmp_path):
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, *RUN)
    straight_log, straight = numbers_logged(log_dir), load_weights(os.path.join(log_dir, "model_00007.pt"))
    os.remove(os.path.join(log_dir, "model_00007.pt"))  # as if the run had died after step 3's checkpoint
    with open(os.path.join(log_dir, "log.txt"), "a") as f:
        f.write("5 train 99.0\n")  # a line written after that checkpoint, by the run that died
    train(shards, log_dir, *RUN, "--resume")
    assert numbers_logged(log_dir) == straight_log  # the same lines: losses to the 6th decimal, one run
    # on CPU in fp32 a resume is exact: the same float operations on the same state, bit for bit
    assert max_weight_diff(straight, load_weights(os.path.join(log_dir, "model_00007.pt"))) == 0


def test_ddp_resume_and_resume_on_another_world_size(shards, tmp_path, capsys):
    common = [*TINY_FLAGS, "--data_dir", shards, *RUN]
    ddp = str(tmp_path / "ddp")
    straight_run = torchrun(2, *common, "--log_dir", ddp)
    assert straight_run.returncode == 0, straight_run.stderr[-3000:]
    straight_log, straight = numbers_logged(ddp), load_weights(os.path.join(ddp, "model_00007.pt"))
    one = str(tmp_path / "one")
    os.makedirs(one)
    shutil.copy(os.path.join(ddp, "model_00003.pt"), one)
    shutil.copy(os.path.join(ddp, "log.txt"), one)
    os.remove(os.path.join(ddp, "model_00007.pt"))
    result = torchrun(2, *common, "--log_dir", ddp, "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert numbers_logged(ddp) == straight_log
    assert max_weight_diff(straight, load_weights(os.path.join(ddp, "model_00007.pt"))) == 0  # bit for bit
    # the 2-process checkpoint continued by one process (4 accumulation steps instead of 2 x 2):
    # the same data and the same math, so the same run up to float rounding
    capsys.readouterr()
    train_gpt2.main([*common, "--log_dir", one, "--resume", "--val_steps", "4"])
    a, b = read_log(ddp)["train"], read_log(one)["train"]
    assert a.keys() == b.keys()
    assert all(abs(a[s] - b[s]) < 1e-4 for s in a)
    assert_same_norms(straight_run.stdout, capsys.readouterr().out, range(4, 8))  # not a gradient summed over ranks
    assert max_weight_diff(straight, load_weights(os.path.join(one, "model_00007.pt"))) < 1e-5


def test_resume_refuses_a_conflicting_shape_and_batch(shards, tmp_path):
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "2", "--eval_every", "0")
    before = sorted(os.listdir(log_dir)), log_text(log_dir)
    with pytest.raises(train_gpt2.UserError, match="--n_layer 3 conflicts"):
        train(shards, log_dir, "--max_steps", "4", "--resume", "--n_layer", "3")
    with pytest.raises(train_gpt2.UserError, match="--total_batch_size 512 conflicts"):
        train(shards, log_dir, "--max_steps", "4", "--resume", "--total_batch_size", "512")
    with pytest.raises(train_gpt2.UserError, match="already holds checkpoints"):
        train(shards, log_dir, "--max_steps", "4")  # a fresh run would overwrite them
    assert (sorted(os.listdir(log_dir)), log_text(log_dir)) == before


def test_resume_without_checkpoint_starts_fresh(shards, tmp_path, capsys):
    train(shards, str(tmp_path / "log"), "--max_steps", "2", "--eval_every", "0", "--resume")
    assert "no checkpoint in" in capsys.readouterr().out
    assert sorted(read_log(str(tmp_path / "log"))["train"]) == [0, 1]


def test_unloadable_newest_checkpoint_is_skipped(shards, tmp_path, capsys):
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "4", "--eval_every", "0", "--save_every", "2")
    newest = os.path.join(log_dir, "model_00003.pt")
    truncate_half(newest)
    train(shards, log_dir, "--max_steps", "5", "--eval_every", "0", "--save_every", "0", "--resume")
    err = capsys.readouterr()
    assert "skipping checkpoint" in err.err and "model_00003.pt" in err.err
    assert "resuming from" in err.out and "model_00001.pt" in err.out
    assert sorted(read_log(log_dir)["train"]) == [0, 1, 2, 3, 4]
    # every checkpoint broken: an error, not a fresh start that would overwrite them
    for path in find_checkpoints(log_dir):
        with open(path, "wb") as f:
            f.write(b"not a checkpoint")
    result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "6", "--resume"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: none of the 3 checkpoints")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_checkpoints_and_exits_cleanly(shards, tmp_path, sig):
    log_dir = str(tmp_path / "log")
    cmd = [sys.executable, "train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "100000",
           "--eval_every", "0", "--save_every", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    for line in proc.stdout:  # wait until training is under way
        if line.startswith("step     2/"):
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped by signal" in out
    ckpts = find_checkpoints(log_dir)
    assert len(ckpts) == 1
    step = load_checkpoint(ckpts[0])["step"]
    assert max(read_log(log_dir)["train"]) == step >= 2
    train(shards, log_dir, "--max_steps", str(step + 3), "--eval_every", "0", "--save_every", "0", "--resume")
    assert sorted(read_log(log_dir)["train"]) == list(range(step + 3))


KILL_WRITER = """
import sys, numpy as np, torch
sys.path.insert(0, {root!r})
from nanogpt import files
from nanogpt.checkpoints import save_checkpoint
from nanogpt.shards import write_shard
path, kind, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
STOP_AT = 1 << 20  # bytes of version k that reach the disk before the writer stops inside its write


class StopsMidWrite:
    \"\"\"The file atomic_write opens for version k: after its first STOP_AT bytes it says so, with the
    file's name, and waits (on stdin, which never comes) for the test's SIGKILL.\"\"\"

    def __init__(self, f, name):
        self.f, self.name, self.written = f, name, 0

    def write(self, data):
        data = bytes(data)
        if self.written + len(data) >= STOP_AT:
            self.f.write(data[: STOP_AT - self.written])
            self.f.flush()
            print("mid-write", self.name, flush=True)
            sys.stdin.readline()
            raise SystemExit("not killed")
        self.written += len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


real_open, version = open, 0
files.open = lambda f, *a, **kw: StopsMidWrite(real_open(f, *a, **kw), f) if version == k else real_open(f, *a, **kw)
for version in range(1, k + 1):  # versions 1 .. k-1 complete, then version k stops in the middle
    if kind == "checkpoint":  # the payload is built before the write begins
        payload = {{"model": {{"w": torch.full((4_000_000,), float(version))}}, "config": {{}}, "step": version}}
        save_checkpoint(path, payload)
    else:
        payload = np.full(4_000_000, version % 60000)
        write_shard(path, payload)
"""


@pytest.mark.parametrize("kind", ["checkpoint", "shard"])
def test_sigkill_while_writing_leaves_a_loadable_file(tmp_path, kind):
    """SIGKILL in the middle of version k's write (k-1 versions complete, version k's first MiB on
    disk): the file under the final name is version k-1, whole; the partial bytes only ever sat
    in a temporary file beside it."""
    script = tmp_path / "writer.py"
    script.write_text(KILL_WRITER.format(root=ROOT))
    path = str(tmp_path / ("model_00001.pt" if kind == "checkpoint" else "t_train_000001.bin"))
    for k in (2, 3):
        proc = subprocess.Popen([sys.executable, str(script), path, kind, str(k)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with proc:  # on the way out, even from a failed assertion: stdin closed, the writer ends
            for line in proc.stdout:  # ends at EOF if the writer dies first
                if line.startswith("mid-write "):
                    break
            else:
                raise AssertionError(f"the writer ended before it was stopped: {proc.stderr.read()[-2000:]}")
            writing = line[len("mid-write "):].rstrip()  # the kill lands mid-write, in a temporary beside path:
            assert writing != path and os.path.dirname(writing) == str(tmp_path)
            assert os.path.getsize(writing) == 1 << 20
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if kind == "checkpoint":
            ckpt = load_checkpoint(path)
            assert ckpt["step"] == k - 1 and torch.equal(ckpt["model"]["w"], torch.full((4_000_000,), float(k - 1)))
        else:
            tokens = read_shard(path)
            assert len(tokens) == 4_000_000 and np.all(tokens == k - 1)


def test_keep_checkpoints(shards, tmp_path):
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "5", "--eval_every", "0", "--save_every", "1", "--keep_checkpoints", "2")
    assert sorted(n for n in os.listdir(log_dir) if n.endswith(".pt")) == ["model_00003.pt", "model_00004.pt"]


class FillsUp:
    """A file on a disk with `room` bytes left: a write beyond that fails with ENOSPC, as the OS's does."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def test_full_disk_keeps_the_last_good_checkpoint(shards, tmp_path, monkeypatch):
    log_dir = str(tmp_path / "log")
    real_save, calls = torch.save, []

    def save_then_fill_disk(obj, f, *a, **kw):  # torch's own writer meets the full disk (it raises RuntimeError)
        calls.append(1)
        return real_save(obj, f if len(calls) == 1 else FillsUp(f, 100_000), *a, **kw)

    monkeypatch.setattr(train_gpt2.torch, "save", save_then_fill_disk)
    with pytest.raises(train_gpt2.UserError, match="cannot write checkpoint .*No space left.*earlier checkpoints are intact"):
        train(shards, log_dir, "--max_steps", "4", "--eval_every", "0", "--save_every", "2")
    monkeypatch.undo()
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00001.pt"]  # no partial file, no temporary left
    assert load_checkpoint(os.path.join(log_dir, "model_00001.pt"))["step"] == 1


def test_a_file_size_limit_at_the_first_checkpoint_is_one_line(shards, tmp_path):
    """No fake: the kernel refuses the checkpoint's bytes (RLIMIT_FSIZE, EFBIG) and the run ends with one line."""
    import resource

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process instead of failing the write
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # log.txt fits, a checkpoint does not

    log_dir = str(tmp_path / "log")
    args = [os.path.join(ROOT, "train_gpt2.py"), *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir,
            "--max_steps", "2", "--eval_every", "0", "--save_every", "1"]
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
    assert_one_line_error(result, "cannot write checkpoint", "model_00000.pt", os.strerror(errno.EFBIG))
    assert sorted(os.listdir(log_dir)) == ["log.txt"]  # no partial checkpoint, no temporary
    assert [ln.split()[:2] for ln in build_nanogpt_lines(log_dir).splitlines()] == [["0", "train"]]


def poison_forward(monkeypatch, bad_calls):
    """Make the training forward passes whose index is in bad_calls return a NaN loss."""
    real_forward, count = train_gpt2.GPT.forward, [0]

    def forward(self, idx, targets=None):
        logits, loss = real_forward(self, idx, targets)
        if self.training and targets is not None:
            if count[0] in bad_calls:
                loss = loss * float("nan")
            count[0] += 1
        return logits, loss

    monkeypatch.setattr(train_gpt2.GPT, "forward", forward)


def test_non_finite_step_is_skipped(shards, tmp_path, monkeypatch):
    log_dir = str(tmp_path / "log")
    poison_forward(monkeypatch, bad_calls={4})  # 2 micro-steps per step: step 2's first micro-step
    train(shards, log_dir, "--max_steps", "4", "--eval_every", "0", "--save_every", "1")
    assert [ln.split()[:2] for ln in build_nanogpt_lines(log_dir).splitlines()] == [
        ["0", "train"], ["1", "train"], ["2", "skipped"], ["3", "train"]]
    assert all(len(ln.split()) == 3 for ln in log_text(log_dir).splitlines())  # build-nanogpt's notebook reads 3 fields
    w1, w2, w3 = (load_weights(os.path.join(log_dir, f"model_0000{s}.pt")) for s in (1, 2, 3))
    assert max_weight_diff(w1, w2) == 0  # the NaN step changed nothing
    assert max_weight_diff(w2, w3) > 0 and all(torch.isfinite(v).all() for v in w3.values())


def test_a_skipped_step_is_said_so_in_tensorboard(shards, tmp_path, monkeypatch):
    """TensorBoard has the skipped step as log.txt has it: train/skipped 1 and its loss apart (train/skipped_loss),
    train/loss holding the steps applied (not a NaN with nothing beside it)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    poison_forward(monkeypatch, bad_calls={4})  # step 2's first micro-step
    board = str(tmp_path / "tb")
    train(shards, str(tmp_path / "log"), "--max_steps", "4", "--eval_every", "0", "--tensorboard", board,
          "--tensorboard_run", "run")
    events = EventAccumulator(os.path.join(board, "run"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert sorted(scalars["train/loss"]) == [0, 1, 3] and all(map(np.isfinite, scalars["train/loss"].values()))
    assert scalars["train/skipped"] == {2: 1.0} and list(scalars["train/skipped_loss"]) == [2]


def test_too_many_bad_steps_stop_and_name_the_last_good_checkpoint(shards, tmp_path, monkeypatch):
    log_dir = str(tmp_path / "log")
    poison_forward(monkeypatch, bad_calls=set(range(4, 1000)))
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(train_gpt2.UserError, match=r"3 non-finite steps in a row .*model_00004\.pt"):
        train(shards, log_dir, "--max_steps", "20", "--eval_every", "0", "--save_every", "2", "--max_bad_steps", "3")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # Ctrl-C works again
    # the checkpoints written during the skipped steps and at the stop hold the weights of the last good update
    w1, w3, w4 = (load_weights(os.path.join(log_dir, f"model_0000{s}.pt")) for s in (1, 3, 4))
    assert max_weight_diff(w1, w3) == 0 and max_weight_diff(w1, w4) == 0


def test_too_many_bad_steps_save_the_last_good_state_before_stopping(shards, tmp_path, monkeypatch):
    """No --save_every checkpoint in reach: the stop saves the state after the last good update (the skipped steps
    changed nothing), which a resume continues from; compared with a run of the good steps alone."""
    good, log_dir = str(tmp_path / "good"), str(tmp_path / "log")
    train(shards, good, "--max_steps", "2", "--eval_every", "0")
    poison_forward(monkeypatch, bad_calls=set(range(4, 1000)))  # 2 micro-steps a step: step 2 on
    with pytest.raises(train_gpt2.UserError, match=r"^1 non-finite step in a row at step 2; .*saved .*model_00002\.pt"):
        train(shards, log_dir, "--max_steps", "20", "--eval_every", "0", "--save_every", "0", "--max_bad_steps", "1")
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00002.pt"]
    assert max_weight_diff(load_weights(os.path.join(good, "model_00001.pt")),
                           load_weights(os.path.join(log_dir, "model_00002.pt"))) == 0
    monkeypatch.undo()
    train_gpt2.main(["--log_dir", log_dir, "--resume", "--max_steps", "4"])
    assert sorted(read_log(log_dir)["train"]) == [0, 1, 3]


def test_a_stop_for_non_finite_steps_under_torchrun_is_said_once(tmp_path):
    """Every rank stops at the same step (they agree on the loss and the norm): one line says why, not one a rank.
    A rate of 1000 makes the loss non-finite within a few steps."""
    data = make_shards(str(tmp_path / "data"))
    result = torchrun(2, *TINY_FLAGS, "--data_dir", data, "--log_dir", str(tmp_path / "log"), "--max_steps", "30",
                      "--eval_every", "0", "--warmup_steps", "0", "--max_lr", "1000", "--max_bad_steps", "2",
                      "--total_batch_size", "256")
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and ("non-finite step" in said[0] or "NaN or inf" in said[0]), result.stderr[-3000:]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weights_health_check_finds_every_non_finite_value(value, dtype):
    from nanogpt.run import weights_finite

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)).to(dtype)
    model.register_parameter("empty", torch.nn.Parameter(torch.empty(0, dtype=dtype)))
    with torch.no_grad():
        model[0].weight[2, 5] = value
    want = all(bool(torch.isfinite(p).all()) for p in model.parameters())  # the reference: every entry looked at
    assert weights_finite(model) == want
    assert want == (abs(float(torch.tensor(value, dtype=dtype))) < float("inf"))  # the case is what it says


def break_a_weight_at_step_2(monkeypatch, breaks):
    """AdamW's step, then at its third call (step 2's update) breaks(self) puts an inf into a weight."""
    step, calls = torch.optim.AdamW.step, []

    def breaking_step(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                breaks(self)
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", breaking_step)


@pytest.mark.parametrize("optimizer, rates", [("adamw", "--max_lr$"), ("muon", "--muon_lr or --max_lr$")])
def test_an_update_that_breaks_the_weights_stops_the_run(optimizer, rates, shards, tmp_path, monkeypatch):
    # a finite loss and gradient, then an optimizer step that leaves an inf in a weight: the run stops at the next
    # step (its loss is not finite) or the next checkpoint, whichever comes first, and saves nothing after it; the
    # message names the run's rates (Muon's matrices train at --muon_lr)
    log_dir = str(tmp_path / "log")
    break_a_weight_at_step_2(monkeypatch, lambda adamw: adamw.param_groups[0]["params"][-1].view(-1)[0].fill_(
        float("inf")))
    with pytest.raises(train_gpt2.UserError, match=r"the weights hold NaN or inf after step 3: .*model_00001\.pt; "
                                                   rf"lower {rates}"):
        train(shards, log_dir, "--max_steps", "6", "--eval_every", "0", "--save_every", "2", "--optimizer", optimizer)
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00001.pt"]


def test_a_broken_weight_the_loss_does_not_see_is_never_saved(shards, tmp_path, monkeypatch):
    # an inf in a padded-vocabulary row of an untied token embedding (llama's, padded here): no token of the data
    # looks it up, so the loss stays finite, and the check before the checkpoint stops the run instead of writing it
    log_dir = str(tmp_path / "log")
    # the first 2-D parameter is transformer.wte; row 50300 is padding, which no token of the data looks up
    break_a_weight_at_step_2(monkeypatch, lambda adamw: adamw.param_groups[0]["params"][0][50300, 0].fill_(
        float("inf")))
    with pytest.raises(train_gpt2.UserError, match=r"the weights hold NaN or inf after step 3: .*model_00001\.pt"):
        train(shards, log_dir, "--max_steps", "6", "--eval_every", "0", "--save_every", "2", "--arch", "llama",
              "--vocab_size", "50304")
    assert [ln.split()[:2] for ln in build_nanogpt_lines(log_dir).splitlines()] == [
        [str(i), "train"] for i in range(4)]  # every loss was finite
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00001.pt"]


def test_verify_data_against_manifest(shards, tmp_path):
    names = sorted(os.listdir(shards))
    manifest = {"shards": [{"name": n, "sha256": hashlib.sha256(open(os.path.join(shards, n), "rb").read()).hexdigest()} for n in names]}
    with open(os.path.join(shards, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    train(shards, str(tmp_path / "ok"), "--max_steps", "1", "--eval_every", "0", "--verify_data")
    train_path = os.path.join(shards, names[-1])
    with open(train_path, "r+b") as f:  # flip one token: the header and size still look right
        f.seek(2000)
        b = f.read(1)
        f.seek(2000)
        f.write(bytes([b[0] ^ 1]))
    result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "bad"), "--max_steps", "1", "--verify_data"])
    assert_one_line_error(result, names[-1], "sha256")
    extra = os.path.join(shards, "zz_train_000009.bin")  # a shard the manifest does not know
    shutil.copy(os.path.join(shards, names[0]), extra)
    with open(train_path, "r+b") as f:  # the flipped token back
        f.seek(2000)
        f.write(b)
    with pytest.raises(train_gpt2.UserError, match="zz_train_000009.bin is not listed in manifest.json"):
        train(shards, str(tmp_path / "extra"), "--max_steps", "1", "--eval_every", "0", "--verify_data")


def test_bad_inputs_get_one_line(shards, tmp_path):
    base = ["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--max_steps", "1"]
    assert_one_line_error(run_script([*base, "--log_dir", str(tmp_path / "a"), "--init_from", "gpt5"]), "gpt5")
    assert_one_line_error(run_script([*base, "--log_dir", str(tmp_path / "b"), "--model", "d99"]), "--model")
    assert_one_line_error(run_script([*base, "--log_dir", str(tmp_path / "c"), "--batch_size", "0"]), "--batch_size")
    # errors raised in hellaswag.py (which imports train_gpt2) while train_gpt2.py runs as the script
    assert_one_line_error(run_script([*base, "--log_dir", str(tmp_path / "e"), "--hellaswag_every", "1",
                                      "--hellaswag_data", str(tmp_path / "missing.jsonl")]), "missing.jsonl")
    bad_hs = tmp_path / "bad.jsonl"
    bad_hs.write_text('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 0}\n{"ctx": "a"}\n')
    assert_one_line_error(run_script([*base, "--log_dir", str(tmp_path / "f"), "--hellaswag_every", "1",
                                      "--hellaswag_data", str(bad_hs)]), "bad.jsonl:2")
    truncated = make_shards(str(tmp_path / "trunc"))
    shard = os.path.join(truncated, "test_train_000001.bin")
    with open(shard, "r+b") as f:
        f.truncate(3000)
    result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", truncated, "--log_dir", str(tmp_path / "d"), "--max_steps", "1"])
    assert_one_line_error(result, "test_train_000001.bin", "truncated")
    assert os.path.getsize(shard) == 3000  # the user's file is left as it was


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32))
    path = str(tmp_path / "model_00001.pt")
    config = {"block_size": 32, "vocab_size": 50304, "n_layer": 3, "n_head": 2, "n_embd": 32}  # says 3 layers, holds 2
    torch.save({"model": model.state_dict(), "config": config, "step": 1}, path)
    hs = tmp_path / "hs.jsonl"
    hs.write_text('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 0}\n')
    for cmd in (["generate_tokens.py"], ["hellaswag.py", "--data", str(hs)]):
        result = run_script([*cmd, "--checkpoint", path, "--device", "cpu"])
        assert_one_line_error(result, "model_00001.pt", "do not fit")


def test_sibling_scripts_bad_input_one_line(tmp_path):
    binary = tmp_path / "model_00001.pt"
    binary.write_bytes(bytes(range(256)) * 8)  # not text: e.g. a checkpoint given where a log or .jsonl belongs
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_dir = str(tmp_path / "hf")  # a model that loads, so the bad data file is what is refused
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64)).save_pretrained(hf_dir)
    cases = [
        (["plot_log.py", str(binary)], "model_00001.pt:1"),
        (["hellaswag.py", "--init_from", hf_dir, "--data", str(binary)], "model_00001.pt:1"),
        (["fineweb.py", "--input", os.path.join(ROOT, "data", "austen.txt"), "--output_dir", "/dev/null/x"], "cannot write shards"),
        (["fineweb.py", "--shard_size", "abc"], "--shard_size"),  # argparse errors too: one line, not a usage block
        (["hellaswag.py", "--limit", "x"], "--limit"),
        (["plot_log.py"], "required"),
    ]
    procs = [subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")) for args, _ in cases]
    for proc, (args, needle) in zip(procs, cases):
        out, err = proc.communicate(timeout=120)
        assert_one_line_error(subprocess.CompletedProcess(args, proc.returncode, out, err), needle)


def test_brief_and_write_shard_digest(tmp_path):
    assert train_gpt2.brief(OSError()) == "OSError"  # an empty message must not crash the error path
    assert train_gpt2.brief(ValueError("first\nsecond")) == "ValueError: first"
    path = str(tmp_path / "t_train_000001.bin")
    digest = write_shard(path, np.arange(1000))
    assert digest == hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_sigterm_to_torchrun_checkpoints_on_all_ranks_agreement(shards, tmp_path):
    """What a cluster scheduler does: SIGTERM to torchrun, which forwards it to both ranks."""
    log_dir = str(tmp_path / "log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_gpt2.py", *TINY_FLAGS,
           "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "100000", "--eval_every", "0", "--save_every", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    for line in proc.stdout:
        if line.startswith("step     2/"):
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert "stopped by signal" in out  # rank 0's word after the all-reduced stop flag and the checkpoint
    step = load_checkpoint(find_checkpoints(log_dir)[0])["step"]
    assert max(read_log(log_dir)["train"]) == step >= 2
    # continued by one process: the checkpoint's global data position makes that the same run
    train(shards, log_dir, "--max_steps", str(step + 2), "--eval_every", "0", "--save_every", "0", "--resume")
    assert sorted(read_log(log_dir)["train"]) == list(range(step + 2))


def test_overwrite_starts_a_new_run_in_a_used_folder_and_nothing_else_does(shards, tmp_path, capsys):
    """The README's benchmark command twice into one folder: refused without --overwrite, which deletes the
    earlier run's checkpoints and log only once the new run has passed its checks; never with --resume."""
    log_dir = str(tmp_path / "log")
    bench = ["--max_steps", "3", "--eval_every", "0", "--save_every", "0"]
    train(shards, log_dir, *bench)
    (tmp_path / "log" / "notes.txt").write_text("mine")
    before = sorted(os.listdir(log_dir)), log_text(log_dir)
    assert before[0] == ["log.txt", "model_00002.pt", "notes.txt"]
    with pytest.raises(train_gpt2.UserError, match="already holds checkpoints.*--overwrite to start over"):
        train(shards, log_dir, *bench)
    with pytest.raises(train_gpt2.UserError, match="--overwrite starts a new run .* --resume continues it"):
        train(shards, log_dir, *bench, "--overwrite", "--resume")
    with pytest.raises(train_gpt2.UserError, match="no manifest.json"):  # a refusal found in set-up deletes nothing
        train(shards, log_dir, *bench, "--overwrite", "--verify_data")
    assert (sorted(os.listdir(log_dir)), log_text(log_dir)) == before
    train(shards, log_dir, "--max_steps", "2", "--eval_every", "0", "--save_every", "0", "--overwrite")
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00001.pt", "notes.txt"]
    assert sorted(read_log(log_dir)["train"]) == [0, 1]
    # --overwrite is not a setting of the run: its resume is an ordinary one
    train(shards, log_dir, "--max_steps", "3", "--eval_every", "0", "--resume")
    assert sorted(read_log(log_dir)["train"]) == [0, 1, 2]
