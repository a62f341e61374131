"""Faults a user can cause in train_gpt2.py, each reproduced: bad flags of every kind, checkpoints that
load but are not ours, short and foreign shards, pruning next to a broken checkpoint, a closed
stdout, a bare --resume, an offline --init_from. Each ends in one clear line (or a warning) and
loses nothing already written.

    python -m pytest -q tests/test_faults.py
"""

import dataclasses
import os
import re
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import generate_tokens
import hellaswag
import train_gpt2
from nanogpt import arguments
from nanogpt.arguments import counted_parameters, estimated_bytes
from nanogpt.checkpoints import find_checkpoints, load_checkpoint, save_checkpoint
from nanogpt.shards import write_shard
from nanogpt.tokenizer import get_tokenizer
from conftest import (ROOT, TINY_FLAGS, TINY_RUN_FLAGS, assert_cli_error, assert_one_line_error, make_shards,
                      numbers_logged, read_log, run_script, script_cli, train, truncate_half, write_hellaswag)

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
pytestmark = pytest.mark.slow

HUGE = str(2**63)
# flag -> values that must be refused before any work
BAD_VALUES = {
    **{f: ["0", "-1", HUGE, "nan", "x", ""] for f in ("--batch_size", "--seq_len", "--total_batch_size", "--max_steps", "--val_steps",
                                                     "--max_bad_steps", "--n_layer", "--n_head", "--n_embd", "--hellaswag_limit",
                                                     "--core_max_per_task")},
    **{f: ["-1", HUGE, "1.5", "x", ""] for f in ("--warmup_steps", "--eval_every", "--hellaswag_every", "--core_every",
                                                 "--sample_every", "--save_every", "--keep_checkpoints")},
    "--seed": ["-1", str(2**64), "x"],
    **{f: ["0", "-1", "nan", "inf", "-inf", "1e400", "x", ""] for f in ("--max_lr", "--peak_tflops")},
    **{f: ["-1", "nan", "inf", "x"] for f in ("--weight_decay", "--grad_clip")},
}
for name in ("--max_lr", "--weight_decay"):  # finite, but AdamW's fp32 arithmetic overflows with them
    BAD_VALUES[name] += ["1e39", "3e38", "1001"]
BAD_VALUES |= {
    "--min_lr_frac": ["-0.1", "1.5", "nan", "inf"],
    "--model": ["d13", ""],
    "--dtype": ["fp8", ""],
    "--device": ["tpu", "cuda:x", ""] + ([] if torch.cuda.is_available() else ["cuda"]),
    "--init_from": ["not-a-model", "/nonexistent/dir"],
    "--data_dir": ["/nonexistent/data", ""],
    "--hellaswag_data": ["/nonexistent/hs.jsonl", ""],  # empty ("$UNSET"): not a download, nor HellaSwag off
    "--core_bundle": ["/nonexistent/eval_bundle", ""],  # empty: not a download either
    **{f: [""] for f in ("--log_dir", "--tensorboard", "--wandb", "--wandb_id")},
}
CASES = [(flag, value) for flag, values in BAD_VALUES.items() for value in values]


def run_main(argv):
    """train_gpt2.main in this process: the one-line outcome (UserError text or argparse's exit)."""
    try:
        train_gpt2.main(argv)
    except train_gpt2.UserError as e:
        return str(e)
    except SystemExit as e:
        assert e.code == 2
        return "argparse"
    raise AssertionError(f"{argv} was accepted")


@pytest.mark.parametrize("flag,value", CASES, ids=[f"{f}={v}" for f, v in CASES])
def test_every_flag_refuses_bad_values_before_any_work(shards, tmp_path, flag, value, capsys):
    log_dir = tmp_path / "log"
    extra = {"--hellaswag_data": ["--hellaswag_every", "1"], "--hellaswag_limit": ["--hellaswag_every", "1"],
             "--core_bundle": ["--core_every", "1"], "--core_max_per_task": ["--core_every", "1"]}.get(flag, [])
    message = run_main([*TINY_FLAGS, "--data_dir", shards, "--log_dir", str(log_dir), "--max_steps", "2", *extra, flag, value])
    if message == "argparse":
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag.lstrip("-") in err[0], err
        assert "_arg value" not in err[0], err  # the rule broken, not the name of the function that checks it
    else:  # the UserError names the flag (a missing path may be named by the path itself)
        assert flag in message or (value.startswith("/") and value in message), message
    assert not log_dir.exists()  # nothing written, not even an empty folder


