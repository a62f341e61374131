"""--init_from against transformers: which Hugging Face directories our GPT can stand in for (the same
logits as transformers' model of them), the one-line refusal of those it cannot in every script that
takes --init_from, the memory check and the shape flags of an --init_from run, and the shape flags of
a resumed run compared with the model the checkpoint holds.

    python -m pytest -q tests/test_init_from.py
"""

import os
import re

import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

import generate_tokens
import hellaswag
import train_gpt2
from nanogpt import arguments
from nanogpt.checkpoints import find_checkpoints, load_checkpoint
from nanogpt.hf import hf_to_our_state_dict
from conftest import (TINY_FLAGS, TINY_RUN_FLAGS, assert_cli_error, assert_one_line_error, read_log, run_script,
                      script_cli, train, write_hellaswag)

SHAPE = dict(n_layer=2, n_head=2, n_embd=32)  # TINY_FLAGS' shape

# GPT-2 settings transformers computes with that our GPT computes too, the same or in another precision
SAME_MATH = {"default": {}, "gelu_pytorch_tanh": dict(activation_function="gelu_pytorch_tanh"),
             "gelu_fast": dict(activation_function="gelu_fast"), "n_inner_4x": dict(n_inner=4 * SHAPE["n_embd"]),
             "reorder_and_upcast_attn": dict(reorder_and_upcast_attn=True), "padded_vocab": dict(vocab_size=50304),
             "n_inner_100": dict(n_inner=100)}  # another MLP width: GPTConfig's mlp_hidden
