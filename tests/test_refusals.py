"""Settings and folders that a run cannot succeed with, refused in one line before any work (or said plainly when a
write fails), each checked against what the run would otherwise have done; and what the run's header says."""

import errno
import json
import os
import re

import pytest
import torch

import train_gpt2
from conftest import (TINY_FLAGS, assert_cli_error, assert_refused_before_any_work, count_validation_tokens, make_shards,
                      read_log, script_cli, train, write_hellaswag)
from nanogpt import arguments
from nanogpt.checkpoints import save_checkpoint
from nanogpt.cli import borrowed_settings


@pytest.fixture
def data(tmp_path):
    return make_shards(str(tmp_path / "data"))


def test_a_folder_named_like_a_checkpoint_is_refused_before_training(data, tmp_path, capsys):
    log_dir = str(tmp_path / "log")
    train(data, log_dir, "--max_steps", "6", "--save_every", "3", "--eval_every", "0")
    os.remove(os.path.join(log_dir, "model_00005.pt"))
    os.mkdir(os.path.join(log_dir, "model_00005.pt"))  # where the resumed run would save its step 5
    before = {n: os.path.getmtime(os.path.join(log_dir, n)) for n in os.listdir(log_dir)}
    log_text = open(os.path.join(log_dir, "log.txt")).read()
    result = script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--data_dir", data, "--log_dir", log_dir, "--resume",
                        "--max_steps", "6", "--save_every", "3", "--eval_every", "0")
    assert_cli_error(result, os.path.join(log_dir, "model_00005.pt"), "not a file", "move or rename it")
    assert "step" not in result[1]  # nothing trained
    assert {n: os.path.getmtime(os.path.join(log_dir, n)) for n in os.listdir(log_dir)} == before
    assert open(os.path.join(log_dir, "log.txt")).read() == log_text


def test_a_save_that_fails_with_room_on_the_disk_gives_no_disk_advice(tmp_path):
    path = str(tmp_path / "model_00001.pt")
    os.mkdir(path)  # the rename onto it fails: EISDIR, and the disk has room
    with pytest.raises(train_gpt2.UserError) as refused:
        save_checkpoint(path, {"step": 1})
    assert os.strerror(errno.EISDIR) in str(refused.value) and "disk" not in str(refused.value), refused.value


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_save_on_a_full_disk_says_to_free_space(tmp_path, monkeypatch, code):
    def full(*a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(train_gpt2.torch, "save", full)
    with pytest.raises(train_gpt2.UserError, match=f"{os.strerror(code)}.*free disk space or pick another --log_dir"):
        save_checkpoint(str(tmp_path / "model_00001.pt"), {"step": 1})


@pytest.mark.parametrize("flag, value, need", [("--vocab_size", "2000000000", "weights alone"),
                                               ("--mlp_hidden", "1000000000", "weights alone"),
                                               ("--vocab_size", "50000000", "needs at least")])
def test_a_model_too_big_for_memory_names_the_flag_that_made_it_big(data, tmp_path, capsys, monkeypatch, flag, value,
                                                                    need):
    monkeypatch.setattr(arguments, "available_memory_bytes", lambda: 8 * 2**30)
    assert_refused_before_any_work(capsys, data, tmp_path, [flag, value], need, f"a smaller {flag}")
    # the reference: the same run without that flag fits
    train(data, str(tmp_path / "without"), "--max_steps", "1")


def test_out_of_memory_in_a_step_names_a_widening_flag(data, tmp_path, monkeypatch):
    def oom(self, idx, targets=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(train_gpt2.GPT, "forward", oom)
    # every micro-batch down to 1 is tried first (nanogpt/fitting.py); then the line names what else to lower
    with pytest.raises(train_gpt2.UserError, match=r"batch_size 1 x seq_len 32; lower --seq_len or --vocab_size, "):
        train(data, str(tmp_path / "log"), "--max_steps", "1", "--vocab_size", "50304", "--eval_every", "0")


def test_unet_skips_with_one_layer_are_refused(data, tmp_path, capsys):
    assert_refused_before_any_work(capsys, data, tmp_path, ["--arch", "speedrun", "--n_layer", "1", "--unet_skips"],
                                   "--unet_skips needs --n_layer 2 or more", "--no_unet_skips")


def test_a_one_layer_speedrun_has_no_empty_skip_weights():
    one = train_gpt2.make_gpt(train_gpt2.GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, arch="speedrun"))
    assert all(p.numel() for p in one.parameters()), [n for n, p in one.named_parameters() if not p.numel()]
    two = train_gpt2.make_gpt(train_gpt2.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, arch="speedrun"))
    assert two.config.unet_skips and two.skip_weights.shape == (1,)  # from 2 blocks on, as before