PRESET_FLAGS = [f for i, f in enumerate(TINY_FLAGS) if "--hellaswag_every" not in TINY_FLAGS[max(i - 1, 0) : i + 1]]


@pytest.mark.parametrize("flags, switch", [(["--hellaswag_data", "HS"], "--hellaswag_every"),
                                           (["--hellaswag_limit", "5"], "--hellaswag_every"),
                                           (["--wandb_id", "abc123"], "--wandb")])
def test_a_flag_that_acts_through_one_that_is_off_is_refused(shards, tmp_path, flags, switch):
    """--model tiny turns HellaSwag off: its data or limit given alone would be accepted and ignored, the run
    without the evaluation asked for. Refused in one line naming the switch, before anything is written."""
    hs = write_hellaswag(str(tmp_path / "hs.jsonl"))
    flags = [hs if f == "HS" else f for f in flags]
    for base, by_preset in ((PRESET_FLAGS, switch == "--hellaswag_every"), (TINY_FLAGS, False)):
        argv = [*base, "--data_dir", shards, "--log_dir", str(tmp_path / "log"), "--max_steps", "1", *flags]
        message = run_main(argv)
        assert flags[0] in message and f"{switch} is off" in message, message
        assert ("--model tiny turns it off" in message) == by_preset, message
        assert not (tmp_path / "log").exists()


def test_bad_values_end_to_end_one_line_no_traceback(shards, tmp_path):
    for flag, value in (("--max_lr", "nan"), ("--weight_decay", "nan"), ("--grad_clip", "-1"), ("--batch_size", HUGE)):
        result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"), flag, value])
        assert_one_line_error(result, flag)
        assert not (tmp_path / "log").exists()


def test_output_paths_the_system_refuses(shards, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    for log_dir in (str(a_file), str(a_file / "sub"), "/proc/no_such_dir/log"):
        result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "1"])
        assert_one_line_error(result, "--log_dir")
    result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", str(a_file), "--log_dir", str(tmp_path / "log"), "--max_steps", "1"])
    assert_one_line_error(result, "--data_dir", "is a file")
    assert a_file.read_text() == "mine"


def test_a_refusal_found_late_leaves_the_log_as_it_was(shards, tmp_path):
    """Bad input met while the run is set up (HellaSwag data, a CORE bundle, a --tensorboard that is a file) leaves log.txt;
    a log.txt that is a folder is one line; a killed run's temporaries are cleared by the next."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / "log.txt").write_text("0 train 5.0\n")
    (tmp_path / "bad.jsonl").write_text('{"bad json\n')
    (tmp_path / "a_file").write_text("x")
    for flags, needle in ((["--hellaswag_every", "1", "--hellaswag_data", str(tmp_path / "bad.jsonl")], "bad.jsonl:1"),
                          (["--core_every", "1", "--core_bundle", str(tmp_path / "a_file")], "a_file is neither a folder"),
                          (["--tensorboard", str(tmp_path / "a_file")], "--tensorboard")):
        with pytest.raises(train_gpt2.UserError, match=re.escape(needle)):
            train(shards, str(log_dir), "--max_steps", "1", *flags)
        assert (log_dir / "log.txt").read_text() == "0 train 5.0\n"
        with pytest.raises(train_gpt2.UserError, match=re.escape(needle)):  # a --log_dir the run would make
            train(shards, str(tmp_path / "new_log"), "--max_steps", "1", *flags)
        assert not (tmp_path / "new_log").exists()
    (log_dir / "log.txt").unlink()
    (log_dir / "log.txt").mkdir()
    with pytest.raises(train_gpt2.UserError, match="log.txt"):
        train(shards, str(log_dir), "--max_steps", "1")
    (log_dir / "log.txt").rmdir()
    (log_dir / "model_00003.pt.1f2e3d4c.tmp").write_bytes(b"half a checkpoint")
    for name in ("model_00002.pt.tmp", "log.txt.tmp", "notes.tmp"):  # named by the user, not by temporary_name
        (log_dir / name).write_text("the user's")
    train(shards, str(log_dir), "--max_steps", "1")
    assert sorted(os.listdir(log_dir)) == ["log.txt", "log.txt.tmp", "model_00000.pt", "model_00002.pt.tmp", "notes.tmp"]


def small_vocab_checkpoint():
    """Weights that fit their config, but a vocabulary the GPT-2 tokenizer's ids would index past."""
    config = train_gpt2.GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=4)
    return {"model": train_gpt2.GPT(config).state_dict(), "config": dataclasses.asdict(config)}