# ... and those it computes otherwise: (settings, what the refusal names)
OTHER_MATH = {
    "untied": (dict(tie_word_embeddings=False), "tie_word_embeddings false"),
    "relu": (dict(activation_function="relu"), "activation_function relu"),
    "exact_gelu": (dict(activation_function="gelu"), "activation_function gelu"),
    "layer_norm_eps": (dict(layer_norm_epsilon=1e-3), "layer_norm_epsilon 0.001"),
    "unscaled_attention": (dict(scale_attn_weights=False), "scale_attn_weights false"),
    "inverse_layer_idx": (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx true"),
}
# ... and those it has no room for: token ids of GPT-2's tokenizer, extra weights
NOT_LOADABLE = {
    "small_vocab": (dict(vocab_size=1000), "vocab_size 1000"),
    "cross_attention": (dict(add_cross_attention=True), "add_cross_attention true"),
}
REFUSED = {**OTHER_MATH, **NOT_LOADABLE}
ROUNDING = 1e-5  # fp32 logits of the same math agree this closely (about 1e-7 here); other math, not within 10x


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    pass


def save_gpt2(path, **settings):
    """A random transformers GPT-2 of TINY_FLAGS' shape (context 64) saved to path; weights larger than
    the 0.02 init and LayerNorm gains and biases away from 1 and 0, so that a setting that changes the
    math changes the logits clearly."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, **SHAPE, **settings))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1) if p.dim() == 1 else p.normal_(0, 0.1)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{case: a saved directory} for every case above, and a BERT."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {name: save_gpt2(root / name, **settings) for name, settings in SAME_MATH.items()}
    dirs.update({name: save_gpt2(root / name, **settings) for name, (settings, _) in REFUSED.items()})
    bert = BertModel(BertConfig(vocab_size=50304, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=128))
    bert.save_pretrained(root / "bert")
    dirs["bert"] = str(root / "bert")
    return dirs


def hf_logits(path, idx):
    with torch.no_grad():
        return GPT2LMHeadModel.from_pretrained(path).eval()(idx).logits


def tokens(n=40):
    return torch.randint(0, train_gpt2.GPT2_VOCAB_SIZE, (2, n), generator=torch.Generator().manual_seed(0))


def files_under(path):
    return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs}


@pytest.mark.parametrize("case", SAME_MATH)
def test_settings_our_gpt_computes_load_and_give_transformers_logits(hf_dirs, case):
    ours = train_gpt2.GPT.from_pretrained(hf_dirs[case]).eval()
    with torch.no_grad():
        logits, _ = ours(tokens())
    assert (logits - hf_logits(hf_dirs[case], tokens())).abs().max().item() < ROUNDING


@pytest.mark.parametrize("case", OTHER_MATH)
def test_the_refused_settings_would_give_other_logits(hf_dirs, case):
    """Why they are refused: our GPT holding the same tensors computes something else than transformers."""
    hf = GPT2LMHeadModel.from_pretrained(hf_dirs[case])
    ours = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=64, vocab_size=hf.config.vocab_size, **SHAPE)).eval()
    ours.load_state_dict(hf_to_our_state_dict(hf.state_dict()))
    with torch.no_grad():
        logits, _ = ours(tokens())
    assert (logits - hf_logits(hf_dirs[case], tokens())).abs().max().item() > 10 * ROUNDING


@pytest.mark.parametrize("case", [*REFUSED, "bert"])
def test_what_our_gpt_cannot_compute_is_refused_before_loading(hf_dirs, case, monkeypatch):
    needle = REFUSED[case][1] if case in REFUSED else "'bert' model, not GPT-2"
    loaded = []
    monkeypatch.setattr(GPT2LMHeadModel, "from_pretrained", lambda *a, **k: loaded.append(a))
    with pytest.raises(train_gpt2.UserError, match=needle):
        train_gpt2.pretrained_config(hf_dirs[case])
    with pytest.raises(train_gpt2.UserError, match=needle):
        train_gpt2.load_model(init_from=hf_dirs[case])  # hellaswag.py's and generate_tokens.py's way in
    assert not loaded


@pytest.mark.parametrize("case", ["small_vocab", "bert", "untied"])
def test_train_refuses_in_one_line_and_writes_nothing(hf_dirs, shards, tmp_path, capsys, case):
    """A vocabulary smaller than GPT-2's (else an IndexError in step 0), a BERT (else 87 lines of load report,
    then an IndexError) and an untied GPT-2 (else trained silently as a different model)."""
    log_dir = tmp_path / "log"
    before = files_under(hf_dirs[case])
    result = script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir,
                        "--max_steps", "1", "--init_from", hf_dirs[case])
    assert_cli_error(result, f"--init_from {hf_dirs[case]}")
    assert not log_dir.exists()  # nothing written, no empty folder
    assert files_under(hf_dirs[case]) == before


def test_hellaswag_and_generate_refuse_in_one_line(hf_dirs, tmp_path, capsys):
    data = write_hellaswag(str(tmp_path / "hs.jsonl"))
    result = script_cli(capsys, hellaswag.main, "--init_from", hf_dirs["untied"], "--data", data, "--device", "cpu")
    assert_cli_error(result, "tie_word_embeddings false")
    result = script_cli(capsys, generate_tokens.main, "--init_from", hf_dirs["bert"], "--prompt", "Hi",
                        "--device", "cpu")
    assert_cli_error(result, "'bert' model, not GPT-2")
    out_dir = tmp_path / "export"
    result = script_cli(capsys, generate_tokens.main, "--init_from", hf_dirs["small_vocab"], "--export_hf", out_dir)
    assert_cli_error(result, "vocab_size 1000")
    assert not out_dir.exists()


@pytest.fixture(scope="module")
def lacking_weights(tmp_path_factory):
    """A GPT-2 directory whose weights lack the second block's tensors: transformers would make them up."""
    from safetensors.torch import load_file, save_file

    path = save_gpt2(tmp_path_factory.mktemp("hf") / "lacking")
    weights = load_file(os.path.join(path, "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".h.1." not in k}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path


def test_missing_weights_are_refused_not_made_up(lacking_weights):
    with pytest.raises(train_gpt2.UserError, match=r"its weights lack \d+ tensors of a GPT-2"):
        train_gpt2.GPT.from_pretrained(lacking_weights)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["small_vocab", "lacking"])
def test_transformers_adds_nothing_to_the_one_line(hf_dirs, lacking_weights, shards, tmp_path, case):
    """transformers warns about a config (token ids outside a 1000-token vocabulary) and reports weights it
    makes up in many lines, on a stream only a real process shows (not capsys): the error stays one line."""
    path = lacking_weights if case == "lacking" else hf_dirs[case]
    result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"),
                         "--max_steps", "1", "--init_from", path])
    assert_one_line_error(result, f"--init_from {path}")


def needs_gib(message):
    return float(message.split("needs at least ")[1].split(" GiB")[0])


def test_the_memory_check_covers_init_from_runs(hf_dirs, shards, tmp_path, monkeypatch):
    """A batch whose logits cannot fit is refused for an --init_from run as for a scratch run of its shape."""
    monkeypatch.setattr(arguments, "available_memory_bytes", lambda: 8 * 2**30)
    big = ["--batch_size", "1500", "--total_batch_size", "48000", "--data_dir", shards, "--max_steps", "1"]
    with pytest.raises(train_gpt2.UserError, match="needs at least") as scratch:
        train_gpt2.main([*TINY_FLAGS, *big, "--log_dir", str(tmp_path / "a")])
    monkeypatch.setattr(train_gpt2.GPT, "from_pretrained", lambda name: pytest.fail("refused after loading"))
    with pytest.raises(train_gpt2.UserError, match=r"needs at least .* than --init_from") as init_from:
        train_gpt2.main([*TINY_RUN_FLAGS, *big, "--log_dir", str(tmp_path / "b"), "--init_from", hf_dirs["default"]])
    # the same shape; the HF model's vocabulary is 50257, the scratch model's padded to 50304
    assert needs_gib(str(init_from.value)) == pytest.approx(needs_gib(str(scratch.value)), rel=0.01)


