"""What guards a run: an error only torchrun's rank 0 can find ends every rank in one line, and a
--log_dir is held by one run at a time.

The ranks of a 2-process job are started here as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR,
...), but without torchrun's agent, which kills the other ranks as soon as one fails and so hides how
they would have ended; one test runs the real torchrun too.

    python -m pytest -q tests/test_run_guard.py
"""

import errno
import hashlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

import train_gpt2
from nanogpt.checkpoints import find_checkpoints, prune_checkpoints
from nanogpt.runlog import LOG_DIR_LOCK, lock_log_dir, unlock_log_dir
from nanogpt.runtime import RankZeroWork, process_start
from conftest import ROOT, TINY_FLAGS, assert_one_line_error, read_log, run_script, script_cli, torchrun, train, write_hellaswag

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
pytestmark = pytest.mark.slow

LIMIT_S = 120  # a rank still running after this is waiting for a peer that is gone


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(argv, nproc=2, rank0_setup=None, script="train_gpt2.py"):
    """Start train_gpt2.py (or script) as the nproc ranks of one job, their output piped; (command, processes),
    rank 0 first. rank0_setup: a preexec_fn for rank 0 alone."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    cmd = [sys.executable, script, *argv]
    return cmd, [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, preexec_fn=rank0_setup if r == 0 else None)
                 for r in range(nproc)]


def launch_ranks(argv, nproc=2, rank0_setup=None, script="train_gpt2.py"):
    """Run train_gpt2.py (or script) as the nproc ranks of one job; each rank's CompletedProcess, rank 0 first.
    rank0_setup: a preexec_fn for rank 0 alone."""
    cmd, procs = start_ranks(argv, nproc, rank0_setup, script)
    try:
        outputs = [p.communicate(timeout=LIMIT_S) for p in procs]
        return [subprocess.CompletedProcess(cmd, p.returncode, *out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def assert_rank0_says_it_and_the_others_leave_quietly(ranks, *needles):
    assert_one_line_error(ranks[0], *needles)
    assert ranks[0].stderr.startswith("error: ")
    for rank in ranks[1:]:
        assert rank.returncode == ranks[0].returncode == 2 and rank.stderr == "", rank.stderr


def folder_state(path):
    """Every name under path with its bytes (None for a folder) and modification time."""
    state = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            data = None if os.path.isdir(full) else pathlib.Path(full).read_bytes()
            state[os.path.relpath(full, path)] = (data, os.stat(full).st_mtime_ns)
    return state


def write_manifest(data_dir, wrong=()):
    """fineweb.py's manifest.json for data_dir's shards; the names in `wrong` get another sha256."""
    names = sorted(n for n in os.listdir(data_dir) if n.endswith(".bin"))
    shards = [{"name": n, "sha256": "0" * 64 if n in wrong else hashlib.sha256(pathlib.Path(data_dir, n).read_bytes()).hexdigest()}
              for n in names]
    with open(os.path.join(data_dir, "manifest.json"), "w") as f:
        json.dump({"shards": shards}, f)


def log_file_size_limit(nbytes):
    """preexec_fn: no file of the process may grow past nbytes (the kernel's EFBIG, as a full disk would refuse)."""
    def limit():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process instead of failing the write
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


@pytest.fixture
def held_lock(tmp_path):
    """Hold a --log_dir's lock in this process, as a live run would: yields the folder."""
    log_dir = tmp_path / "log"
    log_dir.mkdir(exist_ok=True)
    fd = lock_log_dir(str(log_dir))
    yield str(log_dir)
    unlock_log_dir(str(log_dir), fd)


# ---------------------------------------------------------------------------------------------------
# An error only rank 0 finds


def test_verify_data_that_only_rank_0_checks_ends_both_ranks_in_one_line(shards, tmp_path):
    write_manifest(shards, wrong=["test_train_000001.bin"])
    log_dir = str(tmp_path / "log")
    ranks = launch_ranks([*TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "2", "--verify_data"])
    assert_rank0_says_it_and_the_others_leave_quietly(ranks, "test_train_000001.bin", "sha256")
    assert not os.path.exists(log_dir)


def test_a_log_txt_that_is_a_folder_ends_both_ranks_in_one_line(shards, tmp_path):
    log_dir = tmp_path / "log"
    (log_dir / "log.txt").mkdir(parents=True)
    (log_dir / "log.txt" / "notes").write_text("mine")
    before = folder_state(log_dir)
    ranks = launch_ranks([*TINY_FLAGS, "--data_dir", shards, "--log_dir", str(log_dir), "--max_steps", "2"])
    assert_rank0_says_it_and_the_others_leave_quietly(ranks, "log.txt")
    assert folder_state(log_dir) == before


def test_a_folder_in_use_ends_both_ranks_in_one_line(shards, held_lock):
    before = folder_state(held_lock)
    ranks = launch_ranks([*TINY_FLAGS, "--data_dir", shards, "--log_dir", held_lock, "--max_steps", "2"])
    assert_rank0_says_it_and_the_others_leave_quietly(ranks, f"--log_dir {held_lock} is in use by another training run")
    assert folder_state(held_lock) == before


def test_a_checkpoint_rank_0_cannot_write_mid_run_ends_both_ranks_in_one_line(shards, tmp_path):
    """Rank 0's files may not grow past 1 MB (log.txt's lines fit, the ~20 MB checkpoint of step 1 does not)."""
    log_dir = tmp_path / "log"
    ranks = launch_ranks([*TINY_FLAGS, "--data_dir", shards, "--log_dir", str(log_dir), "--max_steps", "4",
                          "--eval_every", "0", "--save_every", "2"], rank0_setup=log_file_size_limit(1 << 20))
    assert_rank0_says_it_and_the_others_leave_quietly(ranks, "cannot write checkpoint", "model_00001.pt")
    assert "step     1/4" in ranks[0].stdout and "step     2/4" not in ranks[0].stdout
    assert sorted(os.listdir(log_dir)) == ["log.txt"]  # no temporary left, no lock file
    assert sorted(read_log(str(log_dir))["train"]) == [0, 1]


def test_a_log_rank_0_cannot_append_to_mid_run_ends_both_ranks_at_that_step(shards, tmp_path):
    """log.txt may hold the run's first lines (its parameters, its data's source) and steps 0 and 1 (a loss line of
    18 bytes and a step time of at most 18 each) on rank 0's disk, and not step 2's loss line too. Both ranks leave at
    the end of step 2, before any checkpoint."""
    from transformers import GPT2Config, GPT2LMHeadModel  # TINY_FLAGS' model, counted by another program

    params = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50304)).num_parameters()
    limit = len(f"0 params {params}\n0 val_fineweb_edu 0\n") + 2 * (18 + len("0 step_ms 99999.9\n"))
    log_dir = str(tmp_path / "log")
    ranks = launch_ranks([*TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "6", "--eval_every", "0"],
                         rank0_setup=log_file_size_limit(limit))
    assert_rank0_says_it_and_the_others_leave_quietly(ranks, "cannot append to", "log.txt", os.strerror(errno.EFBIG))
    assert "step     2/6" in ranks[0].stdout and "step     3/6" not in ranks[0].stdout
    assert os.listdir(log_dir) == ["log.txt"]


