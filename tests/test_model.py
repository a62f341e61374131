"""The GPT module against transformers' GPT2LMHeadModel, its shapes, init and optimizer groups."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from nanogpt.cli import UserError
from nanogpt.optimizers import OptimizerSettings
from train_gpt2 import GPT, MODEL_PRESETS, GPTConfig


def hf_tiny(tmp_path, **kw):
    cfg = dict(n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=50257)
    cfg.update(kw)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(**cfg)).eval()
    with torch.no_grad():  # non-zero biases and LayerNorm params, so a mis-mapped one shows
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    path = tmp_path / "hf"
    hf.save_pretrained(path)
    return hf, str(path)


def test_parameter_count_matches_transformers():
    # GPT-2 124M: our d12 with the unpadded vocab has exactly as many parameters as HF's model
    ours = GPT(GPTConfig(vocab_size=50257, **MODEL_PRESETS["d12"]))
    hf = GPT2LMHeadModel(GPT2Config())
    assert ours.num_params() == sum(p.numel() for p in hf.parameters()) == 124_439_808


@pytest.mark.parametrize("name,params", [("d24", 354_823_168), ("d36", 774_030_080), ("d48", 1_557_611_200)])
def test_presets_have_the_gpt2_family_sizes(name, params):
    """gpt2-medium / large / xl as OpenAI released them (parameter counts of the HF checkpoints,
    tied embeddings, vocabulary 50257); built on the meta device, so no memory is used."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50257, **MODEL_PRESETS[name]))
    assert model.num_params() == params


def test_logits_equal_transformers(tmp_path):
    """Both in float64 with the same weights: only the order of the sums differs. Dot products of
    length <= 4 * 64 through ~10 chained ops round by < 1e3 * 256 * eps64 = 6e-11 of the logits'
    scale; the bound, 1e-9 of it, sits far below float32's rounding and below what a slip shows
    (exact GELU for GPT-2's tanh GELU: ~1e-6)."""
    hf, path = hf_tiny(tmp_path)
    ours = GPT.from_pretrained(path).eval()
    idx = torch.randint(0, 50257, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf.double()(idx).logits
        logits, _ = ours.double()(idx)
    assert logits.shape == ref.shape and logits.dtype == torch.float64
    assert (logits - ref).abs().max().item() <= 1e-9 * ref.abs().max().item()


def test_loss_is_cross_entropy_of_logits(tmp_path):
    """In float64, against the definition: mean over the 64 positions of logsumexp(z) - z[target].
    Sums of 300 and 64 terms: rounding below (300 + 64) * eps64 of the terms' scale."""
    model = GPT(GPTConfig(block_size=32, vocab_size=300, n_layer=2, n_head=2, n_embd=32)).double()
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 300, (2, 32), generator=g), torch.randint(0, 300, (2, 32), generator=g)
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 32, 300) and loss.dtype == torch.float64
    z, t = logits.detach().reshape(-1, 300), targets.reshape(-1)
    ref = (z.logsumexp(1) - z[torch.arange(64), t]).mean()
    eps64 = torch.finfo(torch.float64).eps
    assert abs(loss.item() - ref.item()) <= (300 + 64) * eps64 * (ref.item() + z.abs().max().item())


