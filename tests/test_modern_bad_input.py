"""Bad input to the options beyond GPT-2 (--arch llama, --rope_theta, --recipe, transformers' Llama configs):
one line on stderr that names the problem and the fix, exit code 2, before any work and without a traceback.

    python -m pytest -q tests/test_modern_bad_input.py
"""

import json

import pytest
import torch
from transformers import LlamaConfig

import generate_tokens
import train_gpt2
from conftest import TINY_FLAGS, TINY_RUN_FLAGS, assert_cli_error, script_cli


@pytest.mark.parametrize("extra,named", [
    # heads of 15 dimensions: the rotation turns pairs of them (it was a RuntimeError inside the first forward)
    (["--n_embd", "30"], "--n_embd 30 / --n_head 2 gives heads of 15 dimensions"),
    # theta 1e-50 underflows in fp32: cos/sin of inf, a run of NaN losses that was accepted
    (["--rope_theta", "1e-50"], "--rope_theta 1e-50: must be a finite number >= 1"),
    (["--rope_theta", "0"], "--rope_theta 0.0: must be a finite number >= 1"),
    # it said AdamW's range
    (["--optimizer", "muon", "--muon_lr", "2000"],
     "--muon_lr 2000.0: must be at most 1000 (Muon's usual rate is ~0.02)"),
])
def test_a_llama_that_cannot_compute_is_one_line(shards, tmp_path, capsys, extra, named):
    flags = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", tmp_path / "log", "--max_steps", "1", "--arch", "llama"]
    assert_cli_error(script_cli(capsys, train_gpt2.main, *flags, *extra), named)
    assert not (tmp_path / "log").exists()


def test_the_modern_recipe_over_gpt2_weights_is_one_line(shards, tmp_path, capsys):
    """--recipe modern means --arch llama; over GPT-2 weights it trained a GPT-2 with Muon, and the checkpoint's
    arguments said arch llama."""
    train_gpt2.main([*TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "gpt2"), "--max_steps", "1",
                     "--eval_every", "0"])
    code, _, err = script_cli(capsys, generate_tokens.main, "--checkpoint", tmp_path / "gpt2", "--export_hf",
                              tmp_path / "hf")
    assert code == 0, err
    flags = [*TINY_RUN_FLAGS, "--data_dir", shards, "--init_from", tmp_path / "hf", "--eval_every", "0"]
    result = script_cli(capsys, train_gpt2.main, *flags, "--log_dir", tmp_path / "log", "--recipe", "modern")
    assert_cli_error(result, "--recipe modern trains --arch llama", "give --optimizer muon in its place")
    assert not (tmp_path / "log").exists()
    # what the message suggests runs
    code, _, err = script_cli(capsys, train_gpt2.main, *flags, "--log_dir", tmp_path / "log", "--optimizer", "muon")
    assert code == 0, err


def test_a_llama_config_without_key_value_heads_is_one_line(tmp_path, capsys):
    """A hand-edited config.json (transformers takes num_key_value_heads 0): it was a ZeroDivisionError."""
    LlamaConfig(vocab_size=50257, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**config, "num_key_value_heads": 0}, f)
    result = script_cli(capsys, generate_tokens.main, "--init_from", tmp_path, "--prompt", "Hi",
                        "--max_new_tokens", "1")
    assert_cli_error(result, f"--init_from {tmp_path}", "num_key_value_heads 0 (must divide num_attention_heads 2)")


def test_muon_trains_on_a_torch_without_torch_optim_muon(shards, tmp_path, capsys, monkeypatch):
    """requirements.txt takes torch 2.4; torch.optim.Muon came in 2.9, and --optimizer muon no longer needs it
    (nanogpt.muon is the project's own; it was refused in one line before)."""
    monkeypatch.delattr(torch.optim, "Muon")
    flags = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", tmp_path / "log", "--max_steps", "1", "--optimizer",
             "muon", "--eval_every", "0"]
    code, _, err = script_cli(capsys, train_gpt2.main, *flags)
    assert code == 0, err