def test_under_torchrun_the_error_is_one_line_and_no_rank_shows_a_traceback(shards, held_lock):
    result = torchrun(2, *TINY_FLAGS, "--data_dir", shards, "--log_dir", held_lock, "--max_steps", "2")
    assert result.returncode != 0
    ours = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert ours == [f"error: --log_dir {held_lock} is in use by another training run (process {os.getpid()} on "
                    f"{socket.gethostname()}); wait for it to end, or give another --log_dir (nothing was changed)"]
    # torchrun's own report follows; no rank's traceback (gloo's "Connection closed by peer") comes before it
    assert "train_gpt2.py\", line" not in result.stderr and "Connection closed" not in result.stderr, result.stderr


def test_rank_zero_work_in_one_process_raises_at_once():
    def refuse():
        raise train_gpt2.UserError("refused")

    steps = RankZeroWork(ddp=False, master=True, device="cpu")
    with pytest.raises(train_gpt2.UserError, match="refused"):
        steps.do(refuse)
    assert steps.do(lambda x: x + 1, 1) == 2 and steps.agree(stop=True) and not steps.agree()
    assert RankZeroWork(ddp=False, master=False, device="cpu").do(lambda: 1) is None


def test_under_ddp_rank_zero_holds_any_failure_of_its_work_for_the_others_to_hear():
    """Not only a UserError: a failure of any kind (a tracker's own exception, a full disk's OSError) raised
    at once on rank 0 would leave the other ranks waiting in their next collective. do() takes no
    collective, so it is tried here without a process group."""
    steps = RankZeroWork(ddp=True, master=True, device="cpu")
    assert steps.do(lambda: 1 / 0) is None and isinstance(steps.error, ZeroDivisionError)
    assert steps.do(lambda: 1) is None  # once failed, rank 0 does no further work


