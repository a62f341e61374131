"""Beyond GPT-2's recipe (docs/recipes.md): --arch llama (RMSNorm, rotary positions, SwiGLU, grouped-query
attention, QK-norm) and --optimizer muon. The references are transformers' LlamaForCausalLM and
Qwen3ForCausalLM holding the same weights, the straight run for a resume, one process for DDP, the
uncached forward for the key/value cache.

    python -m pytest -q tests/test_modern_recipe.py
"""

import dataclasses
import os
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import generate_tokens
import hellaswag
import train_gpt2
from conftest import (TINY_FLAGS, TINY_RUN_FLAGS, assert_cli_error, assert_one_line_error, assert_same_norms,
                      assert_two_processes_train_like_one, copy_of_run, moved_from_init, numbers_logged, random_tokens,
                      read_log, run_script, script_cli, straight_and_resumed, torchrun, train, write_hellaswag)
from nanogpt import hellaswag_eval
from nanogpt.checkpoints import find_checkpoints, load_checkpoint
from nanogpt.hf import export_hf
from nanogpt.muon import Muon
from nanogpt.optimizers import OptimizerSettings
from nanogpt.tokenizer import GPT2_VOCAB_SIZE
from test_hellaswag import reference_losses

# one worker under -n 2 (conftest.py): the module's fixtures are made once
pytestmark = pytest.mark.xdist_group("test_modern_recipe")

LLAMA = ["--arch", "llama", "--n_head", "4", "--n_kv_head", "2"]  # TINY_FLAGS' 2 layers x 32 wide, 4 heads sharing 2
MODERN = [*LLAMA, "--optimizer", "muon", "--muon_lr", "0.02"]


def random_llama(seed=0, **overrides):
    """A llama in eval mode whose weights (norm gains included) are far from their initial values."""
    torch.manual_seed(seed)
    config = dict(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=64, arch="llama", n_kv_head=2,
                  rope_theta=500.0, tie_embeddings=False)
    return moved_from_init(train_gpt2.GPT(train_gpt2.GPTConfig(**{**config, **overrides})), 0.05)


def tokens(n=32, rows=2, seed=0):
    return random_tokens(rows, n, seed)


# -----------------------------------------------------------------------------
# The model against transformers


@pytest.mark.parametrize("family,overrides", [("LlamaForCausalLM", {}),
                                              ("Qwen3ForCausalLM", dict(qk_norm=True, tie_embeddings=True, n_kv_head=1)),
                                              ("LlamaForCausalLM", dict(n_kv_head=4, tie_embeddings=True))])