@pytest.mark.parametrize("content", [[1, 2, 3], {"model": {}, "config": {"n_layer": 2}}, {"model": {}, "config": [1]},
                                     {"model": [], "config": {"block_size": 32, "vocab_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 3}},
                                     "small vocabulary"])
def test_checkpoints_that_load_but_are_not_ours(tmp_path, content):
    content = small_vocab_checkpoint() if content == "small vocabulary" else content
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    torch.save(content, str(log_dir / "model_00005.pt"))
    with pytest.raises(train_gpt2.UserError, match="none of the 1 checkpoints"):
        train(make_shards(str(tmp_path / "data")), str(log_dir), "--max_steps", "8", "--resume")
    hs = tmp_path / "hs.jsonl"
    hs.write_text('{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 0}\n')
    for cmd in (["generate_tokens.py"], ["hellaswag.py", "--data", str(hs)]):
        assert_one_line_error(run_script([*cmd, "--checkpoint", str(log_dir / "model_00005.pt"), "--device", "cpu"]), "model_00005.pt")


def flip_exponent_bit(path, name):
    """Flip the top bit of the exponent of tensor `name`'s first float inside the file (1.7e-4 becomes
    5.9e34), as bit rot or a bad copy would: the byte is found by the tensor's own bytes, which the file
    holds once. Returns (the tensor before, the float the flipped bytes make)."""
    tensor = torch.load(path, weights_only=True)["model"][name]
    assert tensor.dtype == torch.float32 and 0 < abs(tensor[0].item()) < 2, tensor[:4]  # bit 30 clear: it becomes huge
    data = bytearray(open(path, "rb").read())
    at = data.find(tensor.numpy().tobytes())
    assert at > 0 and data.find(tensor.numpy().tobytes(), at + 1) == -1
    data[at + 3] ^= 0x40  # little-endian: byte 3 holds the sign and the exponent's top 7 bits
    with open(path, "wb") as f:
        f.write(data)
    return tensor, struct.unpack("<f", bytes(data[at : at + 4]))[0]


def test_a_bit_flipped_in_a_checkpoints_weights_is_refused_and_resume_takes_the_one_before(shards, tmp_path, capsys,
                                                                                          one_thread):
    """torch.load checks no CRC: a flipped bit inside a tensor's data loads as another number. The checksum a
    checkpoint carries finds it: sampling and HellaSwag refuse the file in one line, and --resume skips it,
    saying so, for the checkpoint before."""
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "3", "--eval_every", "0", "--save_every", "1")
    damaged, before = (os.path.join(log_dir, f"model_0000{s}.pt") for s in (2, 1))
    weights = torch.load(damaged, weights_only=True)["model"]
    name = "transformer.h.0.ln_1.bias"
    tensor, flipped = flip_exponent_bit(damaged, name)
    loaded = torch.load(damaged, weights_only=True)["model"][name]  # torch.load takes the file as it is
    assert loaded[0].item() == flipped and abs(flipped) > 1e30 and torch.equal(loaded[1:], tensor[1:])

    hs = write_hellaswag(str(tmp_path / "hs.jsonl"), n=4)
    for main, flags in ((generate_tokens.main, ["--prompt", "Hello", "--max_new_tokens", "2"]), (hellaswag.main, ["--data", hs])):
        assert_cli_error(script_cli(capsys, main, "--checkpoint", damaged, "--device", "cpu", *flags),
                         f"{damaged}: damaged", "use an earlier checkpoint")

    capsys.readouterr()
    train(shards, log_dir, "--max_steps", "4", "--eval_every", "0", "--save_every", "1", "--resume")
    out, err = capsys.readouterr()
    assert f"skipping checkpoint: {damaged}: damaged" in err and f"resuming from {before} at step 2" in out, out + err
    again = torch.load(damaged, weights_only=True)["model"]  # step 2 run again from model_00001.pt: as the first time
    assert all(torch.equal(again[k], weights[k]) for k in weights)


def test_a_checkpoint_with_a_foreign_optimizer_layout(shards, tmp_path, capsys):
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "2", "--eval_every", "0")
    path = os.path.join(log_dir, "model_00001.pt")
    ckpt = load_checkpoint(path)
    ckpt["optimizer"]["param_groups"] = ckpt["optimizer"]["param_groups"][:1]  # one group where we have two
    save_checkpoint(path, ckpt)  # with its checksum: not damaged, only not ours
    with pytest.raises(train_gpt2.UserError, match="none of the 1 checkpoints"):
        train(shards, log_dir, "--max_steps", "4", "--resume")
    assert "model_00001.pt: its weights or optimizer state do not fit" in capsys.readouterr().err