def test_a_checkpoint_that_cannot_be_pruned_is_kept_with_a_warning(tmp_path, monkeypatch, capsys):
    for step in (1, 2, 3, 4):
        (tmp_path / f"model_{step:05d}.pt").write_bytes(b"x")
    remove = os.remove

    def refuse_one(path):
        if path.endswith("model_00001.pt"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        remove(path)

    monkeypatch.setattr(os, "remove", refuse_one)
    prune_checkpoints(str(tmp_path), 4, 1)
    assert sorted(os.listdir(tmp_path)) == ["model_00001.pt", "model_00004.pt"]
    assert "cannot remove" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# One run per --log_dir


def test_a_second_run_into_a_folder_in_use_is_refused_and_changes_nothing(shards, tmp_path, capsys, one_thread):
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "2", "--eval_every", "0", "--save_every", "1")
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00000.pt", "model_00001.pt"]  # no lock file: it went with the run
    resume = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "4", "--resume"]
    fd = lock_log_dir(log_dir)  # a live run's (another open file: this process is refused as another would be)
    try:
        before = folder_state(log_dir)
        code, _, err = script_cli(capsys, train_gpt2.main, *resume)
        assert code == 2 and err == (f"error: --log_dir {log_dir} is in use by another training run (process {os.getpid()} "
                                     f"on {socket.gethostname()}); wait for it to end, or give another --log_dir "
                                     "(nothing was changed)\n")
        assert folder_state(log_dir) == before
    finally:
        unlock_log_dir(log_dir, fd)
    train_gpt2.main(resume)  # the lock was all that stood in the way
    assert sorted(read_log(log_dir)["train"]) == [0, 1, 2, 3]


def test_a_live_run_keeps_others_out_and_a_killed_one_blocks_nothing(shards, tmp_path, one_thread):
    log_dir = str(tmp_path / "log")
    first = subprocess.Popen([sys.executable, "train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir,
                              "--max_steps", "100000", "--eval_every", "0", "--save_every", "0"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    try:
        for line in first.stdout:  # the run is training: its log folder is in use
            if line.startswith("step     1/"):
                break
        else:
            raise AssertionError("the first run ended before its second step")
        second = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "1"])
        assert_one_line_error(second, f"--log_dir {log_dir} is in use by another training run (process {first.pid} on")
        assert first.poll() is None  # untouched by the refusal
        first.send_signal(signal.SIGKILL)  # no clean-up at all: its lock file stays, its lock goes with it
    finally:
        first.kill()
        first.communicate()
    assert LOG_DIR_LOCK in os.listdir(log_dir)
    train(shards, log_dir, "--max_steps", "1", "--eval_every", "0")
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00000.pt"]