@pytest.mark.parametrize("name,params", [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168),
                                         ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)])
def test_hub_names_have_their_models_shapes_without_a_download(name, params, monkeypatch):
    """The parameter counts of OpenAI's checkpoints on the hub; nothing is fetched (no network here)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = train_gpt2.pretrained_config(name)
    with torch.device("meta"):
        assert train_gpt2.GPT(config).num_params() == params
    assert (config.block_size, config.vocab_size) == (1024, train_gpt2.GPT2_VOCAB_SIZE)


def test_a_hub_model_too_big_for_memory_is_refused_before_any_download(shards, tmp_path, monkeypatch):
    monkeypatch.setattr(arguments, "available_memory_bytes", lambda: 4 * 2**30)  # gpt2-xl's fp32 weights: 5.8 GiB
    monkeypatch.setattr(train_gpt2.GPT, "from_pretrained", lambda name: pytest.fail("refused after loading"))
    with pytest.raises(train_gpt2.UserError, match="weights alone need .* than --init_from gpt2-xl"):
        train_gpt2.main([*TINY_RUN_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"),
                         "--init_from", "gpt2-xl"])


@pytest.mark.parametrize("flags,named", [(["--n_layer", "8"], "--n_layer 8"), (["--n_head", "4"], "--n_head 4"),
                                         (["--n_embd", "64"], "--n_embd 64"),
                                         (["--model", "tiny", "--n_layer", "3"], "--n_layer 3"),
                                         (["--n_layer", "2", "--n_embd", "16"], "--n_embd 16")])
def test_shape_flags_that_conflict_with_init_from_are_refused(hf_dirs, shards, tmp_path, capsys, flags, named):
    result = script_cli(capsys, train_gpt2.main, *TINY_RUN_FLAGS, "--data_dir", shards, "--log_dir", tmp_path / "log",
                        "--init_from", hf_dirs["default"], *flags)
    assert_cli_error(result, named, "conflicts with --init_from", "n_layer 2, n_head 2, n_embd 32")
    assert not (tmp_path / "log").exists()


def test_a_preset_with_init_from_brings_its_run_settings_and_the_weights_their_shape(hf_dirs, shards, tmp_path, capsys):
    """--model tiny (4 x 128) on a 2 x 32 directory: a fine-tuning command, not a conflict. The run has the
    weights' shape and tiny's run settings (save_every 0, eval_every 10), and its header says so."""
    log_dir = str(tmp_path / "log")
    code, out, err = script_cli(capsys, train_gpt2.main, *TINY_RUN_FLAGS, "--data_dir", shards, "--log_dir", log_dir,
                                "--init_from", hf_dirs["default"], "--model", "tiny")
    assert code == 0, err
    assert f"weights from --init_from {hf_dirs['default']}, with their shape; --model tiny brings only its run" in out
    assert "trained without dropout" in out
    ckpt = load_checkpoint(find_checkpoints(log_dir)[0])
    assert {k: ckpt["config"][k] for k in SHAPE} == SHAPE
    assert (ckpt["args"]["save_every"], ckpt["args"]["eval_every"]) == (0, 10) == (
        train_gpt2.RUN_PRESETS["tiny"]["save_every"], train_gpt2.RUN_PRESETS["tiny"]["eval_every"])


def test_shape_flags_that_agree_with_init_from_train_its_weights(hf_dirs, shards, tmp_path):
    """TINY_FLAGS give --model tiny with the directory's own shape: the run trains the loaded weights."""
    log_dir = str(tmp_path / "log")
    train(shards, log_dir, "--init_from", hf_dirs["default"], "--max_steps", "1", "--eval_every", "0",
          "--save_every", "0", "--warmup_steps", "0", "--max_lr", "1e-9")  # the weights barely move
    ours = train_gpt2.load_model(find_checkpoints(log_dir)[0]).eval()
    with torch.no_grad():
        logits, _ = ours(tokens())
    assert (logits - hf_logits(hf_dirs["default"], tokens())).abs().max().item() < 1e-3


