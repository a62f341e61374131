"""--zero 1, --fsdp, --recompute and several machines, on CPU with gloo (2 processes under torchrun).

How close is close enough: the reference is one process with the same total batch. Plain 2-process
DDP differs from it only by float rounding (the same sums in another order), so the DDP-vs-one
distance of the last weights is the noise scale (~3e-6 after 6 AdamW steps); a mode passes if its
weights are within 4x that, its losses within the log's rounding and fp32's reordering noise, and its logged gradient norms
(before clipping) within their 4 printed decimals. A gradient summed over the ranks instead of
averaged is 2x too large: clipping caps it and AdamW divides its scale out, so over a few steps it
barely moves losses and weights, but the logged norm doubles. test_the_tolerance_catches_a_doubled_gradient
checks that the comparison sees it.

    python -m pytest -q tests/test_scale.py
"""

import contextlib
import copy
import io
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import generate_tokens
import hellaswag
import train_gpt2
from conftest import (ROOT, TINY_FLAGS, assert_one_line_error, assert_same_norms, load_weights, make_shards,
                      max_weight_diff, numbers_logged, read_log, run_script, step_norms, torchrun, write_hellaswag)

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
# one worker under -n 2 (conftest.py): the module's fixtures are made once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_scale")]

RUN = ["--max_steps", "6", "--eval_every", "3", "--save_every", "3", "--total_batch_size", "512"]  # checkpoints after steps 2 and 5
STATE_RE = re.compile(r"optimizer state per rank: (.*)")


def state_bytes_per_rank(stdout):
    return [int(b.replace(",", "").split()[0]) for b in STATE_RE.search(stdout).group(1).split(", ")]


def one_process(data, log_dir, *extra):
    """train_gpt2.main in this process: its stdout. --val_steps counts per rank: 4 here = 2 x 2 ranks."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_gpt2.main([*TINY_FLAGS, "--data_dir", data, *RUN, "--val_steps", "4", "--log_dir", log_dir, *extra])
    return out.getvalue()


def two_processes(data, log_dir, *extra):
    result = torchrun(2, *TINY_FLAGS, "--data_dir", data, *RUN, "--log_dir", log_dir, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def copy_run(src, dst, step):
    """A run dir holding src's checkpoint of `step` and its log: as if src had died after that step."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, f"model_{step:05d}.pt"), dst)
    shutil.copy(os.path.join(src, "log.txt"), dst)
    return dst


