"""Settings a run cannot keep to are said at its start, one line each after the header, and the run goes on: a warm-up as
long as the run or longer (the learning rate's, Muon's momentum's, the batch's), and a validation that asks for more
tokens than the val split holds (checked against what validation then computes).

    python -m pytest -q tests/test_start_warnings.py
"""

import pytest

from conftest import make_shards, read_log, train

STEPS = ["--max_steps", "3", "--eval_every", "0", "--save_every", "0"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    pass


def warnings_of(capsys):
    """The warnings a run said: after its header, on stdout; nothing on stderr."""
    out, err = capsys.readouterr()
    assert "warning" not in err, err
    return [line for line in out.splitlines() if line.startswith("warning: ")]


@pytest.mark.parametrize("flags, said", [
    (["--warmup_steps", "3"], "--warmup_steps 3 is not shorter than the 3-step run: the learning rate is still "
                              "warming up when it ends, and never comes down"),
    (["--warmup_steps", "7"], "--warmup_steps 7 is not shorter than the 3-step run"),
    (["--warmup_steps", "2"], "--warmup_steps 2 covers half or more of the 3-step run"),
    (["--warmup_steps", "0", "--optimizer", "muon", "--muon_momentum_warmup", "3"],
     "--muon_momentum_warmup 3 is not shorter than the 3-step run: Muon's momentum is still climbing to 0.95"),
    (["--warmup_steps", "0", "--batch_size_warmup_tokens", "768"],  # 3 steps of at most 256 tokens
     "--batch_size_warmup_tokens 768 is more than the run's 3 steps of at most 256 tokens: the batch is still growing"),
])
def test_a_warm_up_the_run_does_not_finish_is_said_in_one_line(shards, tmp_path, capsys, flags, said):
    train(shards, str(tmp_path / "log"), *STEPS, *flags)
    lines = warnings_of(capsys)
    assert len(lines) == 1 and said in lines[0], lines
    assert sorted(read_log(str(tmp_path / "log"))["train"]) == [0, 1, 2]  # a warning: the run went on


@pytest.mark.parametrize("flags", [["--warmup_steps", "1"], ["--warmup_steps", "0"],
                                   ["--warmup_steps", "1", "--optimizer", "muon", "--muon_momentum_warmup", "2"],
                                   ["--warmup_steps", "1", "--batch_size_warmup_tokens", "512"]])
def test_warm_ups_the_run_finishes_are_not_warned_about(shards, tmp_path, capsys, flags):
    train(shards, str(tmp_path / "log"), *STEPS, *flags)
    assert warnings_of(capsys) == []


def test_a_validation_larger_than_the_val_split_is_said_and_reads_its_batches_again(tmp_path, capsys):
    """A val split of 200 tokens holds one batch of 4 x 32 (+1) tokens: --val_steps 2 reads it twice, which the
    warning says, and the loss it logs is the loss of --val_steps 1 (the same batch, counted twice)."""
    data = make_shards(str(tmp_path / "data"), val_tokens=200)
    common = ["--max_steps", "1", "--warmup_steps", "0", "--eval_every", "1", "--save_every", "0"]
    train(data, str(tmp_path / "two"), *common, "--val_steps", "2")
    lines = warnings_of(capsys)
    assert lines == ["warning: validation reads 256 tokens (2 val_steps x 4 x 32 x 1 ranks), but the val split holds "
                     "200 (1 such batches): its last 1 batch(es) read the first again; give --val_steps 1, or make a "
                     "larger val split"]
    train(data, str(tmp_path / "one"), *common, "--val_steps", "1")
    assert warnings_of(capsys) == []
    assert read_log(str(tmp_path / "two"))["val"] == read_log(str(tmp_path / "one"))["val"]
    make_shards(str(tmp_path / "enough"), val_tokens=257)  # two batches of 128 tokens and the last target
    train(str(tmp_path / "enough"), str(tmp_path / "fits"), *common, "--val_steps", "2")
    assert warnings_of(capsys) == []
