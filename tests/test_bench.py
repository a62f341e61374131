"""bench/: the paths a benchmark hands to the programs it runs in another folder."""

import importlib.util
import os

from conftest import ROOT, make_shards, read_log


def load_bench(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_train_step_hands_a_relative_data_dir_to_the_trainer_it_runs_elsewhere(tmp_path, monkeypatch):
    """docs/speed.md's `--data_dir ../shared/bench_data`, relative to where it is typed: our train_gpt2.py, run
    in the benchmark's temporary folder with the flags the benchmark gives it, trains on those shards."""
    import train_gpt2

    bench = load_bench("bench_train_step")
    make_shards(str(tmp_path / "shared" / "bench_data"))
    (tmp_path / "project").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    args = bench.parse_args(["--data_dir", "../shared/bench_data", "--steps", "1", "--dtype", "fp32"])
    work = tmp_path / "tmp" / "bench_step_1"  # a folder where ../shared/bench_data is nothing
    work.mkdir(parents=True)
    monkeypatch.chdir(work)  # where the benchmark runs its programs
    train_gpt2.main(bench.train_flags(args, str(work)))
    assert 0 in read_log(str(work / "ourlog"))["train"]