def lowest_loss(cap, vocab_size):
    """The reference: the loss of a token whose logit sits at the cap and every other at minus the cap, the best a
    head squashed into (-cap, cap) can do."""
    logits = torch.full((1, vocab_size), -cap, dtype=torch.float64)
    logits[0, 0] = cap
    return torch.nn.functional.cross_entropy(logits, torch.tensor([0])).item()


@pytest.mark.parametrize("cap", ["0.5", "1", "4.9"])
def test_a_logit_softcap_below_5_is_refused(data, tmp_path, capsys, cap):
    assert lowest_loss(float(cap), 50304) > lowest_loss(5.0, 50304)
    assert_refused_before_any_work(capsys, data, tmp_path, ["--logit_softcap", cap],
                                   f"--logit_softcap {float(cap)}: must be 0 (off) or 5 or more",
                                   f"above {lowest_loss(float(cap), 50304):.2f} over 50304 tokens")


def test_the_smallest_logit_softcap_lets_a_token_get_below_a_gpt2s_loss(data, tmp_path):
    assert lowest_loss(5.0, 50304) < 1.2  # a GPT-2 124M's mean validation loss is ~3
    train(data, str(tmp_path / "log"), "--max_steps", "1", "--logit_softcap", "5")


def one_task_bundle(folder):
    """DCLM's bundle layout with one multiple-choice task of 4 examples: what --core_bundle reads."""
    os.makedirs(os.path.join(folder, "eval_data", "commonsense"))
    with open(os.path.join(folder, "core.yaml"), "w") as f:
        f.write("icl_tasks:\n- label: copa_like\n  dataset_uri: commonsense/copa_like.jsonl\n  num_fewshot: 0\n"
                "  icl_task_type: multiple_choice\n")
    with open(os.path.join(folder, "eval_meta_data.csv"), "w") as f:
        f.write("Eval Task,Task Category,Random baseline,Description\ncopa_like,reasoning,50,a test task\n")
    with open(os.path.join(folder, "eval_data", "commonsense", "copa_like.jsonl"), "w") as f:
        for i in range(4):
            f.write(json.dumps({"query": f"the dog runs {i}?", "choices": ["the ball", "a man walks"], "gold": i % 2})
                    + "\n")
    return folder


@pytest.mark.parametrize("flag", ["--core_every", "--hellaswag_every"])
def test_in_loop_scoring_with_a_one_token_context_is_refused_before_the_log_folder(data, tmp_path, capsys, flag):
    scored = {"--core_every": ["--core_bundle", one_task_bundle(str(tmp_path / "bundle"))],
              "--hellaswag_every": ["--hellaswag_data", write_hellaswag(str(tmp_path / "hs.jsonl"), n=4)]}[flag]
    short = [flag, "1", *scored, "--total_batch_size", "4"]
    assert_refused_before_any_work(capsys, data, tmp_path, [*short, "--seq_len", "1"],
                                   "a model with a context of 1 token cannot score", "--seq_len 2 or more", f"{flag} 0")
    # the reference: with a context of 2 tokens the same run scores at step 0
    log_dir = str(tmp_path / "two")
    train(data, log_dir, *short, "--total_batch_size", "8", "--seq_len", "2")
    assert 0 in read_log(log_dir)[{"--core_every": "core", "--hellaswag_every": "hella"}[flag]]


LR_RE = re.compile(r"step\s+(\d+)/\d+ \| loss \S+ \| lr (\S+)")


@pytest.mark.parametrize("extra, recipe, schedule", [
    ([], "gpt2", "lr schedule cosine: 2 warm-up steps to 3.0000e-03, half a cosine down to 3.0000e-04 at step 10"),
    (["--recipe", "modern", "--lr_schedule", "wsd", "--warmdown_frac", "0.4", "--max_lr", "3e-3"], "modern",
     "lr schedule wsd: 2 warm-up steps to 3.0000e-03, held until step 6, then a straight line down to 3.0000e-04 at step 10"),
])
def test_the_run_header_names_the_recipe_and_the_schedule(data, tmp_path, capsys, extra, recipe, schedule):
    capsys.readouterr()
    train(data, str(tmp_path / "log"), "--max_steps", "10", "--eval_every", "0", "--save_every", "0", *extra)
    out = capsys.readouterr().out
    optimizer = "muon" if recipe == "modern" else "adamw"
    assert f"\nrecipe {recipe} | optimizer {optimizer} | {schedule}\n" in out, out
    # the reference: the rates the steps printed rise for 2 steps, then fall as said
    lr = {int(s): float(v) for s, v in LR_RE.findall(out)}
    assert lr[1] == 3e-3 and lr[0] < lr[1]
    if recipe == "modern":
        assert all(lr[s] == 3e-3 for s in range(1, 7)) and lr[7] < 3e-3 and lr[9] < lr[8] < lr[7]
    else:
        assert lr[2] == 3e-3 and all(lr[s + 1] < lr[s] for s in range(2, 9))


