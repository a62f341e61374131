"""Correctness of GPT.generate's fast decode path (no timings here; bench/bench_generate.py times it).

The cached path runs the prompt once, computes logits for the last position only, and on a CPU with
one row and >= 32 new tokens multiplies by a transposed copy of the head. Whichever way it goes, greedy
decoding must pick the tokens of the plain loop (the whole sequence through the model, argmax of the
last logits) and of transformers' generate on the same weights, and sampling with a seed must pick the
tokens of the uncached path. The same holds for a model whose Linear weights generate_tokens.py has laid
out for sampling on a CPU (stored transposed; no head copy then). CPU, offline, tiny models. Run: python -m pytest -q tests/test_generate_speed.py
"""

import copy

import pytest
import torch
import torch.nn as nn

from conftest import peaked_tiny_gpt
from nanogpt.hf import export_hf
from nanogpt.tokenizer import GPT2_VOCAB_SIZE

pytestmark = pytest.mark.usefixtures("one_thread")


LONG = 40  # new tokens: enough for the transposed-head path (32 or more, one row)
SHORT = 12  # too few for it: the plain lm_head


def tiny_model(seed, block_size=64, vocab_size=96, **config):
    return peaked_tiny_gpt(seed, block_size, vocab_size, **config)


def prompt(rows, length, seed, vocab=96):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def plain_greedy(model, idx, n):
    """The reference: no cache, the last block_size tokens through the model at every step, argmax of the
    last position. Also returns the smallest gap between the best two logits, so a test can make sure
    that rounding cannot decide its argmaxes."""
    gap = float("inf")
    for _ in range(n):
        last = model(idx[:, -model.config.block_size :])[0][:, -1, :GPT2_VOCAB_SIZE]
        top2 = last.topk(2, dim=-1).values
        gap = min(gap, (top2[:, 0] - top2[:, 1]).min().item())
        idx = torch.cat([idx, last.argmax(dim=-1, keepdim=True)], dim=1)
    return idx, gap


@pytest.mark.parametrize("rows, n", [(1, LONG), (1, SHORT), (3, LONG)])
def test_greedy_equals_the_plain_loop(rows, n):
    model = tiny_model(seed=10)
    idx = prompt(rows, 7, seed=rows)
    want, gap = plain_greedy(model, idx, n)  # 7 + 40 < 64: the cache serves every step
    assert gap > 1e-3
    assert len(set(want[:, 7:].flatten().tolist())) > 5  # a varied stream: a wrong order would show
    assert torch.equal(model.generate(idx, n, temperature=0), want)
    assert torch.equal(model.generate(idx, n, temperature=0, use_cache=False), want)


@pytest.mark.parametrize("prompt_len", [1, 16, 17, 30])
def test_greedy_at_the_context_edge(prompt_len):
    # block_size 48: 16 + 32 fills the cache exactly, 17 + 32 falls back to the sliding window for the
    # last step, 30 + 32 slides for many steps; a one-token prompt is the smallest prefill.
    model = tiny_model(seed=11, block_size=48)
    idx = prompt(1, prompt_len, seed=107)
    want, gap = plain_greedy(model, idx, 32)
    assert gap > 1e-3
    assert torch.equal(model.generate(idx, 32, temperature=0), want)


def test_greedy_with_a_padded_vocabulary_never_picks_padding():
    # vocab 50304 like d12: the 47 padding rows get huge weights, so only the slicing keeps them out
    model = tiny_model(seed=12, block_size=64, vocab_size=50304, n_embd=32)
    with torch.no_grad():
        model.lm_head.weight[GPT2_VOCAB_SIZE:] = 50.0
    idx = prompt(1, 4, seed=0, vocab=GPT2_VOCAB_SIZE)
    want, gap = plain_greedy(model, idx, LONG)
    assert gap > 1e-3
    out = model.generate(idx, LONG, temperature=0)
    assert torch.equal(out, want)
    assert out.max().item() < GPT2_VOCAB_SIZE


