"""GPTConfig is the one place of a model option (docs/layout.md): every field is a flag of train_gpt2.py, every
checkpoint holds the whole config, one check holds a --resume's and an --init_from's model flags to the model
the run has, and an exporter refuses any field it does not compute. The main test adds a model idea at run time
(a field and its use in MLP, nothing else) and follows it through training, checkpoints, load_model, sampling,
a resume and an export.

    python -m pytest -q tests/test_config.py
"""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import generate_tokens
import hellaswag
import train_gpt2
from conftest import (TINY_FLAGS, TINY_RUN_FLAGS, assert_cli_error, assert_refused_before_any_work, script_cli,
                      write_hellaswag)
from nanogpt.checkpoints import find_checkpoints, load_checkpoint, save_checkpoint
from nanogpt.cli import UserError
from nanogpt.config_fields import check_value, option
from nanogpt.hf import export_hf
from nanogpt.tokenizer import GPT2_VOCAB_SIZE


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    pass


def test_every_field_of_the_config_is_a_flag_with_its_help():
    """--<name> for each field (a bool also --no_<name>), with the help written beside the field; block_size is
    --seq_len's, as it always was."""
    parser = train_gpt2.build_parser()
    flags = {option: action for action in parser._actions for option in action.option_strings}
    for f in dataclasses.fields(train_gpt2.GPTConfig):
        if f.name == "block_size":
            assert f"--{f.name}" not in flags and flags["--seq_len"].dest == "seq_len"
            continue
        action = flags[f"--{f.name}"]
        assert action.dest == f.name and action.default is None and f.metadata["help"] in action.help
        if f.type is bool:
            assert flags[f"--no_{f.name}"].dest == f.name
    given = train_gpt2.parse_args(["--arch", "llama", "--mlp_hidden", "96", "--no_tie_embeddings", "--rope_theta", "5e5"])
    config = train_gpt2.model_config(given, None)
    assert (config.arch, config.mlp_hidden, config.tie_embeddings, config.rope_theta) == ("llama", 96, False, 5e5)


# -----------------------------------------------------------------------------
# A model idea added at run time: one field and its use in one class


@dataclasses.dataclass
class ConfigWithIdea(train_gpt2.GPTConfig):
    mlp_scale: float = option(1.0, "a test's model idea: the MLP's output times this")


@pytest.fixture
def idea(monkeypatch):
    """GPTConfig with the field mlp_scale, used by MLP: the two edits a model idea needs."""
    monkeypatch.setattr(train_gpt2, "GPTConfig", ConfigWithIdea)
    init, forward = train_gpt2.MLP.__init__, train_gpt2.MLP.forward

    def scaled_init(self, config):
        init(self, config)
        self.scale = config.mlp_scale

    monkeypatch.setattr(train_gpt2.MLP, "__init__", scaled_init)
    monkeypatch.setattr(train_gpt2.MLP, "forward", lambda self, x: forward(self, x) * self.scale)


def logits(model, seed=0):
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(idx)[0]