def test_readers_of_a_folder_in_use_are_not_blocked_nor_confused_by_the_lock(shards, tmp_path, capsys, one_thread):
    import generate_tokens
    import hellaswag
    import plot_log

    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "2", "--eval_every", "1", "--save_every", "1")
    fd = lock_log_dir(log_dir)  # a run is using the folder
    try:
        assert find_checkpoints(log_dir) == [os.path.join(log_dir, f"model_0000{s}.pt") for s in (1, 0)]
        code, out, err = script_cli(capsys, generate_tokens.main, "--checkpoint", log_dir, "--device", "cpu", "--prompt",
                                    "Hello", "--num_samples", "1", "--max_new_tokens", "4")
        assert code == 0 and out.strip(), err
        code, out, err = script_cli(capsys, hellaswag.main, "--checkpoint", log_dir, "--device", "cpu",
                                    "--data", write_hellaswag(str(tmp_path / "hs.jsonl"), n=4))
        assert code == 0 and "model_00001.pt" in out + err, out + err
        code, out, err = script_cli(capsys, plot_log.main, log_dir)
        assert code == 0 and os.path.isfile(os.path.join(log_dir, "plot.png")), err
    finally:
        os.close(fd)  # as a killed run leaves it: the lock file, no lock
    train(shards, log_dir, "--max_steps", "3", "--eval_every", "1", "--resume")  # takes model_00001.pt
    assert sorted(read_log(log_dir)["train"]) == [0, 1, 2]
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00000.pt", "model_00001.pt", "model_00002.pt", "plot.png"]


def test_without_fcntl_or_file_locks_the_run_goes_on_unlocked(shards, tmp_path, monkeypatch, capsys, one_thread):
    monkeypatch.setitem(sys.modules, "fcntl", None)  # Windows: the import fails
    assert lock_log_dir(str(tmp_path)) is None
    train(shards, str(tmp_path / "log"), "--max_steps", "1", "--eval_every", "0")
    assert sorted(os.listdir(tmp_path / "log")) == ["log.txt", "model_00000.pt"]
    monkeypatch.undo()

    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))  # a file system without locks

    monkeypatch.setattr(fcntl, "flock", no_locks)
    capsys.readouterr()
    assert lock_log_dir(str(tmp_path)) is None
    assert capsys.readouterr().err.startswith(f"warning: cannot lock --log_dir {tmp_path} ({os.strerror(errno.ENOLCK)})")
    assert not os.path.exists(tmp_path / LOG_DIR_LOCK)


