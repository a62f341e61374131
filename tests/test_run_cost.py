"""The cost of a recipe, from its log: a run writes its parameters and each step's time beside build-nanogpt's lines,
and whether its validation text is FineWeb-Edu's (from the shards' manifest.json); plot_log.py's legend gives each
run's parameters and time per step, `--x time` lines runs up by the time spent in training steps, and OpenAI GPT-2's
FineWeb-Edu validation loss is drawn only on runs whose log says FineWeb-Edu. Each is checked against another source:
transformers' parameter count, the console's step lines and summary, the log parsed here.

    python -m pytest -q tests/test_run_cost.py
"""

import json
import os
import re

import pytest

import plot_log
from conftest import assert_one_line_error, make_shards, run_script, train
from nanogpt.cli import UserError
from nanogpt.shard_manifest import says_fineweb_edu

RUN = ["--max_steps", "6", "--eval_every", "5", "--save_every", "0", "--warmup_steps", "1"]
GPT2_LINE = "OpenAI GPT-2 (124M) val loss"


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    pass


def log_lines(log_dir, kind):
    """[(step, value as written)] of one kind of log.txt's lines, parsed here."""
    with open(os.path.join(log_dir, "log.txt")) as f:
        return [(int(step), value) for step, k, value in (line.split() for line in f) if k == kind]


def fineweb_edu_manifest(data_dir):
    """A manifest.json as fineweb.py writes it for the hub's FineWeb-Edu, beside data_dir's shards."""
    with open(os.path.join(data_dir, "manifest.json"), "w") as f:
        json.dump({"source": "HuggingFaceFW/fineweb-edu sample-10BT (train)", "tokenizer": "gpt2", "shard_size": 100,
                   "prefix": "test", "args": {"shard_size": 100, "prefix": "test", "text_field": "text",
                                              "dataset": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT",
                                              "split": "train"},
                   "shards": [], "complete": True}, f)


def test_a_run_logs_its_parameters_and_each_steps_time(shards, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel  # TINY_FLAGS' model, counted by another program

    log_dir = str(tmp_path / "log")
    train(shards, log_dir, *RUN, "--save_every", "3")
    out = capsys.readouterr().out
    params = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50304))
    assert log_lines(log_dir, "params") == [(0, str(params.num_parameters()))]
    assert f"| {params.num_parameters():,} parameters" in out  # the header's count
    assert log_lines(log_dir, "val_fineweb_edu") == [(0, "0")]  # test shards: no manifest.json
    shown = {int(s): float(ms) for s, ms in re.findall(r"step\s+(\d+)/6 \|.*\| dt ([\d.]+)ms", out)}
    logged = {step: float(ms) for step, ms in log_lines(log_dir, "step_ms")}
    assert sorted(logged) == list(range(6)) and logged.keys() == shown.keys()
    assert all(abs(logged[s] - shown[s]) <= 0.05 + 0.005 for s in logged)  # 1 and 2 decimals of the same dt
    # a resumed run continues the step times; its parameters and data are said once, at the run's start
    os.remove(os.path.join(log_dir, "model_00005.pt"))
    train(shards, log_dir, *RUN, "--save_every", "3", "--resume")
    assert [s for s, _ in log_lines(log_dir, "step_ms")] == list(range(6))
    assert len(log_lines(log_dir, "params")) == len(log_lines(log_dir, "val_fineweb_edu")) == 1


def test_which_manifests_say_fineweb_edu(tmp_path):
    data = make_shards(str(tmp_path / "edu"))
    assert not says_fineweb_edu(data)  # no manifest
    fineweb_edu_manifest(data)
    assert says_fineweb_edu(data)
    for other in ({"source": "hub: someone/fineweb-edu-shards", "shards": []},  # --download: content unknown
                  {"source": "local files: a.txt", "args": {"inputs": []}},
                  {"source": "HuggingFaceFW/fineweb sample-10BT (train)", "args": {"dataset": "HuggingFaceFW/fineweb"}}):
        with open(os.path.join(data, "manifest.json"), "w") as f:
            json.dump(other, f)
        assert not says_fineweb_edu(data), other
    with open(os.path.join(data, "manifest.json"), "w") as f:
        f.write("{not json")
    assert not says_fineweb_edu(data)


