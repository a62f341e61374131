"""The matrices' optimizers as a table (nanogpt.optimizers.MATRIX_OPTIMIZERS): an entry added to it, and nothing
else, trains, checkpoints, resumes exactly, shows its rate, is refused where its entry says it cannot go, and is
counted by the memory estimate. The stand-in is torch's SGD with momentum (one buffer a parameter), a reference
that shares no code with Muon.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_optimizer_table.py
"""

import os

import pytest
import torch

import train_gpt2
from conftest import (TINY_FLAGS, assert_cli_error, make_shards, numbers_logged, read_log, script_cli,
                      straight_and_resumed)
from nanogpt import arguments, optimizers
from nanogpt.checkpoints import find_checkpoints, load_checkpoint
from nanogpt.optimizers import MatrixOptimizer, OptimizerSettings, parameters_by_role


def make_sgd(groups, rate, settings, process_group):
    return torch.optim.SGD(groups, lr=rate, momentum=0.9), None


SGD = MatrixOptimizer(make_sgd, "SGD", state_bytes=4, shardable=False, fp16=False, about="sgd: SGD with momentum")


@pytest.fixture
def sgd_entry(monkeypatch):
    monkeypatch.setitem(optimizers.MATRIX_OPTIMIZERS, "sgd", SGD)


def test_a_new_entry_trains_checkpoints_and_resumes_exactly(sgd_entry, tmp_path, capsys):
    runs = straight_and_resumed(tmp_path, ["--optimizer", "sgd"])
    assert numbers_logged(runs["straight"]) == numbers_logged(runs["resumed"])
    ckpt = load_checkpoint(find_checkpoints(runs["straight"])[0])
    assert set(ckpt["optimizer"]) == {"sgd", "adamw"}
    assert all("momentum_buffer" in s for s in ckpt["optimizer"]["sgd"]["state"].values())
    # the matrices' rate is on the step line beside AdamW's
    assert " | sgd lr " in capsys.readouterr().out
    # SGD, not AdamW, updated the matrices: the same run with --optimizer adamw logs other losses
    adamw = str(tmp_path / "adamw")
    train_gpt2.main([*["adamw" if flag == "sgd" else flag for flag in runs["flags"]], "--log_dir", adamw])
    assert read_log(adamw)["train"] != read_log(runs["straight"])["train"]


def test_the_matrices_go_to_the_new_entry_and_the_rest_to_adamw(sgd_entry):
    torch.manual_seed(0)
    model = train_gpt2.make_gpt(train_gpt2.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    optimizer = model.configure_optimizers(OptimizerSettings("sgd", 1e-3, 0.1), "cpu")
    matrices = parameters_by_role(model)["matrix"]
    assert isinstance(optimizer.matrices, torch.optim.SGD)
    assert [id(p) for p in optimizer.matrices.param_groups[0]["params"]] == [id(p) for p in matrices]
    adamw = {id(p) for g in optimizer.adamw.param_groups for p in g["params"]}
    assert adamw == {id(p) for p in model.parameters()} - {id(p) for p in matrices}


@pytest.mark.parametrize("extra, needles", [
    (["--zero", "1"], ["--optimizer sgd trains with DDP only, not --zero 1"]),
    (["--dtype", "fp16"], ["--optimizer sgd trains in bf16 or fp32"]),
    (["--muon_lr", "0.02"], ["--muon_lr does nothing with --optimizer sgd", "add --optimizer muon"]),
])
def test_the_entry_says_where_it_cannot_go(sgd_entry, tmp_path, capsys, extra, needles):
    data = make_shards(str(tmp_path / "data"))
    assert_cli_error(script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--optimizer", "sgd", *extra, "--data_dir", data,
                                "--log_dir", tmp_path / "log", "--max_steps", "1"), *needles)
    assert not os.path.exists(tmp_path / "log" / "log.txt")


def test_the_memory_estimate_counts_the_entrys_state(sgd_entry):
    """The entry's state bytes per parameter replace AdamW's 8 for the matrices and nothing else changes: the
    difference is (8 - 4) bytes times the matrices' parameters, counted from the model (parameters_by_role)."""
    config = train_gpt2.GPTConfig(block_size=32, vocab_size=512, n_layer=2, n_head=2, n_embd=32)
    with torch.device("meta"):
        model = train_gpt2.make_gpt(config)
    params, matrices = arguments.counted_parameters(model), sum(p.numel() for p in parameters_by_role(model)["matrix"])
    adamw = arguments.peak_bytes_by_moment(config, params, 2, 32, "fp32", "adamw")
    sgd = arguments.peak_bytes_by_moment(config, params, 2, 32, "fp32", "sgd")
    assert adamw.keys() == sgd.keys()
    assert all(adamw[k] - sgd[k] == (8 - SGD.state_bytes) * matrices for k in adamw)
