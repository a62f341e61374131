"""The optimizers as a table (nanogpt.optimizers.MATRIX_OPTIMIZERS): an entry added to it, and nothing else, trains,
checkpoints, resumes exactly, shows its rate, is refused where its entry says it cannot go, and is counted by the
memory estimate. The stand-ins: torch's SGD with momentum (one buffer a parameter) for the matrices, a reference
that shares no code with Muon; and for the whole model an optimizer with modes (tests/averaged_adamw.py: AdamW whose
eval mode puts an average of the weights into the model, as schedule-free's does), which needs a held rate and is
evaluated, sampled and saved with its average, on every rank.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_optimizer_table.py
"""

import dataclasses
import os

import pytest
import torch

import train_gpt2
from averaged_adamw import AveragedAdamW, averaged_entry
from conftest import (ROOT, TINY_FLAGS, assert_cli_error, make_shards, numbers_logged, read_log, run_script,
                      script_cli, straight_and_resumed)
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


# -----------------------------------------------------------------------------
# a whole model's optimizer with modes (tests/averaged_adamw.py), which takes a held rate only

HELD = ["--lr_schedule", "wsd", "--warmdown_frac", "0"]


@pytest.fixture
def averaged(monkeypatch):
    """add(decay, takes="model"): the entry of tests/averaged_adamw.py as --optimizer averaged."""
    def add(decay, takes="model"):
        monkeypatch.setitem(optimizers.MATRIX_OPTIMIZERS, "averaged", dataclasses.replace(averaged_entry(decay),
                                                                                           takes=takes))
    return add


@pytest.mark.parametrize("takes", ["model", "matrices"])
def test_an_optimizer_with_modes_trains_and_resumes_exactly(averaged, tmp_path, takes):
    """Killed after step 3's checkpoint (which holds the average: eval mode) and resumed, the run logs what the
    straight run logs, train and val: the resume goes back to the trained weights, as the straight run did after
    saving. Of the whole model, or of the matrices beside AdamW."""
    averaged(0.5, takes)
    runs = straight_and_resumed(tmp_path, ["--optimizer", "averaged", *HELD])
    assert numbers_logged(runs["straight"]) == numbers_logged(runs["resumed"])
    ckpt = load_checkpoint(find_checkpoints(runs["straight"])[0])
    if takes == "model":  # one optimizer over every parameter, AdamW's and the average's state
        states = ckpt["optimizer"]["state"].values()
        assert len(states) == len(ckpt["model"]) - 1  # (the head is the token embedding's weight: one under two names)
    else:  # the matrices' state under the entry's name, beside AdamW's
        assert set(ckpt["optimizer"]) == {"averaged", "adamw"}
        states = ckpt["optimizer"]["averaged"]["state"].values()
    assert states and all({"exp_avg", "average", "trained"} <= set(s) for s in states)
    train = read_log(runs["straight"])["train"]
    assert train[5] < train[0] - 0.1  # it trains


def test_it_evaluates_samples_and_saves_with_its_other_weights(averaged, tmp_path, monkeypatch):
    """An average that never moves (decay 1) is the initial model: every validation loss is the initial model's (a
    plain AdamW run's at step 0, before its first update), the samples are drawn from it and every checkpoint holds
    it, while the training loss goes down."""
    averaged(1.0)
    data = make_shards(str(tmp_path / "data"))
    flags = [*TINY_FLAGS, *HELD, "--data_dir", data, "--max_steps", "5", "--eval_every", "1", "--save_every", "2"]
    train_gpt2.main([*flags, "--log_dir", str(tmp_path / "adamw"), "--max_steps", "1"])
    initial_val = read_log(str(tmp_path / "adamw"))["val"][0]
    sampled = []
    monkeypatch.setattr(train_gpt2, "sample_lines", lambda model, *a: sampled.append(
        {k: v.clone() for k, v in model.state_dict().items()}) or [])
    log_dir = str(tmp_path / "averaged")
    train_gpt2.main([*flags, "--optimizer", "averaged", "--sample_every", "2", "--log_dir", log_dir])
    log = read_log(log_dir)
    assert log["val"] == dict.fromkeys(range(5), initial_val)
    assert log["train"][4] < log["train"][0] - 0.1
    checkpoints = [load_checkpoint(path) for path in find_checkpoints(log_dir)]  # after steps 1, 3 and 4
    assert len(checkpoints) == 3 and len(sampled) == 2  # samples at steps 2 and 4
    for weights in [ckpt["model"] for ckpt in checkpoints] + sampled:
        assert all(torch.equal(weights[k], checkpoints[0]["model"][k]) for k in weights)
    trained = [s["trained"] for s in checkpoints[0]["optimizer"]["state"].values()]
    assert not all(torch.equal(t, w) for t, w in zip(trained, checkpoints[0]["model"].values()))