def test_causal_no_peeking_at_future():
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=2, n_head=2, n_embd=32)).eval().double()
    a = torch.randint(0, 100, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 100
    with torch.no_grad():
        la, _ = model(a)
        lb, _ = model(b)
    # exactly, in float64: positions < 10 do the same operations on the same numbers, and later keys
    # get a weight of exactly 0 (a leak as faint as e^-20 would show)
    assert torch.equal(la[0, :10], lb[0, :10])
    assert not torch.allclose(la[0, 10:], lb[0, 10:], atol=1e-3)


def test_weight_tying_and_init():
    torch.manual_seed(0)
    n_layer = 8
    model = GPT(GPTConfig(block_size=64, vocab_size=4000, n_layer=n_layer, n_head=4, n_embd=256))
    assert model.lm_head.weight is model.transformer.wte.weight
    block = model.transformer.h[0]
    assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.002
    scaled = 0.02 / math.sqrt(2 * n_layer)
    assert abs(block.attn.c_proj.weight.std().item() - scaled) < 0.1 * scaled
    assert abs(block.mlp.c_proj.weight.std().item() - scaled) < 0.1 * scaled
    assert block.attn.c_attn.bias.abs().max().item() == 0


def test_optimizer_decays_only_2d_tensors():
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=2, n_head=2, n_embd=32))
    opt = model.configure_optimizers(OptimizerSettings(max_lr=1e-3, weight_decay=0.1), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8


SHAPES = [dict(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768),
          dict(block_size=64, vocab_size=500, n_layer=3, n_head=4, n_embd=64)]


def hf_twin(shape):
    config = GPT2Config(vocab_size=shape["vocab_size"], n_positions=shape["block_size"], n_embd=shape["n_embd"],
                        n_layer=shape["n_layer"], n_head=shape["n_head"])
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


@pytest.mark.parametrize("shape", SHAPES)
def test_flops_per_token_are_the_models_matmuls(shape):
    """MFU's FLOPs, counted on the model: 6 per weight of a matrix multiplication (forward, and backward's two
    gradients) and 12·L·C·T for attention's scores and mixing (nanoGPT's estimate_mfu's term), T the context. The
    weights from transformers' GPT-2 of the same shape: its 2-D ones less the position embedding (a lookup; the
    token embedding is the tied head, a matmul). nanoGPT's 6N also counts the 1-D ones, which multiply nothing."""
    hf = hf_twin(shape)
    with torch.device("meta"):
        ours = GPT(GPTConfig(**shape))
    n = sum(p.numel() for p in hf.parameters() if p.dim() == 2) - hf.transformer.wpe.weight.numel()
    L, T = shape["n_layer"], shape["block_size"]
    assert ours.flops_per_token() == 6 * n + 12 * L * shape["n_embd"] * T


def test_a_new_layer_counts_in_the_flops_and_a_model_the_meta_device_cannot_run_falls_back():
    """A layer added in a subclass's trunk counts as it computes (6 FLOPs a weight a token), with no edit to
    flops_per_token; a model whose forward depends on the values (it cannot run on the meta device) gets
    nanoGPT's 6N + 12·L·C·T, N counted on transformers' twin less its position embedding."""
    shape = SHAPES[1]
    C = shape["n_embd"]

    class Wider(GPT):
        def __init__(self, config):
            super().__init__(config)
            self.extra = torch.nn.Linear(C, C, bias=False)

        def trunk(self, idx, start, kv_cache):
            return self.extra(super().trunk(idx, start, kv_cache))

    class ValueDependent(GPT):
        def trunk(self, idx, start, kv_cache):
            x = super().trunk(idx, start, kv_cache)
            return x + x[x > 0].sum()

    class DeviceChecking(GPT):  # an ordinary model that asserts where it runs
        def trunk(self, idx, start, kv_cache):
            assert idx.device.type in ("cpu", "cuda", "mps"), idx.device
            return super().trunk(idx, start, kv_cache)

    class DeviceTable(GPT):  # or looks a setting up by its device
        def trunk(self, idx, start, kv_cache):
            return super().trunk(idx, start, kv_cache) * {"cpu": 1.0, "cuda": 1.0}[idx.device.type]

    with torch.device("meta"):
        plain, wider = GPT(GPTConfig(**shape)), Wider(GPTConfig(**shape))
        others = [cls(GPTConfig(**shape)) for cls in (ValueDependent, DeviceChecking, DeviceTable)]
    assert wider.flops_per_token() - plain.flops_per_token() == 6 * C * C
    hf = hf_twin(shape)
    n = sum(p.numel() for p in hf.parameters()) - hf.transformer.wpe.weight.numel()
    for model, error in zip(others, ("", "AssertionError", "KeyError")):
        said = []
        assert model.flops_per_token(say=said.append) == 6 * n + 12 * shape["n_layer"] * C * shape["block_size"]
        assert len(said) == 1 and "MFU uses the formula" in said[0] and error in said[0], said


def test_unknown_model_name_is_a_user_error():
    with pytest.raises(UserError, match="not a GPT-2 model name"):
        GPT.from_pretrained("gpt5-nano")


def test_sequence_longer_than_context_is_refused():
    model = GPT(GPTConfig(block_size=8, vocab_size=50, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(ValueError, match="longer than the context"):
        model(torch.zeros(1, 9, dtype=torch.long))
