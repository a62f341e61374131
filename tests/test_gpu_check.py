"""bench/gpu_check.sh, the prepared runs of every path on a GPU in calls that fit a lent device (any two of them a
task), kept from rotting while no GPU is at hand: each call's dry run (its stages at a tiny shape on the CPU, CUDA-only
stages skipped) passes here; a call cut short (a stage at its cap, SIGTERM to the script mid-stage or before its first
stage) says CUT SHORT above the rows that finished and leaves no process or folder behind, and a cut run's resume does
not run; and the report never says passed for a cut-short or failed stage, or a resume that is not the straight run
(each kind of value within its own tolerance)."""

import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import gpu_check_report  # noqa: E402
from conftest import ROOT, make_shards, optional_package, optional_path  # noqa: E402

SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
CALLS = {  # each call's rows, in order
    "1": ["env", "default", "default_resume"],
    "2": ["env", "side_by_side", "modern", "modern_resume"],
    "3": ["env", "torchrun_zero", "torchrun_fsdp", "torchrun_recompute"],
    "4": ["env", "torchrun_plain", "tests"],
    "5": ["env", "speedrun", "speedrun_resume"],
    "6": ["env", "evals_checkpoint", "hellaswag", "core", "generate", "generate_int8", "export_hf", "sampling_speed"],
    "7": ["env", "levers"],
    "8": ["env", "levers_vocab"],
}
# a lent GPU machine's device time per task (its start, each command and the waits between them), and a start's
# (a minute or more, docs/speed.md; taken as 3 minutes)
TASK_SECONDS, MACHINE_START_SECONDS = 15 * 60, 3 * 60


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(str(tmp_path_factory.mktemp("gpu_check_data")), val_tokens=8192, train_tokens=(20000, 20000))


def dry_run_env(tmp_path, shards, **extra):
    """The script's environment: every process it starts has tmp_path in its environment (TMPDIR), so
    `leftovers(tmp_path)` finds any of them still alive."""
    return dict(os.environ, DRY_RUN="1", OUT=str(tmp_path / "out"), BENCH_DATA=shards, PY=sys.executable,
                OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), PYTHONPATH=optional_path(), **extra)


def table_of(summary):
    """summary.txt from its table's header on (env's lines, when the call ran env, are above it)."""
    return ("\n" + summary).split("\nstage ", 1)[1]


def rows(summary):
    """{stage: its line} of summary.txt's table, in order."""
    table = table_of(summary).splitlines()[1:]
    return {line.split()[0]: line for line in table if not line.startswith("gpu check:")}


