"""CUDA-only checks (skipped without a GPU): compile, bf16, fused AdamW, and the evals inside a compiled run."""

import pytest
import torch

import train_gpt2
from conftest import make_shards, read_log, write_hellaswag
from nanogpt.optimizers import OptimizerSettings
from train_gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.cuda


def small_model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=128, n_layer=2, n_head=4, n_embd=128)).cuda()


def test_compiled_bf16_matches_eager_fp32():
    model = small_model()
    idx = torch.randint(0, 50257, (4, 128), device="cuda")
    with torch.no_grad():
        _, ref = model(idx, idx)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, eager_bf16 = model(idx, idx)
            _, compiled_bf16 = torch.compile(model)(idx, idx)
    assert abs(eager_bf16.item() - ref.item()) < 2e-2
    assert abs(compiled_bf16.item() - ref.item()) < 2e-2


def test_fused_adamw_on_cuda():
    opt = small_model().configure_optimizers(OptimizerSettings(max_lr=6e-4, weight_decay=0.1), "cuda")
    assert opt.defaults["fused"] is True


def test_kv_cache_greedy_equals_recompute_on_cuda():
    model = small_model().eval()
    prompt = torch.randint(0, 50257, (2, 5), device="cuda")
    a = model.generate(prompt, 40, temperature=0, use_cache=True)
    b = model.generate(prompt, 40, temperature=0, use_cache=False)
    assert torch.equal(a, b)


@torch.no_grad()
def test_compiled_sampling_step_matches_eager_on_cuda():
    """generate_tokens --compile (Inductor) on the key/value-cache step: each step's logits are the eager
    step's, up to TF32 rounding (~1e-3 relative; checked at 1e-2 of the logits' scale)."""
    import generate_tokens

    from train_gpt2 import KVCache

    eager, compiled = small_model().eval(), small_model().eval()
    generate_tokens.compile_for_sampling(compiled)
    tokens = torch.randint(0, 50257, (2, 12), device="cuda")
    caches = [KVCache(m.config, 2, 12, "cuda", torch.float32) for m in (eager, compiled)]
    for chunk in (tokens[:, :5], *tokens[:, 5:].split(1, dim=1)):  # the prompt, then one token at a time
        want, got = (m.decode_step(chunk, c) for m, c in zip((eager, compiled), caches))
        assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()


def test_compiled_run_with_val_hellaswag_samples_and_resume(tmp_path, capsys):
    data = make_shards(str(tmp_path / "data"), val_tokens=20000, train_tokens=(100000,))
    hs = str(tmp_path / "hs.jsonl")
    write_hellaswag(hs)
    log_dir = str(tmp_path / "log")
    flags = ["--model", "tiny", "--seq_len", "128", "--batch_size", "8", "--total_batch_size", "2048", "--warmup_steps", "2",
             "--eval_every", "3", "--val_steps", "2", "--hellaswag_every", "3", "--hellaswag_data", hs, "--sample_every", "3",
             "--save_every", "3", "--data_dir", data, "--log_dir", log_dir, "--device", "cuda"]
    train_gpt2.main([*flags, "--max_steps", "6"])
    out = capsys.readouterr().out
    assert "compile True" in out and "dtype bf16" in out
    log = read_log(log_dir)
    assert sorted(log["hella"]) == [0, 3, 5] and sorted(log["val"]) == [0, 3, 5]
    assert "sample 0: Hello, I'm a language model," in out
    train_gpt2.main([*flags, "--max_steps", "8", "--resume"])
    assert sorted(read_log(log_dir)["train"]) == list(range(8))