def test_a_new_field_is_a_flag_is_saved_rebuilds_resumes_and_refuses_what_it_must(idea, shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    flags = [*TINY_FLAGS, "--data_dir", shards, "--eval_every", "0", "--save_every", "1"]
    code, out, err = script_cli(capsys, train_gpt2.main, *flags, "--log_dir", log_dir, "--max_steps", "2",
                                "--mlp_scale", "0.5")
    assert code == 0, err
    assert "mlp_scale" in train_gpt2.build_parser().format_help()
    ckpt = load_checkpoint(find_checkpoints(str(log_dir))[0])
    assert ckpt["config"]["mlp_scale"] == 0.5

    # every script's way in rebuilds it, and the field is used: the same weights at 1.0 give other logits
    model = train_gpt2.load_model(str(log_dir))
    assert model.config.mlp_scale == 0.5 and all(block.mlp.scale == 0.5 for block in model.transformer.h)
    unscaled = train_gpt2.GPT(dataclasses.replace(model.config, mlp_scale=1.0))
    unscaled.load_state_dict(model.state_dict())
    assert (logits(model) - logits(unscaled.eval())).abs().max().item() > 1e-3
    code, out, err = script_cli(capsys, generate_tokens.main, "--checkpoint", log_dir, "--prompt", "Hi",
                                "--num_samples", "1", "--max_new_tokens", "4", "--device", "cpu")
    assert code == 0 and "--- sample 1/1 ---" in out, err
    data = write_hellaswag(str(tmp_path / "hs.jsonl"), n=4)
    code, out, err = script_cli(capsys, hellaswag.main, "--checkpoint", log_dir, "--data", data, "--device", "cpu")
    assert code == 0 and "acc_norm" in out, err

    # a resume keeps it; asking for another value is refused in one line, and nothing is written
    code, _, err = script_cli(capsys, train_gpt2.main, "--log_dir", log_dir, "--resume", "--max_steps", "3",
                              "--mlp_scale", "0.5")
    assert code == 0, err
    assert load_checkpoint(find_checkpoints(str(log_dir))[0])["config"]["mlp_scale"] == 0.5
    before = sorted(p.name for p in log_dir.iterdir())
    result = script_cli(capsys, train_gpt2.main, "--log_dir", log_dir, "--resume", "--max_steps", "4",
                        "--mlp_scale", "1.0")
    assert_cli_error(result, "--mlp_scale 1.0 conflicts with the checkpoint's model", "mlp_scale 0.5")
    assert sorted(p.name for p in log_dir.iterdir()) == before

    # no transformers class computes it: every export refuses it, naming it
    result = script_cli(capsys, generate_tokens.main, "--checkpoint", log_dir, "--export_hf", tmp_path / "hf")
    assert_cli_error(result, "--export_hf", "mlp_scale 1.0 only", "mlp_scale 0.5")
    assert not (tmp_path / "hf").exists()
    llama = train_gpt2.GPT(ConfigWithIdea(block_size=16, n_layer=1, n_head=2, n_embd=16, arch="llama", mlp_scale=2.0))
    with pytest.raises(train_gpt2.UserError, match="LlamaForCausalLM computes mlp_scale 1.0 only"):
        export_hf(llama, str(tmp_path / "hf"))

    # at its default the idea changes nothing an export must know; a checkpoint from before the field loads with it
    plain_dir = tmp_path / "plain"
    code, _, err = script_cli(capsys, train_gpt2.main, *flags, "--log_dir", plain_dir, "--max_steps", "1")
    assert code == 0, err
    code, out, err = script_cli(capsys, generate_tokens.main, "--checkpoint", plain_dir, "--export_hf", tmp_path / "hf")
    assert code == 0 and "GPT2LMHeadModel" in out, err
    path = find_checkpoints(str(plain_dir))[0]
    ckpt = load_checkpoint(path)
    del ckpt["config"]["mlp_scale"]
    save_checkpoint(path, ckpt)
    assert train_gpt2.load_model(path).config.mlp_scale == 1.0


def test_init_from_is_held_to_the_weights_model_by_every_field(tmp_path, shards, capsys):
    """The same check as a resume's: a model flag the weights do not have is refused, naming what they have;
    one they have is fine."""
    LlamaForCausalLM(LlamaConfig(vocab_size=GPT2_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                 rms_norm_eps=1e-6, rope_theta=500.0)).save_pretrained(tmp_path / "llama")
    flags = [*TINY_RUN_FLAGS, "--data_dir", shards, "--eval_every", "0", "--init_from", tmp_path / "llama"]
    for extra, named in ((["--qk_norm"], "qk_norm False"), (["--rope_theta", "10000"], "rope_theta 500.0"),
                         (["--mlp_hidden", "128"], "mlp_hidden 64"), (["--tie_embeddings"], "tie_embeddings False")):
        result = script_cli(capsys, train_gpt2.main, *flags, "--log_dir", tmp_path / "log", *extra)
        assert_cli_error(result, f"{' '.join(extra)}", f"conflicts with --init_from {tmp_path / 'llama'}", named)
        assert not (tmp_path / "log").exists()
    code, _, err = script_cli(capsys, train_gpt2.main, *flags, "--log_dir", tmp_path / "log", "--rope_theta", "500",
                              "--arch", "llama", "--mlp_hidden", "64", "--no_qk_norm")
    assert code == 0, err
    # with GPT-2 weights (or a GPT-2 run resumed), an option of --arch llama is refused as it is from scratch, even
    # at the value the GPT-2 has
    gpt2_dir = tmp_path / "gpt2_hf"
    code, _, err = script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--data_dir", shards, "--log_dir", tmp_path / "g",
                              "--max_steps", "1", "--eval_every", "0")
    assert code == 0, err
    code, _, err = script_cli(capsys, generate_tokens.main, "--checkpoint", tmp_path / "g", "--export_hf", gpt2_dir)
    assert code == 0, err
    for extra in (["--no_qk_norm"], ["--rope_theta", "10000"]):
        result = script_cli(capsys, train_gpt2.main, *TINY_RUN_FLAGS, "--data_dir", shards, "--log_dir", tmp_path / "x",
                            "--init_from", gpt2_dir, *extra)
        assert_cli_error(result, f"{extra[0]} is an option of --arch llama")
        result = script_cli(capsys, train_gpt2.main, "--log_dir", tmp_path / "g", "--resume", "--max_steps", "2", *extra)
        assert_cli_error(result, f"{extra[0]} is an option of --arch llama")


