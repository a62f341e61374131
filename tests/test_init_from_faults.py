"""--init_from folders that are not what their config.json says, against what transformers makes of them: a head
the config calls tied that the weights untie, weights of another shape, a rope_theta that is not a number,
"swish" for SiLU, tensors the model does not use, and one of our own log folders.

    python -m pytest -q tests/test_init_from_faults.py
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import generate_tokens
import train_gpt2
from conftest import TINY_FLAGS, assert_cli_error, random_tokens, script_cli
from nanogpt.tokenizer import GPT2_VOCAB_SIZE

ROUNDING = 1e-5  # fp32 logits of the same math, ~1e-7 apart here


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    pass


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))


def save_llama(folder, **settings):
    torch.manual_seed(0)
    config = dict(vocab_size=GPT2_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    LlamaForCausalLM(LlamaConfig(**{**config, **settings})).save_pretrained(folder)
    return folder


def save_gpt2(folder, **settings):
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_positions=64, n_layer=2, n_head=2, n_embd=32, **settings)).save_pretrained(folder)
    return folder


def theirs_and_ours(folder):
    transformers_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = train_gpt2.load_model(init_from=str(folder))
    with torch.no_grad():
        return transformers_model, transformers_model(random_tokens()).logits, ours, ours(random_tokens())[0]


def test_a_llama_whose_config_says_tied_but_weights_untie_loads_untied_as_transformers_does(tmp_path):
    folder = save_llama(tmp_path / "llama", tie_word_embeddings=False)
    edit_config(folder, tie_word_embeddings=True)  # a stale config: the model was fine-tuned untied
    hf, theirs, ours, logits = theirs_and_ours(folder)
    assert hf.lm_head.weight is not hf.model.embed_tokens.weight  # transformers' own decision
    assert not ours.config.tie_embeddings
    assert (logits[..., :GPT2_VOCAB_SIZE] - theirs).abs().max().item() < ROUNDING * theirs.abs().max().item()


def test_a_gpt2_whose_weights_untie_the_head_is_refused_in_one_line(tmp_path, capsys):
    """Our GPT-2 always ties: dropping the file's head to tie would give logits that differ by ~60."""
    folder = save_gpt2(tmp_path / "gpt2", tie_word_embeddings=False)
    edit_config(folder, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    assert hf.lm_head.weight is not hf.transformer.wte.weight
    result = script_cli(capsys, generate_tokens.main, "--init_from", folder, "--prompt", "Hi", "--max_new_tokens", "1")
    assert_cli_error(result, f"--init_from {folder}", "an output head of its own")


def test_a_truly_tied_folder_still_loads_tied(tmp_path):
    folder = save_llama(tmp_path / "tied", tie_word_embeddings=True)
    _, theirs, ours, logits = theirs_and_ours(folder)
    assert ours.config.tie_embeddings and ours.lm_head.weight is ours.transformer.wte.weight
    assert (logits[..., :GPT2_VOCAB_SIZE] - theirs).abs().max().item() < ROUNDING * theirs.abs().max().item()


def test_weights_of_another_shape_than_the_config_name_the_first_tensor(tmp_path, capsys):
    folder = save_gpt2(tmp_path / "gpt2")
    edit_config(folder, n_embd=64, n_head=4)
    result = script_cli(capsys, generate_tokens.main, "--init_from", folder, "--prompt", "Hi", "--max_new_tokens", "1")
    assert_cli_error(result, "its weights do not fit its config.json", "transformer.h.0.attn.c_attn.bias is (96,) in the "
                     "weight files, (192,) by config.json")
    assert "network" not in result[2]


@pytest.mark.parametrize("theta", ["fast", None, -5])
def test_a_rope_theta_that_is_not_a_number_is_one_line(tmp_path, capsys, theta):
    folder = save_llama(tmp_path / "llama")
    edit_config(folder, rope_theta=theta, rope_parameters={"rope_type": "default", "rope_theta": theta})
    result = script_cli(capsys, generate_tokens.main, "--init_from", folder, "--prompt", "Hi", "--max_new_tokens", "1")
    assert_cli_error(result, f"rope_theta {theta!r}")


def test_swish_is_silu(tmp_path):
    folder = save_llama(tmp_path / "llama", hidden_act="swish")
    _, theirs, _, logits = theirs_and_ours(folder)
    assert (logits[..., :GPT2_VOCAB_SIZE] - theirs).abs().max().item() < ROUNDING * theirs.abs().max().item()


def test_tensors_the_model_does_not_use_are_named(tmp_path, capsys):
    folder = save_llama(tmp_path / "llama")
    weights = load_file(folder / "model.safetensors")
    save_file({**weights, "value_head.weight": torch.zeros(1, 32)}, folder / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    train_gpt2.load_model(init_from=str(folder))
    warning = capsys.readouterr().err
    assert "1 tensors of its weight files are not part of the model" in warning and "value_head.weight" in warning


def test_our_own_log_folder_as_init_from_says_what_to_use(shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    code, _, err = script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir,
                              "--max_steps", "1", "--eval_every", "0")
    assert code == 0, err
    result = script_cli(capsys, generate_tokens.main, "--init_from", log_dir, "--prompt", "Hi", "--max_new_tokens", "1")
    assert_cli_error(result, "it is a log folder of train_gpt2.py", f"--checkpoint {log_dir}", "--resume")


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (it was a 17-line traceback)."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')

    log_dir = save_llama(tmp_path / "llama")
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    result = script_cli(capsys, generate_tokens.main, "--init_from", log_dir, "--export_hf", tmp_path / "out")
    assert_cli_error(result, f"cannot write --export_hf {tmp_path / 'out'}", "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


def test_a_long_context_keeps_no_rotary_table():
    """A llama of a 4M-token context (as --init_from may bring) holds no position tables: the angles of the
    positions at hand are computed when used."""
    config = train_gpt2.GPTConfig(block_size=4_000_000, n_layer=2, n_head=2, n_embd=32, arch="llama")
    with torch.device("meta"):
        model = train_gpt2.make_gpt(config)
    assert sum(b.numel() for b in model.buffers()) == 2 * 8  # inv_freq: head_dim / 2 per layer
    # the rotation at a position, against the formula: pairs (i, i + 8) turned by position * 10000^(-2i/16)
    rotary, x = train_gpt2.make_gpt(train_gpt2.GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32, arch="llama")
                                    ).transformer.h[0].attn.rotary, torch.randn(1, 1, 3, 16, dtype=torch.float64)
    turned = rotary.double()(x, 40)
    for t in range(3):
        angle = (40 + t) * 10000.0 ** (-2 * torch.arange(8, dtype=torch.float64) / 16)
        first, second = x[0, 0, t, :8], x[0, 0, t, 8:]
        want = torch.cat([first * angle.cos() - second * angle.sin(), second * angle.cos() + first * angle.sin()])
        assert (turned[0, 0, t] - want).abs().max().item() < 1e-5  # the angles are fp32 products


def test_an_export_killed_before_its_rename_is_cleared_by_the_next(tmp_path, capsys):
    """SIGKILL (or a power cut) mid-export left DIR.<random>.tmp/ that no later export cleared. Its lock file,
    held by no live process, marks it: the next export to DIR removes it. A folder of such a name without one is
    the user's, and one whose lock a live export holds is that export's: both stay."""
    from nanogpt.files import lock_folder, unlock_folder
    from nanogpt.hf import EXPORT_LOCK

    model = save_llama(tmp_path / "llama")
    abandoned, users, live = (tmp_path / f"out.{name}.tmp" for name in ("x1y2", "mine", "live"))
    for folder in (abandoned, users, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    (abandoned / EXPORT_LOCK).write_text("12345 host\n")  # its writer is gone: no process holds the lock
    held = lock_folder(str(live), EXPORT_LOCK, "--export_hf", "another export")
    code, out, err = script_cli(capsys, generate_tokens.main, "--init_from", model, "--export_hf", tmp_path / "out")
    assert code == 0, err
    assert not abandoned.exists() and users.exists() and live.exists()
    assert (tmp_path / "out" / "config.json").is_file() and not (tmp_path / "out" / EXPORT_LOCK).exists()
    unlock_folder(str(live), EXPORT_LOCK, held)