def test_mfu_counts_the_sequences_trained_on_not_the_weights_context(hf_dirs, shards, tmp_path, capsys):
    """--seq_len 32 on weights with a context of 64: the attention FLOPs of the MFU are those of 32-token
    sequences. FLOPs per token from the step line (a tiny --peak_tflops makes its MFU a number of 7 digits),
    against 6N + 12·L·C·T with N the weights of the transformers model's matrix multiplications (its 2-D ones but
    the position embedding, a lookup)."""
    train(shards, str(tmp_path / "log"), "--init_from", hf_dirs["default"], "--max_steps", "2", "--eval_every", "0",
          "--save_every", "0", "--peak_tflops", "1e-6")
    hf = GPT2LMHeadModel.from_pretrained(hf_dirs["default"])
    n = sum(p.numel() for p in hf.parameters() if p.dim() == 2) - hf.transformer.wpe.weight.numel()
    want = {T: 6 * n + 12 * SHAPE["n_layer"] * SHAPE["n_embd"] * T for T in (32, 64)}
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ") and "| mfu " in ln]
    assert len(lines) == 2
    for line in lines:
        dt_ms, mfu = (float(re.search(pattern, line).group(1)) for pattern in (r"dt ([\d.]+)ms", r"mfu ([\d.]+)%"))
        flops_per_token = mfu / 100 * 1e6 / (256 / (dt_ms / 1000))  # TINY_FLAGS: 256 tokens a step
        rounding = 0.005 / dt_ms + 0.05 / mfu  # both printed rounded to their last digit: relative error bound
        assert rounding < abs(want[64] - want[32]) / want[32] / 2  # fine enough to tell the two T apart
        assert abs(flops_per_token - want[32]) <= 1.01 * rounding * want[32], (line, want)


def test_seq_len_beyond_the_weights_context_is_refused_before_loading(hf_dirs, shards, tmp_path, monkeypatch):
    monkeypatch.setattr(train_gpt2.GPT, "from_pretrained", lambda name: pytest.fail("refused after loading"))
    refusal = f"--seq_len 128 exceeds --init_from {hf_dirs['default']}'s context of 64"
    with pytest.raises(train_gpt2.UserError, match=re.escape(refusal)):
        train_gpt2.main([*TINY_RUN_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"), "--seq_len", "128",
                         "--total_batch_size", "512", "--init_from", hf_dirs["default"]])


def test_resume_compares_shape_flags_with_the_checkpoints_model(hf_dirs, shards, tmp_path):
    """A --model tiny run gave no --n_layer (its preset's 4 is in the checkpoint's model config):
    --resume --n_layer 4 is that run, --n_layer 3 is not, and the refusal says 4."""
    log_dir = str(tmp_path / "log")
    flags = [*TINY_RUN_FLAGS, "--model", "tiny", "--data_dir", shards, "--log_dir", log_dir, "--eval_every", "0"]
    train_gpt2.main([*flags, "--max_steps", "1"])
    train_gpt2.main([*flags, "--max_steps", "2", "--resume", "--n_layer", "4", "--n_embd", "128"])
    assert sorted(read_log(log_dir)["train"]) == [0, 1]
    before = files_under(log_dir)
    with pytest.raises(train_gpt2.UserError, match="--n_layer 3 conflicts with the checkpoint's model, which has n_layer 4,"):
        train_gpt2.main([*flags, "--max_steps", "3", "--resume", "--n_layer", "3"])
    with pytest.raises(train_gpt2.UserError, match="--n_embd 64 conflicts with the checkpoint's model, which has n_layer 4, n_head 4, n_embd 128,"):
        train_gpt2.main([*flags, "--max_steps", "3", "--resume", "--n_embd", "64"])
    assert files_under(log_dir) == before


def test_resume_of_an_init_from_run_takes_its_shape_flags(hf_dirs, shards, tmp_path):
    log_dir = str(tmp_path / "log")
    flags = [*TINY_RUN_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--eval_every", "0",
             "--init_from", hf_dirs["default"]]
    train_gpt2.main([*flags, "--max_steps", "1"])
    train_gpt2.main([*flags, "--max_steps", "2", "--resume", "--n_embd", "32"])
    assert sorted(read_log(log_dir)["train"]) == [0, 1]
    with pytest.raises(train_gpt2.UserError, match="--n_head 4 conflicts with the checkpoint's model, which has n_layer 2, n_head 2,"):
        train_gpt2.main([*flags, "--max_steps", "3", "--resume", "--n_head", "4"])