def leftovers(folder):
    """(pid, command line) of each live process but this one that names folder in its command line or has it for its
    TMPDIR (every process the script starts, from dry_run_env)."""
    marks, found = (f"{folder}/".encode(), f"TMPDIR={folder}\0".encode()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/environ", "rb") as g:
                cmdline, environ = f.read(), g.read()  # a zombie's are empty: it runs nothing
        except OSError:
            continue
        if int(pid) != os.getpid() and (marks[0] in cmdline or marks[1] in environ):
            found.append((int(pid), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("call", sorted(CALLS))
def test_each_calls_dry_run_passes(call, shards, tmp_path):
    references = [os.path.join(ROOT, d, "side_by_side.sh") for d in (".ref", os.path.join("..", "shared", "gpu"))]
    if {"side_by_side", "levers", "levers_vocab"} & set(CALLS[call]) and not any(map(os.path.isfile, references)):
        pytest.skip("build-nanogpt's side_by_side.sh is in neither .ref/ nor ../shared/gpu/ beside this clone")
    if "levers" in CALLS[call] and not optional_package("torchao"):
        pytest.skip("torchao is not installed (its --fp8 variant; .ci/run puts it in .optional/)")
    out = tmp_path / "out"
    result = subprocess.run(["bash", SCRIPT], cwd=str(tmp_path), env=dry_run_env(tmp_path, shards, CALL=call),
                            capture_output=True, text=True, timeout=600)
    summary = (out / "summary.txt").read_text()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    table = rows(summary)
    assert list(table) == CALLS[call], summary
    cuda_only = {"tests"} & set(CALLS[call]) if not torch.cuda.is_available() else set()
    assert all(" ok " in table[name] for name in set(CALLS[call]) - cuda_only), summary
    assert all("skipped: no CUDA" in table[name] for name in cuda_only), summary
    for name in (n for n in CALLS[call] if n.endswith("_resume")):
        assert "log reads as one run (within 0)" in table[name], table[name]
    assert summary.strip().endswith("gpu check: passed")
    with tarfile.open(out / "logs.tar.gz") as logs:  # the logs travel as one file; the working folder is gone
        assert f"logs/{CALLS[call][1]}.txt" in logs.getnames()
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "summary.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("gpu_check.")]
    assert not leftovers(str(tmp_path))


def assert_cut_short(summary, finished, cut):
    table = rows(summary)
    assert [n for n in table if " ok " in table[n]] == finished, summary
    assert all(" CUT SHORT " in table[n] for n in cut), summary
    assert summary.strip().splitlines()[-1].startswith("gpu check: CUT SHORT"), summary
    assert "passed" not in table_of(summary)  # the table (env's commit subject above it may say it)


@pytest.mark.slow
def test_a_call_cut_short_by_a_cap_then_by_sigterm_says_so_and_ends_every_process(shards, tmp_path):
    """One call, cut twice: `default` at a 2 s cap (so default_resume has no checkpoint), then SIGTERM (the device
    tool's limit) to the script while torchrun's worker trains; torchrun starts its worker in a session of its own,
    so the stage's session alone would not reach it."""
    env = dry_run_env(tmp_path, shards, STAGES="env default ddp_plain", CAP_default="2")
    script = subprocess.Popen(["bash", SCRIPT], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    console = []
    for line in script.stdout:  # the stage has begun once the script says so
        console.append(line)
        if line.startswith("== torchrun_plain"):
            break
    # the summary, rewritten as each stage ends, already holds the cut rows
    partial = (tmp_path / "out" / "summary.txt").read_text()
    assert_cut_short(partial, ["env"], ["default", "default_resume"])
    assert "cut short at its cap of 2 s" in rows(partial)["default"]
    assert "not run: default was cut short" in rows(partial)["default_resume"]
    deadline = time.monotonic() + 120
    while not [cmd for _, cmd in leftovers(str(tmp_path)) if "train_gpt2.py" in cmd and "torch.distributed" not in cmd]:
        assert script.poll() is None and time.monotonic() < deadline, "".join(console)
        time.sleep(0.05)  # polling for the worker to appear, not a wait for something to finish
    script.send_signal(signal.SIGTERM)
    rest, _ = script.communicate(timeout=120)
    assert script.returncode == 3, "".join(console) + rest
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert_cut_short(summary, ["env"], ["default", "default_resume", "torchrun_plain"])
    assert "cut short: the check got SIGTERM" in rows(summary)["torchrun_plain"]
    assert not leftovers(str(tmp_path))
    assert not [p for p in os.listdir(tmp_path) if p.startswith("gpu_check.")]
    assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "summary.txt"]


CUT_AFTER_ITS_CHECKPOINTS = """#!/bin/bash
# {python}, except that a straight (not resumed) --recipe modern run writes an empty checkpoint for each of its steps
# and a log of one line, then waits for its cap: a run cut at its cap after the checkpoint its resume starts from
if [[ " $* " == *" --recipe modern "* && " $* " != *" --resume "* ]]; then
  while [ $# -gt 0 ]; do case $1 in --log_dir) dir=$2 ;; --max_steps) steps=$2 ;; esac; shift; done
  mkdir -p "$dir" && echo "0 train 10.900000" > "$dir/log.txt"
  for ((step = 0; step < steps; step++)); do : > "$(printf '%s/model_%05d.pt' "$dir" "$step")"; done
  exec sleep 600
fi
exec {python} "$@"
"""


@pytest.mark.slow
def test_a_straight_run_cut_after_its_checkpoint_leaves_its_resume_not_run(shards, tmp_path):
    """A straight row cut at its cap has a partial log, whatever checkpoints it wrote: its resume row does not run
    (it would compare the resumed log with a cut one: a false FAILED), and says why."""
    python = tmp_path / "python"
    python.write_text(CUT_AFTER_ITS_CHECKPOINTS.format(python=sys.executable))
    python.chmod(0o755)
    env = dict(dry_run_env(tmp_path, shards, STAGES="modern", CAP_modern="5"), PY=str(python))
    result = subprocess.run(["bash", SCRIPT], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert result.returncode == 3, result.stdout[-4000:] + result.stderr[-2000:]
    assert_cut_short(summary, [], ["modern", "modern_resume"])
    assert "cut short at its cap of 5 s" in rows(summary)["modern"], summary
    assert "not run: modern was cut short" in rows(summary)["modern_resume"], summary
    assert not leftovers(str(tmp_path))


@pytest.mark.slow
def test_sigterm_before_the_first_stage_still_writes_the_summary_and_cleans_up(shards, tmp_path):
    """SIGTERM as soon as the script has made its working folder (it then asks torch whether CUDA is there, seconds
    before its first stage): the summary says CUT SHORT, the folder goes, no process stays."""
    script = subprocess.Popen(["bash", SCRIPT], cwd=str(tmp_path), env=dry_run_env(tmp_path, shards, CALL="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not [p for p in os.listdir(tmp_path) if p.startswith("gpu_check.")]:
        assert script.poll() is None and time.monotonic() < deadline, "the script ended or made no folder"
        time.sleep(0.01)  # polling for the folder to appear, not a wait for something to finish
    script.send_signal(signal.SIGTERM)
    console, _ = script.communicate(timeout=120)
    assert script.returncode == 3, console
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert_cut_short(summary, [], [])
    assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "summary.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("gpu_check.")]
    assert not leftovers(str(tmp_path))


def test_any_two_calls_and_a_machines_start_fit_one_task():
    """A call ends within BUDGET (its stages' caps are cut to what is left of it; the cut tests above), so two calls at
    the default BUDGET after a machine's start fit a task's device time, each under 8 minutes; docs/speed.md's table
    names each call's rows and an estimate that fits its BUDGET less the reserve for the last summary."""
    script = open(SCRIPT).read()
    budget = int(re.search(r"^BUDGET=\$\{BUDGET:-(\d+)\}", script, re.M).group(1))
    reserve = int(re.search(r"^RESERVE=(\d+)", script, re.M).group(1))
    assert 2 * budget + MACHINE_START_SECONDS <= TASK_SECONDS and budget < 8 * 60, budget
    speed = open(os.path.join(ROOT, "docs", "speed.md")).read()
    table = {m.group(1): m for m in re.finditer(r"^\| (\d+) \| ([^|]+) \|.*\| ~(\d+) s \|$", speed, re.M)}
    assert sorted(table) == sorted(CALLS)
    for call, m in table.items():
        assert re.findall(r"`(\w+)`", m.group(2)) == CALLS[call], m.group(0)
        assert int(m.group(3)) <= budget - reserve, m.group(0)


def write_log(path, entries):
    path.write_text("".join(f"{step} {kind} {value}\n" for step, kind, value in entries))
    return str(path)


def test_the_report_fails_a_resume_that_is_not_the_straight_run(tmp_path):
    straight = [(0, "val", 10.9), (0, "train", 10.95), (1, "train", 10.5), (2, "train", 10.1)]
    a = write_log(tmp_path / "a.txt", straight)
    assert gpu_check_report.compare_resume(a, write_log(tmp_path / "b.txt", straight), 0.0) == ""
    moved = write_log(tmp_path / "c.txt", straight[:3] + [(2, "train", 10.1 + 1e-6)])
    assert gpu_check_report.compare_resume(a, moved, 1e-6 / 2).startswith("max difference")
    assert gpu_check_report.compare_resume(a, moved, 2e-6) == ""
    assert gpu_check_report.compare_resume(a, write_log(tmp_path / "d.txt", straight + [(2, "train", 10.1)]), 1) \
        == "an entry logged twice"
    assert gpu_check_report.compare_resume(a, write_log(tmp_path / "e.txt", straight[:3]), 1).startswith("entries differ")


def test_the_report_holds_each_kind_of_a_resumed_log_to_its_own_tolerance(tmp_path, capsys):
    """On a GPU (no --exact) a loss may move by 1e-3; HellaSwag's acc_norm over N examples moves in steps of 1/N, so
    one example flipped (2e-3 at 500) passes and two do not; each kind plus one unit of its last written decimal."""
    n = 500
    straight = [(0, "val", 10.9), (0, "hella", 0.25), (0, "train", 10.95), (1, "train", 10.5), (1, "val", 10.4),
                (1, "hella", 0.248)]

    def written(entries):  # as train_gpt2.py writes them: losses of train steps to 6 decimals, the rest to 4
        return [(step, kind, f"{value:.6f}" if kind == "train" else f"{value:.4f}") for step, kind, value in entries]

    write_log(tmp_path / "default_resume.straight_log.txt", written(straight))
    (tmp_path / "runs.tsv").write_text("default_resume\t0\t5\n")

    def report(**moved):  # the straight log with step 1's entries moved by {kind: amount}
        resumed = [(step, kind, value + (moved.get(kind, 0.0) if step == 1 else 0.0)) for step, kind, value in straight]
        write_log(tmp_path / "default_resume.resumed_log.txt", written(resumed))
        rc = gpu_check_report.main([str(tmp_path), "--hellaswag_examples", str(n)])
        return rc, capsys.readouterr().out

    rc, out = report(hella=1 / n, train=0.9e-3, val=1e-3)
    assert rc == 0 and "log reads as one run" in out, out
    for moved in (dict(hella=2 / n), dict(train=1.5e-3), dict(val=2e-3)):
        rc, out = report(**moved)
        assert rc == 1 and "FAILED (resume)" in out and f"max difference of {next(iter(moved))}" in out, out


def test_the_report_fails_a_failed_stage(tmp_path, capsys):
    (tmp_path / "runs.tsv").write_text("tests\tskipped: no CUDA\t0\ndefault\t0\t5\n")
    (tmp_path / "default.txt").write_text("summary: 3 steps | median 10.0 ms/step over the last 2 | 1,000 tok/s | "
                                          "peak memory 1.50 GiB | val loss 9\n")
    assert gpu_check_report.main([str(tmp_path)]) == 0
    assert "10.0      1,000      1.50" in capsys.readouterr().out
    (tmp_path / "runs.tsv").write_text("default\t0\t5\nhellaswag\t1\t3\n")
    assert gpu_check_report.main([str(tmp_path)]) == 1
    assert "FAILED (exit 1)" in capsys.readouterr().out
    # side_by_side.sh exits 0 whatever its programs did: a program's rc, or no speed ratio, fails the row
    (tmp_path / "runs.tsv").write_text("side_by_side\t0\t50\n")
    ok = "round 1 build-nanogpt rc=0\nround 1 ours [--batch_size 64] rc=0\n"
    ratio = "round 1: ours [--batch_size 64] 1050.0 ms/step (n=10), speed vs build-nanogpt 1.047x\n"
    (tmp_path / "side_by_side.txt").write_text(ok + ratio)
    assert gpu_check_report.main([str(tmp_path)]) == 0
    assert "[--batch_size 64] 1.047x vs build-nanogpt" in capsys.readouterr().out
    # several variants (the levers): each ratio, named by what it adds to the flags they share
    (tmp_path / "runs.tsv").write_text("levers\t0\t50\n")
    (tmp_path / "levers.txt").write_text(ok + ratio + ratio.replace("[--batch_size 64]", "[--batch_size 64 --fp8]")
                                         .replace("1.047", "1.210"))
    assert gpu_check_report.main([str(tmp_path)]) == 0
    assert "[defaults] 1.047x; [--fp8] 1.210x vs build-nanogpt" in capsys.readouterr().out
    (tmp_path / "runs.tsv").write_text("side_by_side\t0\t50\n")
    for text in (ok.replace("ours [--batch_size 64] rc=0", "ours [--batch_size 64] rc=1") + ratio, ok + ratio.replace(
            "1050.0", "nan").replace("1.047", "nan")):
        (tmp_path / "side_by_side.txt").write_text(text)
        assert gpu_check_report.main([str(tmp_path)]) == 1
        assert "FAILED (programs)" in capsys.readouterr().out


def test_the_report_never_passes_a_call_cut_short(tmp_path, capsys):
    (tmp_path / "default.txt").write_text("")
    for tsv, partial in [("default\t0\t5\n", True),  # written while the call ran: later stages never reported
                         ("default\tcut short at its cap of 240 s\t240\n", False),
                         ("default\tcut short: the check got SIGTERM\t30\n", False),
                         ("default\t0\t5\ncore\tnot run: the call's budget was spent\t0\n", False),
                         ("default\t1\t5\nhellaswag\tcut short at its cap of 9 s\t9\n", False)]:
        (tmp_path / "runs.tsv").write_text(tsv)
        assert gpu_check_report.main([str(tmp_path)] + ["--partial"] * partial) == 3, tsv
        out = capsys.readouterr().out
        assert out.strip().splitlines()[-1].startswith("gpu check: CUT SHORT") and "passed" not in out, out
        assert ("FAILED" in out) == ("default\t1" in tsv), out