def test_pruning_never_removes_the_newest_loadable_checkpoint(shards, tmp_path):
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "12", "--eval_every", "0", "--save_every", "4")
    broken = os.path.join(log_dir, "model_00011.pt")
    truncate_half(broken)
    train(shards, log_dir, "--max_steps", "10", "--eval_every", "0", "--resume", "--keep_checkpoints", "1")
    names = sorted(n for n in os.listdir(log_dir) if n.endswith(".pt"))
    assert names == ["model_00009.pt", "model_00011.pt"]  # 00003 and 00007 pruned; the new 00009 kept
    train(shards, log_dir, "--max_steps", "11", "--eval_every", "0", "--resume")  # and the next resume works
    assert max(read_log(log_dir)["train"]) == 10


def test_resume_refuses_another_model_preset(shards, tmp_path):
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "2", "--eval_every", "0")
    with pytest.raises(train_gpt2.UserError, match=re.escape(
            "--model d12 (n_layer 12, n_head 12, n_embd 768) conflicts with the checkpoint's model (n_layer 2, n_head 2, "
            "n_embd 32)")):
        train_gpt2.main(["--log_dir", log_dir, "--resume", "--model", "d12"])
    # the seed draws the data order: the loader keeps the checkpoint's, so another one is refused, not ignored
    with pytest.raises(train_gpt2.UserError, match="--seed 42 conflicts with the checkpoint's 1337"):
        train_gpt2.main(["--log_dir", log_dir, "--resume", "--seed", "42"])


def test_resume_refuses_a_preset_of_another_shape_even_under_the_runs_own_preset_name(shards, tmp_path):
    """A run of --model d12's name but --n_layer 2 --n_head 2 --n_embd 32: `--resume --model d12` asks for d12's
    12 x 768 shape, not the checkpoint's; the preset's shape with the shape flags given is the run's."""
    log_dir = str(tmp_path / "log")
    flags = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--eval_every", "0"]
    flags[flags.index("tiny")] = "d12"
    train_gpt2.main([*flags, "--max_steps", "1"])
    before = sorted(os.listdir(log_dir))
    with pytest.raises(train_gpt2.UserError, match=re.escape("--model d12 (n_layer 12, n_head 12, n_embd 768) conflicts")):
        train_gpt2.main(["--log_dir", log_dir, "--resume", "--model", "d12", "--max_steps", "2"])
    assert sorted(os.listdir(log_dir)) == before
    train_gpt2.main(["--log_dir", log_dir, "--resume", "--model", "d12", "--n_layer", "2", "--n_head", "2",
                     "--n_embd", "32", "--max_steps", "2"])  # the preset with the run's shape flags is the run
    assert sorted(read_log(log_dir)["train"]) == [0, 1]


