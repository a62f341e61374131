"""The padded vocabulary with its padding masked (--mask_padding, llama's and the speedrun's default): the head's
matmuls run over 50304 rows (a multiple of 128), and the ids from 50257 on, which no text holds, get no
probability. Checked against a model of the 50257 real rows alone, the same weights: the same loss and gradients
(float64: to rounding), through the plain and the chunked head, with the speedrun's softcap; the padding rows get
no gradient; checkpoints without the field (llama at 50257) compute as before.

    python -m pytest -q tests/test_padded_vocab.py
"""

import pytest
import torch
import torch.nn.functional as F

import train_gpt2
from nanogpt.tokenizer import GPT2_VOCAB_SIZE

SHAPE = dict(block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_the_defaults_pad_every_architecture_and_mask_all_but_gpt2s():
    for arch, masked in (("gpt2", False), ("llama", True), ("speedrun", True)):
        config = train_gpt2.GPTConfig(arch=arch, **SHAPE)
        assert (config.vocab_size, config.mask_padding) == (train_gpt2.PADDED_VOCAB_SIZE, masked)
        assert config.vocab_size % 128 == 0


def real_rows_twin(model):
    """The same model over the 50257 real rows: every vocabulary-sized weight cut to them."""
    config = train_gpt2.GPTConfig(**{**vars(model.config), "vocab_size": GPT2_VOCAB_SIZE})
    twin = train_gpt2.make_gpt(config).double()
    twin.load_state_dict({k: v[:GPT2_VOCAB_SIZE] if v.dim() and v.size(0) == model.config.vocab_size else v
                          for k, v in model.state_dict().items()})
    return twin


@pytest.mark.parametrize("arch", ["llama", "speedrun"])
@pytest.mark.parametrize("loss_impl", ["plain", "chunked"])
def test_a_masked_padded_model_is_the_model_of_its_real_rows(arch, loss_impl):
    torch.manual_seed(0)
    model = train_gpt2.make_gpt(train_gpt2.GPTConfig(arch=arch, **SHAPE)).double()
    twin = real_rows_twin(model)
    model.loss_impl, model.loss_chunk_size = loss_impl, 8  # (chunks of 8 rows: several per batch)
    x = torch.randint(0, GPT2_VOCAB_SIZE, (3, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, GPT2_VOCAB_SIZE, (3, 16), generator=torch.Generator().manual_seed(2))
    y[0, :3] = -1  # ignored targets, as F.cross_entropy's ignore_index
    _, loss = model(x, y)
    _, reference = twin(x, y)
    loss.backward()
    reference.backward()
    assert abs(loss.item() - reference.item()) <= 1e-12 * reference.item()
    theirs = dict(twin.named_parameters())
    # float64 rounding, relative to each gradient and (for the scalars' small ones, sums that cancel) to the largest
    largest = max(p.grad.abs().max().item() for p in twin.parameters())
    for name, p in model.named_parameters():
        grad = theirs[name].grad
        if p.size(0) == model.config.vocab_size:  # the padding rows: no gradient at all
            assert torch.equal(p.grad[GPT2_VOCAB_SIZE:], torch.zeros_like(p.grad[GPT2_VOCAB_SIZE:])), name
            got = p.grad[:GPT2_VOCAB_SIZE]
        else:
            got = p.grad
        assert (got - grad).abs().max().item() <= 1e-10 * grad.abs().max().item() + 1e-12 * largest, name


def test_the_padding_gets_no_probability_and_the_logits_of_the_real_ids_are_kept():
    torch.manual_seed(0)
    model = train_gpt2.make_gpt(train_gpt2.GPTConfig(arch="llama", **SHAPE))
    with torch.no_grad():
        model.lm_head.weight[GPT2_VOCAB_SIZE:] = 50.0  # padding rows that would win every argmax
        logits, _ = model(torch.randint(0, GPT2_VOCAB_SIZE, (2, 16)))
    assert torch.isneginf(logits[..., GPT2_VOCAB_SIZE:]).all()
    assert torch.isfinite(logits[..., :GPT2_VOCAB_SIZE]).all()
    assert F.softmax(logits, -1)[..., GPT2_VOCAB_SIZE:].sum().item() == 0.0


def test_a_checkpoint_from_before_the_field_computes_as_it_did(tmp_path):
    """llama's checkpoints before --mask_padding hold vocab_size 50257 and no mask_padding: they load with it on,
    over no padding, so their logits and loss are the model's own, unmasked."""
    torch.manual_seed(0)
    config = train_gpt2.GPTConfig(arch="llama", vocab_size=GPT2_VOCAB_SIZE, **SHAPE)
    model = train_gpt2.make_gpt(config)
    saved = {k: v for k, v in vars(config).items() if k != "mask_padding"}
    loaded = train_gpt2.load_model({"model": model.state_dict(), "config": saved}, source="old.pt")
    assert loaded.config.vocab_size == GPT2_VOCAB_SIZE
    x = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(x, x)[1], F.cross_entropy(model.lm_head(model.hidden_states(x)).flatten(0, 1),
                                                            x.flatten()))