def test_the_run_header_gives_the_validation_size_and_the_settings_a_preset_set(data, tmp_path, capsys, monkeypatch):
    """The header's validation tokens are the tokens one validation reads (counted as the val loader hands them
    out), and it names the --model preset's settings the command line left out (--save_every here)."""
    read = count_validation_tokens(monkeypatch)
    flags = [f for i, f in enumerate(TINY_FLAGS) if "--save_every" not in TINY_FLAGS[max(0, i - 1): i + 1]]
    capsys.readouterr()
    train_gpt2.main([*flags, "--data_dir", data, "--log_dir", str(tmp_path / "log"), "--max_steps", "2",
                     "--eval_every", "1"])
    out = capsys.readouterr().out
    per_eval, left = divmod(sum(read), len(read_log(str(tmp_path / "log"))["val"]))  # tokens read / validations run
    assert left == 0
    assert per_eval == 256 and f"\nvalidation {per_eval:,} tokens every 1 steps = 2 val_steps x 4 x 32 x 1 ranks\n" in out
    assert "\nfrom --model tiny (not given on the command line): --save_every 0\n" in out, out
    assert not os.path.exists(tmp_path / "log" / "model_00000.pt")  # no step checkpoint: every 0 is off
    # validation off: no line
    train_gpt2.main([*TINY_FLAGS, "--data_dir", data, "--log_dir", str(tmp_path / "off"), "--max_steps", "1",
                     "--eval_every", "0"])
    assert "\nvalidation " not in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--model", "tiny", "--max_steps", "3"], ["--recipe", "speedrun", "--max_lr", "1e-3"],
                                  ["--model", "tiny", "--recipe", "modern"]])
def test_the_settings_named_as_a_presets_are_those_it_changed(argv):
    """borrowed_settings names, for the header, the flags the --model preset and the --recipe set: each value named
    is the one the run has, and dropping the preset and the recipe from the command line changes exactly those."""
    args = train_gpt2.parse_args(argv)
    named = {name: value for _, settings in borrowed_settings(args, train_gpt2.build_parser(), train_gpt2.RUN_PRESETS,
                                                               train_gpt2.RECIPES) for name, value in settings.items()}
    plain = train_gpt2.parse_args([word for i, word in enumerate(argv)
                                   if word not in ("--model", "--recipe") and argv[i - 1] not in ("--model", "--recipe")])
    changed = {name for name in vars(args) if name not in ("explicit", "given_as", "model", "recipe")
               and getattr(args, name) != getattr(plain, name)}
    assert named and set(named) == changed, (named, changed)
    assert all(getattr(args, name) == value for name, value in named.items())
    assert not {word[2:] for word in argv if word.startswith("--")} & set(named)  # given on the command line


def test_the_help_names_what_the_presets_and_recipes_set():
    """--help shows the parser's defaults; the settings --model tiny and each --recipe put in their place are named
    in --model's and --recipe's help and beside each flag they set."""
    helps = {a.dest: a.help for a in train_gpt2.build_parser()._actions}
    assert "--batch_size 8" in helps["model"] and "--seq_len 256" in helps["model"]
    assert "[--model tiny: 8]" in helps["batch_size"] and "--recipe speedrun: 0.003" in helps["max_lr"]
    assert "speedrun: --arch speedrun --optimizer muon --muon_lr 0.04" in helps["recipe"]
    args = train_gpt2.parse_args(["--model", "tiny"])
    assert (args.batch_size, args.seq_len, train_gpt2.parse_args(["--recipe", "speedrun"]).max_lr) == (8, 256, 3e-3)

@pytest.mark.parametrize("env,missing", [({"RANK": "0"},
                                          "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"),
                                         ({"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "4"},
                                          "MASTER_ADDR, MASTER_PORT are not set")])
def test_rank_without_torchrun_is_one_line_before_any_work(data, tmp_path, monkeypatch, env, missing):
    """A cluster job's environment with RANK (and maybe more) but not all torchrun sets: one line (run_cli prints a
    UserError as one line; under RANK it then leaves as a torchrun worker, so main is called here), no log folder."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(train_gpt2.UserError) as refused:
        train_gpt2.main([*TINY_FLAGS, "--data_dir", data, "--log_dir", str(tmp_path / "log"), "--max_steps", "1"])
    for needle in (f"RANK={env['RANK']}", missing, "start with torchrun", "unset RANK"):
        assert needle in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "log").exists()


def test_rank_without_torchrun_in_the_evaluation_scripts_is_one_line(monkeypatch):
    """hellaswag.py and evaluate.py join torchrun's processes through train_gpt2.setup_distributed: the same line."""
    for name in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(train_gpt2.UserError, match="RANK=0 is in the environment but LOCAL_RANK, .* with torchrun"):
        train_gpt2.setup_distributed("cpu")