def test_a_gpt2_with_another_mlp_width_exports_with_transformers_logits(tmp_path):
    """mlp_hidden is GPT-2's n_inner: the export holds it, and transformers computes our logits."""
    torch.manual_seed(0)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, mlp_hidden=48)).eval()
    kind, _ = export_hf(model, str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert kind == "GPT2LMHeadModel" and hf.config.n_inner == 48
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(idx)[0][..., :GPT2_VOCAB_SIZE], hf(idx).logits
    assert (ours - theirs).abs().max().item() <= 1e-5 * ours.abs().max().item()


def test_an_architecture_no_export_knows_is_one_line(tmp_path):
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, arch="llama"))
    model.config.arch = "hybrid"  # what a fork's new architecture looks like to the exporter
    with pytest.raises(train_gpt2.UserError, match="no transformers class computes --arch hybrid; the architectures "
                                                   "that export are gpt2, llama"):
        export_hf(model, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("change,named", [
    (dict(arch="gpt2", n_kv_head=1), "n_kv_head 1, an option of --arch llama or speedrun, on a model of --arch gpt2"),
    (dict(arch="mamba"), "arch 'mamba'"),
    (dict(qk_norm=1), "qk_norm 1"),
    (dict(rope_theta=None), "rope_theta None"),  # only a field whose default is None may be None
    (dict(dropout=0.1), "fields this program does not know: dropout"),
    (dict(n_kv_head=3), "--n_kv_head 3 does not divide --n_head 2"),
])
def test_a_checkpoint_config_no_model_of_this_program_has_is_refused_by_name(shards, tmp_path, capsys, change, named):
    log_dir = tmp_path / "log"
    code, _, err = script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir,
                              "--max_steps", "1", "--eval_every", "0")
    assert code == 0, err
    path = find_checkpoints(str(log_dir))[0]
    ckpt = load_checkpoint(path)
    ckpt["config"].update(change)
    save_checkpoint(path, ckpt)
    result = script_cli(capsys, generate_tokens.main, "--checkpoint", path, "--prompt", "Hi", "--max_new_tokens", "1")
    assert_cli_error(result, path, named)


@pytest.mark.parametrize("extra,named", [
    (["--vocab_size", "1000"], "--vocab_size 1000: the GPT-2 tokenizer makes 50257 token ids"),
    (["--mlp_hidden", "0"], "--mlp_hidden 0: must be a whole number from 1"),
    (["--rope_theta", "inf", "--arch", "llama"], "--rope_theta inf: must be a finite number"),
    (["--mlp_hidden", "3000000000"], "--mlp_hidden 3000000000: must be a whole number from 1 to 2147483647"),
])
def test_bad_model_flags_are_one_line(shards, tmp_path, capsys, extra, named):
    assert_refused_before_any_work(capsys, shards, tmp_path, extra, named)


def test_a_count_whose_default_is_0_takes_0_for_off():
    @dataclasses.dataclass
    class Config:
        window: int = option(0, "a count, 0: off")
        layers: int = option(12, "a count")

    window, layers = dataclasses.fields(Config)
    check_value(window, 0)
    with pytest.raises(UserError, match="--window -1: must be a whole number from 0 to"):
        check_value(window, -1)
    with pytest.raises(UserError, match="--layers 0: must be a whole number from 1 to"):
        check_value(layers, 0)


def test_an_unpadded_gpt2_vocabulary_trains(shards, tmp_path, capsys):
    code, _, err = script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--data_dir", shards, "--log_dir", tmp_path / "log",
                              "--max_steps", "1", "--eval_every", "0", "--vocab_size", str(GPT2_VOCAB_SIZE))
    assert code == 0, err
    assert train_gpt2.load_model(str(tmp_path / "log")).lm_head.weight.shape[0] == GPT2_VOCAB_SIZE