def weights(log_dir, step=5):
    return load_weights(os.path.join(log_dir, f"model_{step:05d}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The straight runs, once for the module: one process, plain DDP, --zero 1 and --fsdp."""
    tmp = tmp_path_factory.mktemp("scale")
    data = make_shards(str(tmp / "data"))
    r = {"tmp": tmp, "data": data, "out": {}}
    r["out"]["one"] = one_process(data, str(tmp / "one"))
    for name, extra in (("ddp", []), ("zero", ["--zero", "1"]), ("fsdp", ["--fsdp"])):
        r["out"][name] = two_processes(data, str(tmp / name), *extra)
    # the noise scale: the same training as one process and as DDP, rounded differently
    r["noise"] = max_weight_diff(weights(str(tmp / "one")), weights(str(tmp / "ddp")))
    assert 0 < r["noise"] < 1e-4, r["noise"]
    return r


def assert_same_optimizer_state(got, want):
    """Two AdamW.state_dict()s hold the same groups and the same state entries in the same order, their
    tensors equal bit for bit."""
    assert got["param_groups"] == want["param_groups"]
    assert list(got["state"]) == list(want["state"]), (list(got["state"]), list(want["state"]))
    for i, state in want["state"].items():
        assert list(got["state"][i]) == list(state), (i, list(got["state"][i]), list(state))
        for name, value in state.items():
            mine = got["state"][i][name]
            if torch.is_tensor(value):
                assert torch.is_tensor(mine) and mine.dtype == value.dtype and torch.equal(mine, value), (i, name)
            else:
                assert mine == value, (i, name, mine, value)


def assert_same_run(r, log_dir, stdout=None, reference="one"):
    """log_dir's run equals the reference run up to float rounding: train losses (6 decimals), val
    losses (4 decimals), gradient norms (4 decimals) and the last weights within 4x the noise."""
    ref_dir = str(r["tmp"] / reference)
    a, b = read_log(ref_dir), read_log(log_dir)
    assert a["train"].keys() == b["train"].keys() and a["val"].keys() == b["val"].keys()
    # 2 units of the last printed decimal; the 1e-9 is the float error of a difference of two
    # decimals (10.116911 - 10.116909 is 2.0000000003e-06)
    for s in a["train"]:
        # two values printed to 6 decimals (1e-6 of rounding), and the fp32 mean of the same per-token losses
        # summed in another order (across ranks, then averaged): a few ulps of the loss per halving of the sum
        tol = 1e-6 + 16 * 2**-24 * abs(a["train"][s])
        assert abs(a["train"][s] - b["train"][s]) <= tol, ("train", s, a["train"][s], b["train"][s])
    for s in a["val"]:
        assert abs(a["val"][s] - b["val"][s]) <= 2e-4 + 1e-9, ("val", s, a["val"][s], b["val"][s])
    if stdout is not None:
        assert_same_norms(r["out"][reference], stdout, step_norms(stdout))
    diff = max_weight_diff(weights(ref_dir), weights(log_dir))
    assert diff <= 4 * r["noise"], ("weights", diff, r["noise"])


def test_zero1_and_fsdp_match_ddp_and_one_process(runs):
    for name in ("ddp", "zero", "fsdp"):
        assert_same_run(runs, str(runs["tmp"] / name), runs["out"][name])
    # ZeRO-1 runs AdamW's own per-parameter update on the owning rank with DDP's averaged gradients:
    # the same float operations as DDP, bit for bit
    assert max_weight_diff(weights(str(runs["tmp"] / "ddp")), weights(str(runs["tmp"] / "zero"))) == 0
    # and so is its AdamW state, which the checkpoint stores in the plain layout
    ddp_ckpt, zero_ckpt = (torch.load(os.path.join(str(runs["tmp"] / name), "model_00005.pt"), weights_only=True)
                           for name in ("ddp", "zero"))
    assert_same_optimizer_state(zero_ckpt["optimizer"], ddp_ckpt["optimizer"])
    assert runs["out"]["fsdp"].count("step     5/6 | loss") == 1  # rank 0 alone prints


@pytest.mark.parametrize("extra", [["--embed_lr", "0.3", "--head_lr", "1e-4", "--scalar_lr", "0.05"],
                                   ["--recipe", "speedrun", "--optimizer", "adamw"]], ids=["gpt2-rates-by-role", "speedrun-adamw"])
def test_zero1_keeps_the_rates_by_role(tmp_path, extra):
    """Each AdamW group's rate (its "lr_scale" times the scheduled rate) holds under --zero 1, for GPT-2 with rates
    by role and for the speedrun recipe: the groups it saves are one process's, and its weights and optimizer state
    are DDP's bit for bit (the same averaged gradients, each parameter's update made on one rank; DDP against one
    process is test_zero1_and_fsdp_match_ddp_and_one_process's). A group stepped at --max_lr instead (3e-3 against
    an embedding rate of 0.3 here) leaves other weights. --fsdp builds its groups on the sharded model: the same
    groups, and weights within 4x the one-process-to-DDP rounding distance."""
    data = make_shards(str(tmp_path / "data"))
    one_process(data, str(tmp_path / "one"), *extra)
    for name, more in (("ddp", []), ("zero", ["--zero", "1"]), ("fsdp", ["--fsdp"])):
        two_processes(data, str(tmp_path / name), *extra, *more)
    one_ckpt, ddp_ckpt, zero_ckpt, fsdp_ckpt = (
        torch.load(os.path.join(str(tmp_path / name), "model_00005.pt"), weights_only=True)
        for name in ("one", "ddp", "zero", "fsdp"))
    assert len({g["lr_scale"] for g in one_ckpt["optimizer"]["param_groups"]}) > 1  # the rates do differ by role
    for ckpt in (zero_ckpt, fsdp_ckpt):
        assert ckpt["optimizer"]["param_groups"] == one_ckpt["optimizer"]["param_groups"]
    assert max_weight_diff(ddp_ckpt["model"], zero_ckpt["model"]) == 0
    noise = max_weight_diff(one_ckpt["model"], ddp_ckpt["model"])
    assert max_weight_diff(ddp_ckpt["model"], fsdp_ckpt["model"]) <= 4 * noise, noise
    assert_same_optimizer_state(zero_ckpt["optimizer"], ddp_ckpt["optimizer"])


def test_the_tolerance_catches_a_doubled_gradient(runs, monkeypatch):
    """What a sum-instead-of-average bug looks like: the same run with every gradient doubled."""
    clip_grad_norm = train_gpt2.clip_grad_norm  # the loop's first use of the accumulated gradients

    def doubled(model, max_norm):
        for p in model.parameters():
            p.grad *= 2
        return clip_grad_norm(model, max_norm)

    monkeypatch.setattr(train_gpt2, "clip_grad_norm", doubled)
    log_dir = str(runs["tmp"] / "doubled")
    out = one_process(runs["data"], log_dir)
    with pytest.raises(AssertionError):
        assert_same_run(runs, log_dir, out)
    # step 0: the same weights, twice the gradient
    assert abs(step_norms(out)[0] - 2 * step_norms(runs["out"]["one"])[0]) < 1e-3


def test_optimizer_state_per_rank(runs):
    """Sum of the optimizer state's tensor sizes on each rank, as the runs print it."""
    plain = sum(v.numel() * v.element_size() for s in torch.load(os.path.join(str(runs["tmp"] / "one"), "model_00005.pt"),
                                                                 weights_only=True)["optimizer"]["state"].values() for v in s.values())
    ddp, zero, fsdp = (state_bytes_per_rank(runs["out"][n]) for n in ("ddp", "zero", "fsdp"))
    assert ddp == [plain, plain]
    assert sum(zero) == plain and max(zero) < plain  # each parameter's state on one rank (whole tensors: uneven here)
    n_tensors = 2 + 2 * 12 + 2  # wte (= lm_head), wpe; 12 in each of 2 Blocks; ln_f
    assert sum(fsdp) == plain + 4 * n_tensors  # halves of every tensor; the 4-byte step count on both ranks
    assert abs(fsdp[0] - fsdp[1]) <= 4 * n_tensors


def test_recompute_is_the_same_run(runs):
    log_dir = str(runs["tmp"] / "recompute")
    one_process(runs["data"], log_dir, "--recompute")
    assert read_log(log_dir) == read_log(str(runs["tmp"] / "one"))
    assert max_weight_diff(weights(str(runs["tmp"] / "one")), weights(log_dir)) == 0  # bit-identical
    assert torch.load(os.path.join(log_dir, "model_00005.pt"), weights_only=True)["args"]["recompute"] is True


def test_zero1_checkpoint_state_is_what_consolidate_state_dict_gives(tmp_path):
    """The AdamW state a --zero 1 checkpoint stores (nanogpt.sharding.gathered_state_dicts: each rank's share
    sent tensor by tensor) is ZeroRedundancyOptimizer's own consolidate_state_dict(to=0) + state_dict()
    of the same optimizer, entry for entry and bit for bit. 3 processes, so that rank 0 receives
    shares from two ranks; the comparison is shown to see a share left out, and two ranks' tensors
    of one shape swapped."""
    out = str(tmp_path / "states.pt")
    result = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                         os.path.join("tests", "zero_state_worker.py"), out], timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(out, weights_only=True)
    streamed, consolidated, owner = saved["streamed"], saved["consolidated"], saved["owner"]
    assert sorted(owner) == sorted(consolidated["state"]) and set(owner.values()) == {0, 1, 2}, owner
    assert_same_optimizer_state(streamed, consolidated)

    missing = copy.deepcopy(streamed)
    for i in [i for i, r in owner.items() if r == 2]:
        del missing["state"][i]
    with pytest.raises(AssertionError):
        assert_same_optimizer_state(missing, consolidated)
    shape = lambda i: streamed["state"][i]["exp_avg"].shape  # noqa: E731
    i, j = next((i, j) for i in owner for j in owner if owner[i] == 1 and owner[j] == 2 and shape(i) == shape(j))
    swapped = copy.deepcopy(streamed)
    swapped["state"][i], swapped["state"][j] = swapped["state"][j], swapped["state"][i]
    with pytest.raises(AssertionError):
        assert_same_optimizer_state(swapped, consolidated)


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_sharded_checkpoints_resume_exactly_and_as_plain_runs(runs, mode):
    tmp, straight = runs["tmp"], str(runs["tmp"] / mode)
    ckpt = torch.load(os.path.join(straight, "model_00005.pt"), weights_only=True)
    plain = torch.load(os.path.join(str(tmp / "one"), "model_00005.pt"), weights_only=True)
    # the plain layout: the same keys, shapes and dtypes, the tied weight stored once, AdamW's groups
    assert [(k, v.shape, v.dtype) for k, v in ckpt["model"].items()] == [(k, v.shape, v.dtype) for k, v in plain["model"].items()]
    assert ckpt["model"]["lm_head.weight"].data_ptr() == ckpt["model"]["transformer.wte.weight"].data_ptr()
    assert ckpt["optimizer"]["param_groups"] == plain["optimizer"]["param_groups"]
    assert ckpt["optimizer"]["state"].keys() == plain["optimizer"]["state"].keys()
    assert ckpt["args"]["zero" if mode == "zero" else "fsdp"] in (1, True)
    # resumed in the same mode (the mode comes from the checkpoint's settings): the straight run's log
    resumed = copy_run(straight, str(tmp / f"{mode}_resumed"), 2)
    out = two_processes(runs["data"], resumed, "--resume")
    assert "resuming from" in out
    assert numbers_logged(resumed) == numbers_logged(straight)
    assert max_weight_diff(weights(straight), weights(resumed)) == 0
    # resumed by one process without torchrun: nothing to shard, a plain run from the same state
    alone = copy_run(straight, str(tmp / f"{mode}_alone"), 2)
    out = one_process(runs["data"], alone, "--resume")
    assert "single process has nothing to shard" in out
    assert_same_run(runs, alone)


def test_sharded_checkpoints_load_in_the_other_scripts(runs, tmp_path, capsys):
    """--fsdp's checkpoint, exported by generate_tokens.py, is the same network in transformers: its
    logits equal those of a GPT built from the checkpoint's tensors, both in float64. The same
    weights, sums in another order: float64 dot products of length <= 128 through ~10 chained layers
    round by < 1e3 * 128 * eps64 = 3e-11 of the logits' scale; the bound is 1e-9, still far below
    float32's rounding, and below what a slip in the export shows (exact GELU for GPT-2's tanh GELU:
    ~5e-6). And the CLI's greedy text is transformers' greedy continuation."""
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    zero_ckpt, fsdp_ckpt = (os.path.join(str(runs["tmp"] / m), "model_00005.pt") for m in ("zero", "fsdp"))
    hf_dir = str(tmp_path / "hf")
    generate_tokens.main(["--checkpoint", fsdp_ckpt, "--export_hf", hf_dir])
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ckpt = torch.load(fsdp_ckpt, map_location="cpu", weights_only=True)
    ours = train_gpt2.GPT(train_gpt2.GPTConfig(**ckpt["config"]))
    ours.load_state_dict(ckpt["model"])
    ours.eval()
    V = hf.config.vocab_size
    idx = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf.double()(idx).logits
        got = ours.double()(idx)[0]
    assert got.shape[:2] == ref.shape[:2] and ref.shape[2] == V == 50257 <= got.shape[2]
    assert (got[..., :V] - ref).abs().max().item() <= 1e-9 * ref.abs().max().item()
    # greedy: transformers' argmax continuation in float64, one full forward per token
    tok = GPT2TokenizerFast.from_pretrained(hf_dir)  # the tokenizer saved with the export, not ours
    seq = tok("Hello", return_tensors="pt").input_ids
    margins = []
    with torch.no_grad():
        for _ in range(8):
            top2 = hf(seq).logits[0, -1].topk(2)
            margins.append((top2.values[0] - top2.values[1]).item())
            seq = torch.cat([seq, top2.indices[:1].view(1, 1)], dim=1)
        # the CLI samples in float32: its logit error (against float64, on these tokens) must be
        # far below every winning margin, so equal text is expected, not luck
        err32 = (ours.float()(seq)[0][0, :, :V].double() - hf(seq).logits[0]).abs().max().item()
    assert min(margins) > 10 * err32, (margins, err32)
    capsys.readouterr()
    generate_tokens.main(["--checkpoint", fsdp_ckpt, "--device", "cpu", "--prompt", "Hello", "--num_samples", "1",
                          "--max_new_tokens", "8", "--temperature", "0", "--no_stop"])
    assert capsys.readouterr().out == "--- sample 1/1 ---\n" + tok.decode(seq[0]) + "\n"
    hs = tmp_path / "hs.jsonl"
    hs.write_text('{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 0}\n')
    assert hellaswag.main(["--checkpoint", zero_ckpt, "--data", str(hs), "--device", "cpu"])["total"] == 1


@pytest.mark.parametrize("mode", [["--zero", "1"], ["--fsdp", "--recompute"]])
def test_a_plain_checkpoint_resumes_sharded(runs, mode):
    """One process's checkpoint continued by 2 processes under --zero 1, and under --fsdp with
    activation checkpointing: the one-process run, up to rounding."""
    log_dir = copy_run(str(runs["tmp"] / "one"), str(runs["tmp"] / f"one_to{mode[0]}"), 2)
    out = two_processes(runs["data"], log_dir, "--resume", "--val_steps", "2", *mode)
    assert f"{mode[0]} changes from" in out
    assert_same_run(runs, log_dir, out)


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_nodes_of_one_process_each(runs):
    """torchrun's multi-node rendezvous on localhost: two 'machines' of one process, one log dir."""
    log_dir = str(runs["tmp"] / "nodes")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    endpoint = f"localhost:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                               "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--nproc_per_node", "1", "train_gpt2.py",
                               *TINY_FLAGS, "--data_dir", runs["data"], *RUN, "--log_dir", log_dir],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outs = [p.communicate(timeout=400) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    writers = [out for out, _ in outs if "saved" in out]
    assert len(writers) == 1  # global rank 0 alone logs and saves (both nodes have a LOCAL_RANK 0)
    assert "world size 2" in writers[0]
    assert_same_run(runs, log_dir, writers[0])


def test_in_loop_hellaswag_scores_alike_in_every_mode(runs, tmp_path):
    """Step 0's HellaSwag (the same initial weights in every mode) from one process, from DDP (ranks
    score disjoint shares) and from --fsdp (every rank scores every example): the same count."""
    hella = write_hellaswag(str(tmp_path / "hellaswag.jsonl"), n=5)
    flags = [*TINY_FLAGS, "--data_dir", runs["data"], "--max_steps", "1", "--eval_every", "0", "--save_every", "0",
             "--hellaswag_every", "1", "--hellaswag_data", hella]
    one = str(tmp_path / "one")
    train_gpt2.main([*flags, "--log_dir", one])
    want = read_log(one)["hella"][0]
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        result = torchrun(2, *flags, "--log_dir", str(tmp_path / name), *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        assert read_log(str(tmp_path / name))["hella"][0] == want, name


def test_zero_and_fsdp_together_are_refused(shards, tmp_path):
    result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"), "--zero", "1", "--fsdp"])
    assert_one_line_error(result, "--zero 1 and --fsdp")
    assert not (tmp_path / "log").exists()