def test_resuming_a_finished_run_says_so_and_changes_nothing(shards, tmp_path, capsys):
    """A bare --resume of a finished run is one line and exit 0 (a preemptible job may pass --resume
    once more); a --max_steps the run is already past is refused; neither touches the log folder."""
    log_dir = tmp_path / "log"
    train(shards, str(log_dir), "--max_steps", "4", "--eval_every", "2", "--save_every", "2")
    before = {p.name: p.read_bytes() for p in log_dir.iterdir()}
    capsys.readouterr()
    train_gpt2.main(["--log_dir", str(log_dir), "--resume"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "the run is finished" in out[0] and "model_00003.pt" in out[0]
    with pytest.raises(train_gpt2.UserError, match="--max_steps 3: the run has already taken 4 steps"):
        train_gpt2.main(["--log_dir", str(log_dir), "--resume", "--max_steps", "3"])
    assert {p.name: p.read_bytes() for p in log_dir.iterdir()} == before
    train_gpt2.main(["--log_dir", str(log_dir), "--resume", "--max_steps", "5"])  # more steps: it goes on
    assert max(read_log(str(log_dir))["train"]) == 4


def test_a_bare_resume_continues_the_same_run(shards, tmp_path):
    """`--resume` alone takes every setting from the checkpoint, the run length and schedule included."""
    run = [*TINY_FLAGS, "--data_dir", shards, "--max_steps", "8", "--eval_every", "3", "--save_every", "4", "--max_lr", "5e-3"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train_gpt2.main([*run, "--log_dir", straight])
    train_gpt2.main([*run, "--log_dir", resumed, "--max_steps", "8"])
    os.remove(os.path.join(resumed, "model_00007.pt"))
    train_gpt2.main(["--log_dir", resumed, "--resume"])
    assert numbers_logged(straight) == numbers_logged(resumed)


def test_a_changed_flag_on_resume_is_reported(shards, tmp_path, capsys):
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "2", "--eval_every", "0")
    train_gpt2.main(["--log_dir", log_dir, "--resume", "--max_steps", "3"])
    assert "--max_steps changes from 2 to 3" in capsys.readouterr().out
    assert sorted(read_log(log_dir)["train"]) == [0, 1, 2]


def test_short_last_shard_is_skipped_with_a_warning(tmp_path, capsys):
    data = make_shards(str(tmp_path / "data"), train_tokens=(2000, 100))  # fineweb's short tail shard: < 4*32+1
    train(data, str(tmp_path / "log"), "--max_steps", "12", "--eval_every", "0", "--save_every", "0")
    err = capsys.readouterr().err
    assert "skipping 1 train shard" in err and "(100 tokens)" in err
    assert sorted(read_log(str(tmp_path / "log"))["train"]) == list(range(12))


def test_a_foreign_shard_mid_run_stops_with_one_line_and_keeps_the_progress(tmp_path):
    data = make_shards(str(tmp_path / "data"), train_tokens=(2000,))
    write_shard(os.path.join(data, "test_train_000002.bin"), np.full(2000, 50300))  # reached at step 7
    log_dir = str(tmp_path / "log")
    cmd = ["train_gpt2.py", *TINY_FLAGS, "--data_dir", data, "--log_dir", log_dir, "--max_steps", "20", "--eval_every", "0",
           "--save_every", "0"]
    result = run_script(cmd)
    assert_one_line_error(result, "test_train_000002.bin holds token id 50300")
    saved = find_checkpoints(log_dir)
    assert len(saved) == 1 and "saved" in result.stdout
    step = load_checkpoint(saved[0])["step"]
    assert step >= 5 and sorted(read_log(log_dir)["train"]) == list(range(step + 1))


def test_ctrl_c_with_a_closed_stdout_still_checkpoints(shards, tmp_path):
    """`train_gpt2.py ... | tee run.log`, Ctrl-C: tee dies with the signal too, so stdout is a broken pipe."""
    log_dir = str(tmp_path / "log")
    cmd = [sys.executable, "train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "100000",
           "--eval_every", "0", "--save_every", "0"]
    with open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
        for line in proc.stdout:
            if line.startswith("step     2/"):
                break
        proc.stdout.close()  # the reader is gone
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    step = load_checkpoint(find_checkpoints(log_dir)[0])["step"]
    assert step >= 2 and max(read_log(log_dir)["train"]) == step
    assert "Traceback" not in (tmp_path / "err.txt").read_text()


def test_a_run_that_cannot_fit_in_memory_says_so_first(shards, tmp_path, monkeypatch):
    monkeypatch.setattr(arguments, "available_memory_bytes", lambda: 8 * 2**30)
    with pytest.raises(train_gpt2.UserError, match=r"needs at least .* GiB .* lower --batch_size"):
        train_gpt2.main(["--data_dir", shards, "--log_dir", str(tmp_path / "log"), "--device", "cpu", "--hellaswag_every", "0"])
    with pytest.raises(train_gpt2.UserError, match="weights alone need"):
        train(shards, str(tmp_path / "log"), "--n_layer", "1000", "--n_embd", "8192", "--n_head", "64")


def test_the_tiny_preset_fits_a_laptop_and_flags_still_win():
    args = train_gpt2.parse_args(["--model", "tiny"])
    config = train_gpt2.model_config(args, None)
    with torch.device("meta"):
        params = counted_parameters(train_gpt2.GPT(config))
    assert estimated_bytes(config, params, args.batch_size, args.seq_len, "fp32") < 2 * 2**30
    assert args.total_batch_size // (args.batch_size * args.seq_len) <= 4  # a step is a few micro-batches, not 128
    assert train_gpt2.parse_args(["--model", "tiny", "--batch_size", "3"]).batch_size == 3
    assert train_gpt2.parse_args([]).total_batch_size == 524288  # the GPT-2 recipe stays the default


def test_warmup_longer_than_the_run_is_noted(shards, tmp_path, capsys):
    train(shards, str(tmp_path / "log"), "--max_steps", "3", "--warmup_steps", "715", "--eval_every", "0")
    assert "warning: --warmup_steps 715 is not shorter than the 3-step run" in capsys.readouterr().out


def test_help_gives_every_flag_a_text_and_one_default():
    help_text = run_script(["train_gpt2.py", "--help"]).stdout
    parser = train_gpt2.build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        flag = action.option_strings[0]
        entry = re.split(rf"\n  {flag}\b", help_text.split("options:", 1)[1], maxsplit=1)[1].split("\n  --", 1)[0]
        assert entry.count("(default") <= 1, entry
        if action.default is not None and not isinstance(action.default, bool):
            assert f"(default: {action.default})" in " ".join(entry.split()), entry


def test_init_from_a_hub_name_offline_fails_at_once(shards, tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = run_script(["train_gpt2.py", *TINY_RUN_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"),
                         "--init_from", "gpt2"], env=env)
    assert_one_line_error(result, "--init_from gpt2", "not in the Hugging Face cache")


def test_init_from_a_hub_name_offline_reads_a_copied_hub_cache(tmp_path):
    """What docs/training.md says to copy to an offline machine: the hub cache of the name `gpt2`
    (HF_HOME/hub/models--gpt2, as `from_pretrained("gpt2")` fills it elsewhere) is read with no network. A random
    model of GPT-2 124M's shape stands in for OpenAI's weights; one greedy token from it, as transformers computes it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())  # GPT-2 124M's shape, which --init_from gpt2 expects
    snapshot = tmp_path / "hf" / "hub" / "models--gpt2" / "snapshots" / ("0" * 40)
    model.save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = run_script(["generate_tokens.py", "--init_from", "gpt2", "--prompt", "Hello", "--max_new_tokens", "1",
                         "--num_samples", "1", "--temperature", "0"], env=env)
    assert result.returncode == 0, result.stderr
    with torch.no_grad():
        token = model(torch.tensor([[15496]])).logits[0, -1].argmax().item()  # "Hello" is GPT-2's token 15496
    assert result.stdout == f"--- sample 1/1 ---\nHello{get_tokenizer().decode([token])}\n"


@pytest.mark.parametrize("body, code", [("print('done', end='')", 0), ("print('done', end=''); raise UserError('bad flag')", 2),
                                        ("print('done', end=''); sys.exit(3)", 3), ("print('done', end=''); sys.exit('bad flag')", 1)])
def test_a_torchrun_worker_ends_with_its_exit_code_and_all_its_output(body, code):
    """Under RANK (torchrun) run_cli ends the process with os._exit, skipping the interpreter teardown
    that can abort on gloo's threads: the exit code and buffered output must survive that."""
    script = f"import sys\nfrom nanogpt.cli import UserError, run_cli\ndef main():\n    {body}\nrun_cli(main)\nprint('not reached')\n"
    result = run_script(["-c", script], env={"RANK": "0"})
    assert result.returncode == code, result.stderr
    assert result.stdout == "done"
    assert ("bad flag" in result.stderr) == (code in (1, 2)), result.stderr


def test_out_of_memory_mid_run_is_one_line_and_keeps_the_progress(shards, tmp_path, monkeypatch):
    """A GPU that runs out of memory at step 3 whatever the micro-batch: the step is tried again at 2 and at 1 rows, then
    the error names the batch and the fix, and steps 0-2 are saved."""
    forward, calls = train_gpt2.GPT.forward, {"n": 0}

    def forward_until_oom(self, idx, targets=None):
        calls["n"] += 1
        if targets is not None and calls["n"] > 3 * 2:  # 2 micro-steps per step (256 = 4 x 32 x 2)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return forward(self, idx, targets)

    monkeypatch.setattr(train_gpt2.GPT, "forward", forward_until_oom)
    log_dir = str(tmp_path / "log")
    with pytest.raises(train_gpt2.UserError, match=r"out of GPU memory at batch_size 1 x seq_len 32; lower --seq_len"):
        train(shards, log_dir, "--max_steps", "10", "--eval_every", "0", "--save_every", "0")
    saved = find_checkpoints(log_dir)
    assert [load_checkpoint(p)["step"] for p in saved] == [2]
    assert sorted(read_log(log_dir)["train"]) == [0, 1, 2]


def test_newer_checkpoints_that_do_not_fit_their_own_model_are_skipped(shards, tmp_path, capsys):
    """A checkpoint that loads but whose weights or AdamW state do not fit the model its config describes
    (another shape, another optimizer's groups, a state tensor of the wrong shape) is skipped like a truncated one."""
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--max_steps", "6", "--eval_every", "0", "--save_every", "3")
    good = load_checkpoint(os.path.join(log_dir, "model_00005.pt"))
    one_group = dict(good["optimizer"], param_groups=good["optimizer"]["param_groups"][:1])
    state = {i: dict(s) for i, s in good["optimizer"]["state"].items()}
    state[0]["exp_avg"] = state[0]["exp_avg"][:1]
    broken = {7: dict(good, config=dict(good["config"], n_layer=3)), 9: dict(good, optimizer=one_group),
              11: dict(good, optimizer=dict(good["optimizer"], state=state))}
    for step, ckpt in broken.items():
        save_checkpoint(os.path.join(log_dir, f"model_{step:05d}.pt"), ckpt)  # with their checksums: not damaged
    capsys.readouterr()
    train(shards, log_dir, "--max_steps", "7", "--eval_every", "0", "--resume")
    err = capsys.readouterr().err
    for step in broken:
        assert re.search(rf"skipping checkpoint: \S*model_{step:05d}\.pt: its weights or optimizer state do not fit", err)
    assert sorted(read_log(log_dir)["train"]) == list(range(7))  # resumed after step 5, the good checkpoint


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1])
def test_sighup_and_sigusr1_end_the_run_with_a_checkpoint_as_sigterm_does(shards, tmp_path, monkeypatch, capsys,
                                                                          signum):
    """A closed terminal (SIGHUP) or Slurm's warning before its time limit (SIGUSR1), met in step 2's forward: the
    step ends, its state is saved, and the run stops. (The test's own handler stands in while the run has none, so
    that a run that ignored the signal would go on instead of ending pytest.)"""
    got = []
    old = signal.signal(signum, lambda *a: got.append(a))
    forward, calls = train_gpt2.GPT.forward, []

    def signalling(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # step 2's first (two micro-steps a step)
            os.kill(os.getpid(), signum)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(train_gpt2.GPT, "forward", signalling)
    log_dir = str(tmp_path / "log")
    try:
        train(shards, log_dir, "--max_steps", "6", "--eval_every", "0", "--save_every", "0")
    finally:
        signal.signal(signum, old)
    assert "stopped by signal after step 2" in capsys.readouterr().out and not got
    assert sorted(read_log(log_dir)["train"]) == [0, 1, 2]
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00002.pt"]
