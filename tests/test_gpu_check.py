"""bench/gpu_check.sh, the one prepared run of every path on a GPU, kept from rotting while no GPU is at hand:
its dry run (every stage at a tiny shape on the CPU, CUDA-only stages skipped) passes here, and its report
fails a run whose resumed log is not the straight run's, or whose stage failed."""

import os
import subprocess
import sys
import tarfile

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import gpu_check_report  # noqa: E402
from conftest import ROOT, make_shards  # noqa: E402

STAGES = ["default", "default_resume", "torchrun_plain", "torchrun_zero", "torchrun_fsdp", "torchrun_recompute", "modern",
          "modern_resume", "speedrun", "speedrun_resume", "hellaswag", "core", "generate", "generate_int8", "export_hf",
          "sampling_speed"]


@pytest.mark.slow
def test_the_dry_run_runs_every_stage(tmp_path):
    data = make_shards(str(tmp_path / "data"), val_tokens=8192, train_tokens=(20000, 20000))
    out = tmp_path / "out"
    env = dict(os.environ, DRY_RUN="1", OUT=str(out), BENCH_DATA=data, PY=sys.executable, OMP_NUM_THREADS="1",
               TMPDIR=str(tmp_path), PYTHONPATH=ROOT)
    result = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh")], cwd=str(tmp_path), env=env,
                            capture_output=True, text=True, timeout=900)
    summary = (out / "summary.txt").read_text()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    rows = {line.split()[0]: line for line in summary.splitlines()[1:] if line.split() and line.split()[0] in STAGES + ["tests"]}
    assert set(STAGES) <= rows.keys(), summary
    assert all(" ok " in rows[name] for name in STAGES), summary
    assert "skipped: no CUDA" in rows["tests"] if not torch.cuda.is_available() else " ok " in rows["tests"]
    for name in ("default_resume", "modern_resume", "speedrun_resume"):
        assert "log reads as one run (within 0)" in rows[name], rows[name]
    assert summary.strip().endswith("gpu check: passed")
    with tarfile.open(out / "logs.tar.gz") as logs:  # the logs travel as one file; the working folder is gone
        assert "logs/default.txt" in logs.getnames()
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "summary.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("gpu_check.")]


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


def test_the_report_fails_a_failed_stage(tmp_path, capsys):
    (tmp_path / "runs.tsv").write_text("tests\tskipped: no CUDA\t0\ndefault\t0\t5\n")
    (tmp_path / "default.txt").write_text("summary: 3 steps | median 10.0 ms/step over the last 2 | 1,000 tok/s | "
                                          "peak memory 1.50 GiB | val loss 9\n")
    assert gpu_check_report.main([str(tmp_path)]) == 0
    assert "10.0      1,000      1.50" in capsys.readouterr().out
    (tmp_path / "runs.tsv").write_text("default\t0\t5\nhellaswag\t1\t3\n")
    assert gpu_check_report.main([str(tmp_path)]) == 1
    assert "FAILED (exit 1)" in capsys.readouterr().out
