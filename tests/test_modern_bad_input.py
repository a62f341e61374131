"""Bad input to the options beyond GPT-2 (--arch llama, --rope_theta, --recipe, transformers' Llama configs):
one line on stderr that names the problem and the fix, exit code 2, before any work and without a traceback.

    python -m pytest -q tests/test_modern_bad_input.py
"""

import json

import pytest
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
])
def test_a_llama_that_cannot_compute_is_one_line(shards, tmp_path, capsys, extra, named):
    flags = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", tmp_path / "log", "--max_steps", "1", "--arch", "llama"]
    assert_cli_error(script_cli(capsys, train_gpt2.main, *flags, *extra), named)
    assert not (tmp_path / "log").exists()