def test_export_is_a_transformers_model_with_our_logits_and_imports_back(tmp_path, family, overrides):
    """fp32 logits of ~2 in size through 2 blocks: the same float operations in another order agree to ~1e-6."""
    model = random_llama(**overrides)
    export_hf(model, str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == family and hf.config.vocab_size == GPT2_VOCAB_SIZE
    with torch.no_grad():
        ours, theirs = model(tokens())[0][..., :GPT2_VOCAB_SIZE], hf(tokens()).logits
        assert (ours - theirs).abs().max().item() <= 1e-5 * ours.abs().max().item()
        back = train_gpt2.load_model(init_from=str(tmp_path / "hf"))
        assert back.config.qk_norm == model.config.qk_norm and back.config.n_kv_head == model.config.n_kv_head
        assert (back(tokens())[0] - theirs).abs().max().item() <= 1e-5 * ours.abs().max().item()


def test_the_llama_arch_is_what_transformers_computes_not_gpt2(tmp_path):
    """The comparison above can fail: a llama whose rotation is left out (our GPT-2-style absolute positions
    are absent too) gives other logits than transformers' Llama."""
    model = random_llama()
    export_hf(model, str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    for block in model.transformer.h:
        block.attn.rotary.forward = lambda x, start: x
    with torch.no_grad():
        assert (model(tokens())[0][..., :GPT2_VOCAB_SIZE] - hf(tokens()).logits).abs().max().item() > 1e-2


@torch.no_grad()
def test_cached_chunks_continue_the_rotary_positions():
    """In float64 (as test_generate's GPT-2 check): the prompt, a chunk after it, one token and another chunk
    through the key/value cache give the logits of one uncached forward of the whole."""
    model = random_llama(qk_norm=True).double()
    idx = tokens(14, seed=2)
    full = model.lm_head(model.hidden_states(idx))
    cache = train_gpt2.KVCache(model.config, 2, 32, "cpu", torch.float64)
    assert cache.k.size(2) == 2  # the cache holds the key/value heads only
    parts = [model.lm_head(model.hidden_states(idx[:, a:b], cache)) for a, b in ((0, 5), (5, 9), (9, 10), (10, 14))]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-9 * full.abs().max().item()


@torch.no_grad()
def test_greedy_generation_with_the_cache_is_the_uncached_argmax():
    model = random_llama(seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(15)  # clear winners: rounding cannot flip an argmax
    idx = tokens(6, rows=2, seed=4)
    want = idx
    for _ in range(10):
        want = torch.cat([want, model(want)[0][:, -1, :GPT2_VOCAB_SIZE].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(idx, 10, temperature=0), want)
    sampled = model.generate(idx, 10, top_k=5, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 16) and int(sampled.max()) < GPT2_VOCAB_SIZE


# -----------------------------------------------------------------------------
# Training


@pytest.fixture(scope="module")
def modern_runs(tmp_path_factory, one_thread):
    """A 6-step llama + Muon run straight, and killed after step 3's checkpoint and resumed."""
    return straight_and_resumed(tmp_path_factory.mktemp("modern"), MODERN)


def test_a_resumed_muon_run_logs_exactly_the_straight_runs_losses(modern_runs):
    assert numbers_logged(modern_runs["straight"]) == numbers_logged(modern_runs["resumed"])
    ckpt = load_checkpoint(find_checkpoints(modern_runs["straight"])[0])
    assert set(ckpt["optimizer"]) == {"muon", "adamw"}  # Muon's momentum buffers are saved
    assert all("momentum_buffer" in s for s in ckpt["optimizer"]["muon"]["state"].values())
    assert ckpt["config"]["arch"] == "llama" and ckpt["config"]["n_kv_head"] == 2


def test_the_recipe_flag_on_resume_is_judged_by_what_it_stands_for(modern_runs, capsys):
    """The straight run was started as --arch llama --optimizer muon: --recipe modern is the same run, --recipe
    gpt2 (--arch gpt2 --optimizer adamw) is not."""
    log_dir = copy_of_run(modern_runs, "recipe_resume")
    result = script_cli(capsys, train_gpt2.main, "--log_dir", log_dir, "--resume", "--recipe", "gpt2")
    assert_cli_error(result, "--recipe gpt2", "conflicts with the checkpoint's arch llama, optimizer muon")
    code, _, err = script_cli(capsys, train_gpt2.main, "--log_dir", log_dir, "--resume", "--recipe", "modern",
                              "--max_steps", "7")
    assert code == 0, err
    assert read_log(log_dir)["train"][6] > 0  # step 6 was trained


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = random_llama(qk_norm=True)
    optimizer = model.configure_optimizers(OptimizerSettings("muon", 1e-3, 0.1, flags={"muon_lr": 0.02}), "cpu")
    muon = {id(p) for g in optimizer.matrices.param_groups for p in g["params"]}
    adamw = {id(p) for g in optimizer.adamw.param_groups for p in g["params"]}
    names = {id(p): name for name, p in model.named_parameters()}
    assert {names[i] for i in muon} == {n for n, p in model.named_parameters() if p.dim() == 2 and ".h." in n}
    assert {names[i] for i in adamw} == {"transformer.wte.weight", "lm_head.weight", *(
        n for n, p in model.named_parameters() if p.dim() == 1)}
    assert optimizer.matrices.param_groups[0]["lr_scale"] == pytest.approx(20)  # --muon_lr / --max_lr


def test_the_schedule_scales_muons_learning_rate_too(modern_runs, monkeypatch, capsys):
    """Each step's rates as the optimizers receive them: AdamW's the schedule's, Muon's x --muon_lr / --max_lr;
    the step line shows both."""
    seen = []
    real_step = Muon.step

    def recording_step(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(Muon, "step", recording_step)
    log_dir = str(modern_runs["tmp"] / "rates")
    train_gpt2.main([*modern_runs["flags"], "--log_dir", log_dir, "--max_steps", "3", "--eval_every", "0"])
    want = [train_gpt2.get_lr(s, 3e-3, 3e-4, 2, 3) * 0.02 / 3e-3 for s in range(3)]
    assert seen == pytest.approx(want, rel=1e-12)
    shown = re.findall(r"\| lr (\S+) \| muon lr (\S+) \| norm", capsys.readouterr().out)
    assert len(shown) == 3
    for (adamw, muon), rate in zip(shown, want):  # printed with 4 decimals of the mantissa
        assert float(muon) == pytest.approx(rate, rel=5e-5) and float(adamw) == pytest.approx(rate * 3e-3 / 0.02, rel=5e-5)


def test_recompute_is_the_same_llama_run(modern_runs, one_thread):
    log_dir = str(modern_runs["tmp"] / "recompute")
    train_gpt2.main([*modern_runs["flags"], "--log_dir", log_dir, "--recompute"])
    assert numbers_logged(log_dir) == numbers_logged(modern_runs["straight"])


@pytest.mark.slow  # torchrun or torch.compile: the full suite's
def test_two_processes_train_like_one(modern_runs, capsys):
    assert_two_processes_train_like_one(modern_runs, capsys)


@pytest.mark.slow  # torchrun or torch.compile: the full suite's
def test_llama_trains_compiled_like_eager(modern_runs, one_thread):
    """torch.compile on the CPU (inductor's C++ code): the same losses within float reordering."""
    flags = [*modern_runs["flags"], "--eval_every", "0", "--max_steps", "2"]
    train_gpt2.main([*flags, "--log_dir", str(modern_runs["tmp"] / "compiled"), "--compile"])
    eager, compiled = read_log(modern_runs["straight"])["train"], read_log(str(modern_runs["tmp"] / "compiled"))["train"]
    assert all(abs(eager[s] - compiled[s]) < 1e-4 for s in (0, 1)), (eager, compiled)


@pytest.mark.slow  # torchrun or torch.compile: the full suite's
def test_llama_under_fsdp_trains_like_ddp(modern_runs):
    """FSDP2 shards the llama Block by Block (the untied head and the embedding on the root) with AdamW."""
    flags = [*TINY_FLAGS, *LLAMA, "--data_dir", modern_runs["data"], "--max_steps", "3", "--eval_every", "0",
             "--total_batch_size", "512"]
    runs = {mode: torchrun(2, *flags, "--log_dir", str(modern_runs["tmp"] / f"llama_{mode}"), *extra)
            for mode, extra in (("ddp", []), ("fsdp", ["--fsdp"]))}
    for result in runs.values():
        assert result.returncode == 0, result.stderr[-3000:]
    a, b = (read_log(str(modern_runs["tmp"] / f"llama_{mode}"))["train"] for mode in ("ddp", "fsdp"))
    assert all(abs(a[s] - b[s]) <= 1e-6 + 16 * 2**-24 * a[s] for s in a), (a, b)  # test_scale's bound
    assert_same_norms(runs["ddp"].stdout, runs["fsdp"].stdout, range(3))


# -----------------------------------------------------------------------------
# The other scripts


def test_export_of_a_run_scores_the_runs_validation_loss_in_transformers(modern_runs, tmp_path, capsys):
    """The exported weights after step 1 have, in transformers, the mean loss on the validation batches that
    the run logged at step 2 (evaluated before step 2's update)."""
    code, out, err = script_cli(capsys, generate_tokens.main, "--checkpoint",
                                os.path.join(modern_runs["straight"], "model_00001.pt"), "--export_hf", tmp_path / "hf")
    assert code == 0 and "LlamaForCausalLM" in out, err
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    loader = train_gpt2.DataLoaderLite(modern_runs["data"], "val", 4, 32)
    with torch.no_grad():
        losses = []
        for _ in range(2):  # TINY_FLAGS' --val_steps
            x, y = loader.next_batch()
            losses.append(F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item())
    assert abs(sum(losses) / 2 - read_log(modern_runs["straight"])["val"][2]) <= 5e-5 + 1e-5  # 4 decimals in the log
    # and --init_from that folder trains on from its weights: step 0's loss is the folder's on that batch
    log_dir = str(tmp_path / "more")
    train_gpt2.main([*TINY_RUN_FLAGS, "--data_dir", modern_runs["data"], "--log_dir", log_dir, "--init_from",
                     str(tmp_path / "hf"), "--eval_every", "0", "--total_batch_size", "128", "--optimizer", "muon"])
    x, y = train_gpt2.DataLoaderLite(modern_runs["data"], "train", 4, 32).next_batch()
    with torch.no_grad():
        first = F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(read_log(log_dir)["train"][0] - first) <= 5e-7 + 1e-5


def test_sampling_int8_and_hellaswag_on_a_llama_checkpoint(modern_runs, tmp_path, capsys):
    code, out, err = script_cli(capsys, generate_tokens.main, "--checkpoint", modern_runs["straight"], "--int8",
                                "--prompt", "Hello", "--num_samples", "1", "--max_new_tokens", "5")
    assert code == 0 and "--- sample 1/1 ---" in out, err
    data = write_hellaswag(str(tmp_path / "hs.jsonl"), n=8)
    code, out, err = script_cli(capsys, generate_tokens.main, "--checkpoint", modern_runs["straight"], "--export_hf",
                                tmp_path / "hf")
    assert code == 0, err
    # acc_norm's count from transformers' model in float64; an example whose two best endings are within fp32's
    # rounding of each other may go either way
    examples = hellaswag_eval.load_examples(data)
    means = [sorted((row[i][0] / row[i][1], i) for i in range(4)) for row in reference_losses(str(tmp_path / "hf"),
                                                                                             examples)]
    want = sum(m[0][1] == ex["label"] for m, ex in zip(means, examples))
    close = sum(m[1][0] - m[0][0] < 1e-4 for m in means)
    result = script_cli(capsys, hellaswag.main, "--checkpoint", modern_runs["straight"], "--data", data, "--device", "cpu")
    assert result[0] == 0, result[2]
    got = int(re.search(r"acc_norm [\d.]+ \((\d+)/8\)", result[1]).group(1))
    assert abs(got - want) <= close, (result[1], want, close)
    # the in-loop HellaSwag of a llama run
    log_dir = str(tmp_path / "loop")
    flags = list(TINY_FLAGS)
    flags[flags.index("--hellaswag_every") + 1] = "1"
    train_gpt2.main([*flags, *MODERN, "--data_dir", modern_runs["data"], "--log_dir", log_dir, "--max_steps", "1",
                     "--eval_every", "0", "--hellaswag_data", data])
    assert sorted(read_log(log_dir)["hella"]) == [0]


# -----------------------------------------------------------------------------
# Bad combinations: one line each, before any work


@pytest.mark.parametrize("extra,named", [
    (["--arch", "llama", "--n_kv_head", "3"], "--n_kv_head 3 does not divide --n_head 4"),
    (["--qk_norm"], "--qk_norm is an option of --arch llama"),
    (["--n_kv_head", "2"], "--n_kv_head is an option of --arch llama"),
    (["--no_tie_embeddings"], "--no_tie_embeddings is an option of --arch llama"),
    (["--optimizer", "muon", "--zero", "1"], "--optimizer muon trains with DDP only, not --zero 1"),
    (["--optimizer", "muon", "--fsdp"], "--optimizer muon trains with DDP only, not --fsdp"),
    (["--muon_lr", "0.1"], "--muon_lr does nothing with --optimizer adamw"),
    (["--arch", "llama", "--rope_theta", "0"], "--rope_theta 0.0: must be a finite number >= 1"),
])
def test_bad_combinations_are_one_line(shards, tmp_path, capsys, extra, named):
    flags = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", tmp_path / "log", "--max_steps", "1", "--n_head", "4"]
    assert_cli_error(script_cli(capsys, train_gpt2.main, *flags, *extra), named)
    assert not (tmp_path / "log").exists()


def test_a_gpt2_checkpoint_resumed_as_llama_and_gpt2_weights_as_llama_are_refused(shards, tmp_path, capsys):
    log_dir = tmp_path / "log"
    train(shards, str(log_dir), "--max_steps", "1", "--eval_every", "0")
    result = script_cli(capsys, train_gpt2.main, "--log_dir", log_dir, "--resume", "--max_steps", "2", "--arch", "llama")
    assert_cli_error(result, "--arch llama conflicts with the checkpoint's model, which has", "arch gpt2")
    code, _, err = script_cli(capsys, generate_tokens.main, "--checkpoint", log_dir, "--export_hf", tmp_path / "hf")
    assert code == 0, err
    result = script_cli(capsys, train_gpt2.main, *TINY_FLAGS[TINY_FLAGS.index("--seq_len"):], "--data_dir", shards,
                        "--log_dir", tmp_path / "x", "--init_from", tmp_path / "hf", "--arch", "llama")
    assert_cli_error(result, "--arch llama conflicts with --init_from", "arch gpt2")


def test_another_vocabulary_is_one_line(shards, tmp_path, capsys):
    config = LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    result = script_cli(capsys, train_gpt2.main, *TINY_FLAGS[TINY_FLAGS.index("--seq_len"):], "--data_dir", shards,
                        "--log_dir", tmp_path / "x", "--init_from", tmp_path / "llama")
    assert_cli_error(result, "vocab_size 32000 (not the GPT-2 tokenizer's 50257 token ids")


def test_the_gpt2_path_keeps_its_checkpoint_layout(shards, tmp_path):
    """--arch gpt2 --optimizer adamw (the defaults): AdamW's own state dict, as checkpoints always held it, and
    the whole model config (a checkpoint of GPT-2's five fields from before loads: tests/test_old_checkpoint.py)."""
    train(shards, str(tmp_path / "log"), "--max_steps", "1", "--eval_every", "0")
    ckpt = load_checkpoint(find_checkpoints(str(tmp_path / "log"))[0])
    assert ckpt["config"] == dataclasses.asdict(train_gpt2.load_model(str(tmp_path / "log")).config)
    assert sorted(ckpt["config"]) == sorted(f.name for f in dataclasses.fields(train_gpt2.GPTConfig))
    assert set(ckpt["optimizer"]) == {"state", "param_groups"} and len(ckpt["optimizer"]["param_groups"]) == 2
    assert all("lr_scale" not in g for g in ckpt["optimizer"]["param_groups"])
    assert "schedule" not in ckpt


def test_the_modern_recipe_is_one_flag(shards, tmp_path):
    args = train_gpt2.parse_args(["--recipe", "modern"])
    assert (args.arch, args.optimizer) == ("llama", "muon")
    assert train_gpt2.parse_args(["--recipe", "modern", "--optimizer", "adamw"]).optimizer == "adamw"  # flags win
    result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"),
                         "--max_steps", "1", "--recipe", "modern", "--n_head", "4", "--n_kv_head", "3"])
    assert_one_line_error(result, "--n_kv_head 3 does not divide --n_head 4")