def test_greedy_with_a_wrapped_head():
    # A head that is not a plain nn.Linear (as generate_tokens --int8 wraps the quantised one, with an
    # empty .weight) must still be called as a module.
    class Wrapped(nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.inner = linear
            self.register_buffer("weight", torch.empty(0), persistent=False)

        def forward(self, x):
            return self.inner(x)

    model = tiny_model(seed=13)
    idx = prompt(1, 5, seed=3)
    want, gap = plain_greedy(model, idx, LONG)
    assert gap > 1e-3
    model.lm_head = Wrapped(model.lm_head)
    assert torch.equal(model.generate(idx, LONG, temperature=0), want)


def test_greedy_equals_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(seed=14, vocab_size=96)
    export_hf(model, str(tmp_path / "hf"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    hf.generation_config.eos_token_id = None  # no early stop: all LONG tokens
    hf.generation_config.pad_token_id = 0
    idx = prompt(1, 6, seed=4)
    want, gap = plain_greedy(model, idx, LONG)
    assert gap > 1e-3
    with torch.no_grad():
        theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=LONG, do_sample=False)
    assert torch.equal(theirs, want)
    assert torch.equal(model.generate(idx, LONG, temperature=0), theirs)


@pytest.mark.parametrize("rows, n, kw", [
    (1, LONG, dict(temperature=1.0)),
    (1, LONG, dict(temperature=0.8, top_k=20)),
    (1, LONG, dict(temperature=1.2, top_p=0.9)),
    (1, SHORT, dict(temperature=1.0, top_k=10, top_p=0.95)),
    (2, LONG, dict(temperature=1.0, top_k=50)),
])
def test_sampling_with_a_seed_equals_the_uncached_path(rows, n, kw):
    # The uncached path is the code as it was (GPT.forward over the whole sequence, every step), so
    # these are the tokens the same seed gave before the fast path.
    model = tiny_model(seed=15)
    idx = prompt(rows, 5, seed=5)
    cached = model.generate(idx, n, generator=torch.Generator().manual_seed(7), **kw)
    uncached = model.generate(idx, n, generator=torch.Generator().manual_seed(7), use_cache=False, **kw)
    assert torch.equal(cached, uncached)
    again = model.generate(idx, n, generator=torch.Generator().manual_seed(7), **kw)
    other = model.generate(idx, n, generator=torch.Generator().manual_seed(8), **kw)
    assert torch.equal(again, cached) and not torch.equal(other, cached)


def test_stop_token_on_the_fast_path():
    model = tiny_model(seed=16)
    idx = prompt(1, 4, seed=6)
    want, _ = plain_greedy(model, idx, LONG)
    new = want[0, 4:].tolist()
    k = next(i for i in range(3, LONG) if new[i] not in new[:i])  # a token first emitted at step k
    out = model.generate(idx, LONG, temperature=0, stop_token=new[k])
    assert out[0].tolist() == want[0, : 4 + k + 1].tolist()  # ends right after it


def test_two_threads():
    # the same tokens at two threads: greedy as the plain loop, sampling as the uncached path (both
    # references computed at one thread; only the fast path runs at two, which keeps the test quick)
    model = tiny_model(seed=10)
    idx = prompt(1, 7, seed=1)
    want, gap = plain_greedy(model, idx, LONG)
    assert gap > 1e-3
    sampled = model.generate(idx, LONG, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(3), use_cache=False)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(model.generate(idx, LONG, temperature=0), want)
        assert torch.equal(model.generate(idx, LONG, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(3)), sampled)
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_cpu_sampling_layout_keeps_the_model(arch):
    # generate_tokens.py stores every Linear weight transposed in memory on a CPU: the same values and shapes,
    # the embedding still tied to the head (GPT-2; llama's is untied), and sampling gives the tokens of the model as built.
    from generate_tokens import lay_out_for_cpu_sampling

    options = dict(arch="llama", n_kv_head=1, mlp_act="swiglu") if arch == "llama" else {}
    built = tiny_model(seed=21, **options)
    before = {k: v.clone() for k, v in built.state_dict().items()}
    laid_out = lay_out_for_cpu_sampling(copy.deepcopy(built))
    linears = [m for m in laid_out.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    assert (laid_out.transformer.wte.weight is laid_out.lm_head.weight) == laid_out.config.tie_embeddings
    after = laid_out.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    idx = prompt(1, 6, seed=8)
    want, gap = plain_greedy(built, idx, LONG)
    assert gap > 1e-3
    assert torch.equal(laid_out.generate(idx, LONG, temperature=0), want)
    kw = dict(temperature=1.0, top_k=20)
    sampled = built.generate(idx, LONG, generator=torch.Generator().manual_seed(9), use_cache=False, **kw)
    assert torch.equal(laid_out.generate(idx, LONG, generator=torch.Generator().manual_seed(9), **kw), sampled)


def test_a_laid_out_head_is_not_copied():
    # the transposed copy of the head is for nn.Linear's layout only; a laid-out head is already that way
    from generate_tokens import lay_out_for_cpu_sampling

    seen = []
    model = tiny_model(seed=18)
    decode_step = model.decode_step
    model.decode_step = lambda tokens, cache, head_t=None: seen.append(head_t is None) or decode_step(tokens, cache, head_t)
    idx = prompt(1, 4, seed=9)
    model.generate(idx, LONG, temperature=0)
    assert seen and not any(seen)  # as built: the copy serves every step
    seen.clear()
    lay_out_for_cpu_sampling(model).generate(idx, LONG, temperature=0)
    assert seen and all(seen)