@pytest.mark.parametrize("kind", ["link to a file", "dangling link", "folder"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused_and_never_followed(shards, tmp_path, kind):
    log_dir, target = tmp_path / "log", tmp_path / "precious.txt"
    log_dir.mkdir()
    lock = log_dir / LOG_DIR_LOCK
    if kind == "folder":
        lock.mkdir()
    else:
        if kind == "link to a file":
            target.write_text("keep me\n")
        lock.symlink_to(target)

    def state():
        return sorted(os.listdir(tmp_path)), sorted(os.listdir(log_dir)), target.exists() and target.read_bytes()

    before = state()
    result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", str(log_dir), "--max_steps", "1"])
    assert_one_line_error(result, str(lock), "not a regular file")
    assert state() == before  # the link's target is neither truncated nor made


def test_a_resume_on_a_process_count_that_cannot_split_the_batch_names_those_that_can(shards, tmp_path):
    """384 tokens a step at 4 x 32 a micro-batch: 3 micro-batches, which 1 or 3 processes can share, not 2."""
    log_dir = str(tmp_path / "log")
    flags = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--total_batch_size", "384", "--eval_every", "0"]
    train_gpt2.main([*flags, "--max_steps", "1"])
    before = folder_state(log_dir)
    for rank in launch_ranks([*flags, "--max_steps", "2", "--resume"]):  # each rank finds it alike, and says it
        assert_one_line_error(rank, "error: --total_batch_size 384 is not divisible by batch_size*seq_len*world_size = "
                              "4*32*2 = 256; a resume keeps the run's --total_batch_size: run it on 1 or 3 processes, or "
                              "give a --batch_size that splits it")
    assert folder_state(log_dir) == before


# train_gpt2.py whose rank 1 fails on its Nth call of a function of train_gpt2: "die" by SIGKILL (no clean-up at all),
# or "hang": wait forever, alive, its connections held open by a child too, so that once it is killed the others'
# collectives do not learn of it; it prints "stuck <the child's pid>" (rank 1 prints nothing else). The
# stuck-collective watch's grace shortened to 1 s
FAILING_RANK = """
import os, signal, sys, threading, time
import train_gpt2
import nanogpt.runtime
from nanogpt.cli import run_cli
nanogpt.runtime.STUCK_GRACE_S = 1
how, name, n = sys.argv.pop(1), sys.argv.pop(1), int(sys.argv.pop(1))
real, calls = getattr(train_gpt2, name), []

def failing(*args, **kwargs):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == n:
        if how == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        child = os.fork()
        if child == 0:  # holds every descriptor of rank 1 but its output, until the test kills it
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1), os.dup2(null, 2)
            while True:
                time.sleep(60)
        print("stuck", child, flush=True)
        threading.Event().wait()
    return real(*args, **kwargs)

setattr(train_gpt2, name, failing)
run_cli(train_gpt2.main)
"""


@pytest.mark.parametrize("where,name,n,newest", [("mid-step", "sync_gradients", 4, 2),
                                                 ("mid-evaluation", "validation_loss", 3, 3)])
def test_a_process_that_dies_leaves_the_others_one_line_naming_the_checkpoint_to_resume(shards, tmp_path, where, name,
                                                                                        n, newest):
    """Rank 1 killed in its 4th step (step 3): rank 0 first saves step 2's state, as on any failure mid-step;
    killed in its 3rd validation (step 4, validating every 2): the newest checkpoint is step 3's (saving every 2)."""
    script = tmp_path / "dying.py"
    script.write_text(FAILING_RANK)
    log_dir = str(tmp_path / "log")
    ranks = launch_ranks(["die", name, str(n), *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "8",
                          "--eval_every", "2", "--save_every", "2"], script=str(script))
    assert ranks[1].returncode == -signal.SIGKILL
    checkpoint = os.path.join(log_dir, f"model_{newest:05d}.pt")
    assert_one_line_error(ranks[0], "another process of this run ended", f"`--resume` continues from {checkpoint}")
    assert find_checkpoints(log_dir)[0] == checkpoint
    train_gpt2.main([*TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "8", "--resume"])
    assert sorted(read_log(log_dir)["train"]) == list(range(8))  # and the run carries on from it


def test_a_process_that_a_stop_signal_finds_waiting_for_a_dead_one_says_so_and_ends(shards, tmp_path):
    """A signal cannot reach Python while its main thread waits in a collective for a process that has died
    without its connections closing (how --zero 1's rank 0 once waited until torchrun's SIGKILL, 30 s after a
    kill -9 of rank 1): the watch hears it, finds the process gone, and this one ends with the one line naming
    the checkpoint to resume."""
    script, log_dir = tmp_path / "stuck.py", str(tmp_path / "log")
    script.write_text(FAILING_RANK)
    cmd, ranks = start_ranks(["hang", "sync_gradients", "4", *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir,
                              "--max_steps", "8", "--eval_every", "0", "--save_every", "2", "--zero", "1"],
                             script=str(script))
    holder = None
    try:
        # rank 1 is stuck from its line on: rank 0 waits in its next collective
        line = ranks[1].stdout.readline()
        assert line.startswith("stuck "), ranks[1].communicate()
        holder = int(line.split()[1])
        ranks[1].send_signal(signal.SIGKILL)
        ranks[0].send_signal(signal.SIGTERM)  # what torchrun sends to the others when one process dies
        out, err = ranks[0].communicate(timeout=LIMIT_S)
    finally:
        if holder is not None:
            os.kill(holder, signal.SIGKILL)
        for rank in ranks:
            rank.kill()
            rank.wait()
    newest = find_checkpoints(log_dir)[0]
    assert newest == os.path.join(log_dir, "model_00001.pt")  # saved every 2 steps; rank 1 stuck in step 3
    assert_one_line_error(subprocess.CompletedProcess(cmd, ranks[0].returncode, out, err),
                          f"another process of this run ended (rank 1, process {ranks[1].pid}, is gone)",
                          f"`--resume` continues from {newest}")


def test_a_process_counts_as_ended_once_killed_even_before_it_is_reaped():
    """What the watch takes for a peer's death: a killed process that its parent has not reaped yet (a zombie, as
    torchrun's worker is for a moment) has ended; a frozen one (SIGSTOP) has not."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = process_start(child.pid)
        assert start is not None and start == process_start(child.pid)
        child.send_signal(signal.SIGSTOP)
        assert process_start(child.pid) == start
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, and still unreaped
        assert process_start(child.pid) is None
    finally:
        child.kill()
        child.wait()
    assert process_start(child.pid) != start  # gone, or its PID another process's


# train_gpt2.py with the stuck-collective watch's grace shortened to 2 s
SHORT_WATCH = """
import nanogpt.runtime, train_gpt2
from nanogpt.cli import run_cli
nanogpt.runtime.STUCK_GRACE_S = 2
run_cli(train_gpt2.main)
"""
HELD_S = 12  # how long rank 1 is held up after the stop signal: well past the grace


def test_a_process_held_up_when_a_stop_signal_comes_is_waited_for_and_the_run_checkpoints(shards, tmp_path):
    """Rank 1 frozen (SIGSTOP: a slow disk or device, a stalled machine) when a scheduler's SIGTERM reaches both
    ranks: rank 0, waiting for it in a collective, is not waiting for a dead process, and must not end; once rank 1
    goes on, the run stops as on any signal, with its checkpoint, and both ranks exit 0."""
    script, log_dir = tmp_path / "short_watch.py", str(tmp_path / "log")
    script.write_text(SHORT_WATCH)
    cmd, ranks = start_ranks([*TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "100000",
                              "--eval_every", "0", "--save_every", "0"], script=str(script))
    try:
        for line in ranks[0].stdout:  # both ranks are training
            if line.startswith("step     1/"):
                break
        else:
            raise AssertionError(f"rank 0 ended before its second step: {ranks[0].communicate()}")
        ranks[1].send_signal(signal.SIGSTOP)
        for rank in ranks:
            rank.send_signal(signal.SIGTERM)  # held by rank 1 until it goes on
        try:
            ranks[0].wait(timeout=HELD_S)
        except subprocess.TimeoutExpired:
            pass  # still waiting for rank 1, as it should
        else:
            raise AssertionError(f"rank 0 ended while rank 1 was held up: {ranks[0].communicate()}")
        ranks[1].send_signal(signal.SIGCONT)
        outputs = [rank.communicate(timeout=LIMIT_S) for rank in ranks]
    finally:
        for rank in ranks:
            rank.send_signal(signal.SIGCONT)
            rank.kill()
            rank.wait()
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0 and err == "", err
    stopped = [ln for ln in outputs[0][0].splitlines() if ln.startswith("stopped by signal after step ")]
    assert len(stopped) == 1, outputs[0][0]
    step = int(stopped[0].split()[5].rstrip(";"))
    assert find_checkpoints(log_dir) == [os.path.join(log_dir, f"model_{step:05d}.pt")]
    assert sorted(read_log(log_dir)["train"])[-1] == step


def test_a_rank_waiting_for_peers_that_do_not_come_says_what_it_waits_for(tmp_path):
    """Rank 0 of a 2-process job started alone (by hand, or by a launcher whose other process never came) waits in
    the process group's join: after PEERS_AWAITED_S it says so on stderr, naming WORLD_SIZE and MASTER_ADDR:PORT;
    once rank 1 comes, the job runs as any other."""
    import select

    from conftest import make_shards
    from nanogpt.runtime import PEERS_AWAITED_S

    data = make_shards(str(tmp_path / "data"))
    argv = [*TINY_FLAGS, "--data_dir", data, "--log_dir", str(tmp_path / "log"), "--max_steps", "1"]
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, "train_gpt2.py", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(env, RANK="0", LOCAL_RANK="0"))]
    try:
        said, deadline = "", PEERS_AWAITED_S + LIMIT_S
        while "is waiting for" not in said:
            ready, _, _ = select.select([ranks[0].stderr], [], [], deadline)
            assert ready and ranks[0].poll() is None, said
            said += ranks[0].stderr.readline()
        assert f"2 in all, WORLD_SIZE) to join at 127.0.0.1:{port}" in said and "rank 0" in said, said
        ranks.append(subprocess.Popen([sys.executable, "train_gpt2.py", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=dict(env, RANK="1", LOCAL_RANK="1")))
        assert [p.wait(timeout=LIMIT_S) for p in ranks] == [0, 0], [p.stderr.read() for p in ranks]
        assert sorted(read_log(str(tmp_path / "log"))["train"]) == [0]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