def test_a_run_on_fineweb_edu_gets_gpt2s_reference_line_and_others_do_not(tmp_path, capsys):
    """The same run on shards whose manifest says FineWeb-Edu, and on shards without one: the GPT-2 line is drawn for
    the first only."""
    edu, other = make_shards(str(tmp_path / "edu")), make_shards(str(tmp_path / "other"))
    fineweb_edu_manifest(edu)
    for data in (edu, other):
        train(data, str(tmp_path / "runs" / os.path.basename(data)), *RUN)
    assert log_lines(str(tmp_path / "runs" / "edu"), "val_fineweb_edu") == [(0, "1")]
    capsys.readouterr()

    def gpt2_lines(logs):
        """The GPT-2 reference lines drawn for these runs, their losses moved to either side of its 3.29 (3.6 down
        to 3.0) so that it lies inside the panel."""
        runs = []
        for log in logs:
            series = plot_log.parse_log(os.path.join(log, "log.txt"))
            for kind in ("train", "val"):
                steps, values = series[kind]
                series[kind] = steps, [3.6 - 0.6 * i / (len(values) - 1) for i in range(len(values))]
            runs.append((os.path.basename(log) if len(logs) > 1 else None, series, None))
        fig = plot_log.build_comparison(runs)
        return [label for label in plot_log.plotted(fig)["loss"] if label.startswith(GPT2_LINE)]

    runs = str(tmp_path / "runs")
    edu_log, other_log = os.path.join(runs, "edu"), os.path.join(runs, "other")
    assert gpt2_lines([edu_log]) == [f"{GPT2_LINE} 3.2924"]
    assert gpt2_lines([other_log]) == []
    assert gpt2_lines([edu_log, other_log]) == [f"{GPT2_LINE} 3.2924 (FineWeb-Edu val: edu)"]
    # a log from before the line was written: no reference line, and a note that says why
    old = tmp_path / "old"
    old.mkdir()
    with open(os.path.join(edu_log, "log.txt")) as f, open(old / "log.txt", "w") as g:
        g.writelines(line for line in f if "val_fineweb_edu" not in line)
    plot_log.main([str(old), "--out", str(tmp_path / "old.png")])
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "does not say whether its validation text is FineWeb-Edu's" in note[0]


def test_the_legend_gives_each_runs_parameters_and_time_per_step(shards, tmp_path, capsys, monkeypatch):
    """The run's summary line (median ms/step, from the console's own timings) and header (parameters) against what
    the plot's legend reads from the log alone."""
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, *RUN)
    out = capsys.readouterr().out
    median = float(re.search(r"median ([\d.]+) ms/step", out).group(1))
    params = int(re.search(r"\| ([\d,]+) parameters", out).group(1).replace(",", ""))
    series = plot_log.parse_log(os.path.join(log_dir, "log.txt"))
    fig = plot_log.build_comparison([("log", series, None)])
    labels = list(plot_log.plotted(fig)["loss"])
    described = [label for label in labels if label.startswith("log:") and " | " in label]
    assert len(described) == 1, labels  # once a run and panel
    facts = re.fullmatch(r".* \| ([\d.]+)M parameters, ([\d,]+) ms/step", described[0])
    assert float(facts.group(1)) == round(params / 1e6, 1)
    assert abs(float(facts.group(2).replace(",", "")) - median) <= 1  # rounded to a whole ms, from 0.1 ms in the log


def test_x_time_lines_runs_up_by_the_time_spent_in_training_steps(tmp_path, monkeypatch):
    """Each point at the sum of the step times logged before its step (the loss at step s is logged after step s
    trained; its x is the time before step s, as --x tokens puts the tokens before it), in a unit that suits the
    longest run."""
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    for folder, ms in ((fast, 1500.0), (slow, 4 * 60_000.0)):  # 1.5 s and 4 minutes a step
        folder.mkdir()
        (folder / "log.txt").write_text("0 params 1000000\n" + "".join(
            f"{s} train {10 - s}\n{s} step_ms {ms}\n" for s in range(4)) + "3 val 6.5\n")
    figures = []
    build = plot_log.build_comparison
    monkeypatch.setattr(plot_log, "build_comparison", lambda *a, **kw: figures.append(build(*a, **kw)) or figures[-1])
    plot_log.main([str(fast), str(slow), "--x", "time", "--out", str(tmp_path / "t.png")])
    drawn = plot_log.plotted(figures[0])["loss"]
    assert figures[0].axes[0].get_xlabel() == "time in training steps (minutes)"  # the longest: 16 minutes
    before = {"fast": [0, 1.5, 3.0, 4.5], "slow": [0, 240.0, 480.0, 720.0]}  # seconds before steps 0-3, summed here
    for run in ("fast", "slow"):
        train = next(v for k, v in drawn.items() if k.startswith(f"{run}: train loss"))
        assert train[0] == pytest.approx([s / 60 for s in before[run]]) and train[1] == [10, 9, 8, 7]
        val = next(v for k, v in drawn.items() if k.startswith(f"{run}: val loss"))
        assert val[0] == pytest.approx([before[run][3] / 60])
    # a log that lacks a trained step's time (one from before they were logged, or resumed from one) is refused
    (fast / "log.txt").write_text("0 train 10\n1 train 9\n1 step_ms 100\n")
    assert_one_line_error(run_script(["plot_log.py", str(fast), "--x", "time", "--out", str(tmp_path / "u.png")]),
                          f"{fast}/log.txt: its log holds no time for step 0", "--x step")
    (fast / "log.txt").write_text("0 train 10\n0 val 10.5\n")
    with pytest.raises(UserError, match="holds no time for step 0"):
        plot_log.main([str(fast), "--x", "time", "--out", str(tmp_path / "u.png")])
    assert not (tmp_path / "u.png").exists()


def test_a_log_of_a_run_that_has_only_started_is_refused_in_one_line(tmp_path):
    (tmp_path / "log.txt").write_text("0 params 1636224\n0 val_fineweb_edu 0\n")
    assert_one_line_error(run_script(["plot_log.py", str(tmp_path / "log.txt")]), "holds no loss yet")
    assert os.listdir(tmp_path) == ["log.txt"]
