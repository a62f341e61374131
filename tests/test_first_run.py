"""Setup in two commands: on a fresh clone (no data folder yet), `python train_gpt2.py --model tiny` makes
the shards of the text the repository ships, with fineweb.py as the README's quick start does, and trains.

    python -m pytest -q tests/test_first_run.py
"""

import filecmp
import os
import shutil

import pytest

from conftest import ROOT, read_log, run_script

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
pytestmark = pytest.mark.slow


def fresh_clone(dest):
    """The repository's code and its shipped text, without any data folder or log made here."""
    os.makedirs(dest / "data")
    for name in os.listdir(ROOT):
        path = os.path.join(ROOT, name)
        if name.endswith(".py"):
            shutil.copy(path, dest)
        elif os.path.isfile(os.path.join(path, "__init__.py")):  # the package
            shutil.copytree(path, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "data", "austen.txt"), dest / "data")
    return dest


def test_model_tiny_trains_on_the_shipped_text_when_there_is_no_data_folder(tmp_path):
    clone = fresh_clone(tmp_path / "clone")
    run = ["train_gpt2.py", "--model", "tiny", "--max_steps", "1", "--eval_every", "0", "--sample_every", "0",
           "--log_dir", str(tmp_path / "log")]
    first = run_script(run, cwd=str(clone), env={"PYTHONPATH": str(clone)})
    assert first.returncode == 0, first.stderr[-3000:]
    assert "note: no edu_fineweb10B/ here: --model tiny trains on data/austen.txt's shards in data/tiny/" in first.stdout
    assert sorted(read_log(str(tmp_path / "log"))["train"]) == [0]

    # the shards are the README quick start's, byte for byte
    readme = run_script(["fineweb.py", "--input", "data/austen.txt", "--output_dir", str(tmp_path / "readme"),
                         "--shard_size", "1e5"], cwd=str(clone), env={"PYTHONPATH": str(clone)})
    assert readme.returncode == 0, readme.stderr
    shards = sorted(n for n in os.listdir(tmp_path / "readme") if n.endswith(".bin"))
    assert len(shards) == 5 and sorted(n for n in os.listdir(clone / "data" / "tiny") if n.endswith(".bin")) == shards
    assert all(filecmp.cmp(clone / "data" / "tiny" / n, tmp_path / "readme" / n, shallow=False) for n in shards)

    # the second run finds them: nothing is made again
    again = run_script([*run, "--overwrite"], cwd=str(clone), env={"PYTHONPATH": str(clone)})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "making" not in again.stdout


def test_a_data_folder_given_or_present_is_used_as_always(tmp_path):
    clone = fresh_clone(tmp_path / "clone")
    result = run_script(["train_gpt2.py", "--model", "tiny", "--data_dir", "mine", "--log_dir", str(tmp_path / "log")],
                        cwd=str(clone), env={"PYTHONPATH": str(clone)})
    assert result.returncode == 2 and "no train shards" in result.stderr and "'mine'" in result.stderr
    assert not os.path.exists(clone / "data" / "tiny")