@pytest.mark.parametrize("extra, needles", [
    ([], ["--optimizer averaged trains with a held learning rate only", "cosine",
          "--lr_schedule wsd --warmdown_frac 0"]),
    (["--lr_schedule", "wsd", "--warmdown_frac", "0.5"], ["held learning rate only", "then a straight line"]),
    ([*HELD, "--no_fused_adamw"], ["--no_fused_adamw does nothing with --optimizer averaged"]),
    ([*HELD, "--zero", "1"], ["--optimizer averaged trains with DDP only"]),
])
def test_a_whole_models_entry_is_refused_where_it_says(averaged, tmp_path, capsys, extra, needles):
    averaged(0.5)
    data = make_shards(str(tmp_path / "data"))
    assert_cli_error(script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--optimizer", "averaged", *extra, "--data_dir",
                                data, "--log_dir", tmp_path / "log", "--max_steps", "4"), *needles)
    assert not os.path.exists(tmp_path / "log")


def test_a_held_rate_is_taken_however_it_is_given(averaged, tmp_path):
    """--min_lr_frac 1 holds the cosine's rate too. (No evaluation before the first step: the optimizer, which starts
    in eval mode as schedule-free's does, is put in train mode when it is built.)"""
    averaged(0.5)
    data = make_shards(str(tmp_path / "data"))
    train_gpt2.main([*TINY_FLAGS, "--optimizer", "averaged", "--min_lr_frac", "1", "--data_dir", data, "--log_dir",
                     str(tmp_path / "log"), "--max_steps", "2", "--eval_every", "0"])
    assert sorted(read_log(str(tmp_path / "log"))["train"]) == [0, 1]


def test_every_parameter_goes_to_a_whole_models_entry_in_adamws_groups(averaged):
    averaged(0.5)
    torch.manual_seed(0)
    model = train_gpt2.make_gpt(train_gpt2.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    optimizer = model.configure_optimizers(OptimizerSettings("averaged", 1e-3, 0.1), "cpu")
    reference = model.configure_optimizers(OptimizerSettings("adamw", 1e-3, 0.1), "cpu")
    assert type(optimizer) is AveragedAdamW and type(reference) is torch.optim.AdamW
    assert [[id(p) for p in g["params"]] for g in optimizer.param_groups] == [
        [id(p) for p in g["params"]] for g in reference.param_groups]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_the_memory_estimate_counts_a_whole_models_state_on_every_parameter(averaged):
    averaged(0.5)
    config = train_gpt2.GPTConfig(block_size=32, vocab_size=512, n_layer=2, n_head=2, n_embd=32)
    with torch.device("meta"):
        params = arguments.counted_parameters(train_gpt2.make_gpt(config))
    adamw = arguments.peak_bytes_by_moment(config, params, 2, 32, "fp32", "adamw")
    more = arguments.peak_bytes_by_moment(config, params, 2, 32, "fp32", "averaged")
    assert all(more[k] - adamw[k] == (12 - 8) * params.total for k in adamw)


@pytest.mark.slow
def test_every_rank_evaluates_with_the_other_weights(tmp_path):
    """Under torchrun (2 processes), each rank validates with the average that never moves (decay 1), so the mean
    over the ranks is the initial model's at every step, while training moves the weights; a rank that had not
    switched (the switch put in rank 0's sampling branch, say) would bring its trained weights into the mean."""
    data = make_shards(str(tmp_path / "data"))
    worker = os.path.join(ROOT, "tests", "averaged_adamw.py")
    two = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", worker, *TINY_FLAGS, *HELD,
                      "--optimizer", "averaged", "--data_dir", data, "--max_steps", "4", "--eval_every", "1",
                      "--sample_every", "1", "--save_every", "2", "--log_dir", str(tmp_path / "two")],
                     env={"AVERAGED_DECAY": "1"}, timeout=400)
    assert two.returncode == 0, two.stderr[-3000:]
    log = read_log(str(tmp_path / "two"))
    assert len(log["val"]) == 4 and len(set(log["val"].values())) == 1
    assert log["train"][3] < log["train"][0] - 0.1
