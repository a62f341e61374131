"""generate_tokens.py --int8: dynamic int8 quantisation of every nn.Linear (the tied lm_head too).
Each quantised layer stays within the error bound that its weight and activation quantisation steps
allow; greedy int8 decoding of a trained tiny model follows fp32's; the CLI runs it on the CPU only.
Run: python -m pytest -q tests/test_cli_int8.py"""

import copy
from dataclasses import asdict

import pytest
import torch

import generate_tokens
from nanogpt.cli import UserError
from nanogpt.tokenizer import get_tokenizer
from train_gpt2 import GPT, GPTConfig


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only waits
    yield
    torch.set_num_threads(n)


def random_model(seed=0, scale=5.0):
    """The example shape, GPT-2's padded vocabulary, weights 5x the init (std 0.1): activations with
    some range, so quantisation is visibly lossy."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model.eval()


@pytest.fixture(scope="module")
def trained():
    """The example shape with a 512-token vocabulary, trained for 150 steps on a 48-token cycle: its
    next-token logits are peaked (a clear winner), as a real model's mostly are."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512))
    cycle = torch.randperm(512, generator=torch.Generator().manual_seed(0))[:48]  # distinct: the next token is a function of the last
    data = cycle.repeat(4096 // 48)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        i = torch.randint(0, len(data) - 33, (8,), generator=g).tolist()
        x = torch.stack([data[j : j + 32] for j in i])
        y = torch.stack([data[j + 1 : j + 33] for j in i])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5, loss.item()
    return model.eval(), data


def linear_inputs(model, idx):
    """{name: input tensor} of every nn.Linear in one forward pass of the fp32 model."""
    seen, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, args[0].detach())))
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    return seen


def quantised_linear(qmodel, name):
    module = qmodel.get_submodule(name)
    return module.qlinear if isinstance(module, generate_tokens.Int8Head) else module


def test_every_linear_is_int8_and_within_the_quantisation_bound():
    """For y = W x, int8 gives y' = W' x' with |W - W'| <= s_w / 2 (s_w = max|W| / 127.5, symmetric
    int8) and |x - x'| <= s_x / 2 (s_x = the range of x, 0 included, over 127 levels: fbgemm's
    reduced range; 255 levels would only halve it). Hence, per output,
        |y - y'| <= s_w / 2 * sum_j |x_j| + s_x / 2 * sum_j |W'_ij|,
    checked for every Linear on the very input the fp32 model feeds it."""
    model = random_model()
    qmodel = generate_tokens.quantize_int8(copy.deepcopy(model))
    idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(0))
    inputs = linear_inputs(model, idx)
    assert len(inputs) == 4 * 2 + 1  # c_attn, c_proj, c_fc, c_proj per block; lm_head
    assert not any(isinstance(m, torch.nn.Linear) for m in qmodel.modules())  # nothing left in fp32
    for name, x in inputs.items():
        lin, qlin = model.get_submodule(name), quantised_linear(qmodel, name)
        assert qlin.weight().dtype == torch.qint8, name
        w, w_q = lin.weight.detach(), qlin.weight().dequantize()
        s_w = w.abs().max().item() / 127.5
        assert qlin.weight().q_scale() == pytest.approx(s_w, rel=1e-6), name
        assert (w - w_q).abs().max().item() <= s_w / 2 * (1 + 1e-4), name
        s_x = (max(x.max().item(), 0.0) - min(x.min().item(), 0.0)) / 127
        bound = s_w / 2 * x.abs().sum(-1, keepdim=True) + s_x / 2 * w_q.abs().sum(-1)
        with torch.no_grad():
            y, y_q = lin(x), qlin(x)
        err = (y - y_q).abs()
        assert (err <= bound + 1e-5 * y.abs() + 1e-5).all(), (name, (err - bound).max().item())
        assert err.max().item() > 1e-4 * bound.max().item(), name  # really quantised: the bound is not vacuous
    # weight tying: wte stays the fp32 table, lm_head is its int8 copy
    wte = model.transformer.wte.weight.detach()
    assert torch.equal(qmodel.transformer.wte.weight.detach(), wte)
    head = qmodel.lm_head.qlinear.weight()
    assert (head.dequantize() - wte).abs().max().item() <= head.q_scale() / 2 * (1 + 1e-4)


def test_int8_greedy_follows_fp32_on_a_trained_model(trained):
    model, data = trained
    qmodel = generate_tokens.quantize_int8(copy.deepcopy(model))
    for start in (3, 20):
        prompt = data[start : start + 6][None]
        want = model.generate(prompt, 16, temperature=0)
        assert want[0, 6:].tolist() == data[start + 6 : start + 22].tolist()  # the fp32 model learned the cycle
        # fp32's winning margins against int8's logit error on the same tokens: a margin above twice
        # the error cannot flip an argmax, so equal tokens are expected, not luck (generate's cached
        # steps quantise each step's activations on their own: errors of the same size, not identical)
        with torch.no_grad():
            logits, _ = model(want[:, :-1])
            q_logits, _ = qmodel(want[:, :-1])
        top2 = logits[0, 5:].topk(2, dim=-1).values
        margins = top2[:, 0] - top2[:, 1]
        errs = (logits - q_logits)[0, 5:].abs().max(dim=-1).values
        assert errs.min() > 0 and (2 * errs < margins).all(), (errs, margins)
        assert torch.equal(qmodel.generate(prompt, 16, temperature=0), want)


def test_cli_int8_samples_on_cpu_quietly(tmp_path, capsys, monkeypatch):
    model = random_model(seed=1)
    path = str(tmp_path / "model_00000.pt")
    torch.save({"model": model.state_dict(), "config": asdict(model.config), "step": 0}, path)
    flags = ["--checkpoint", path, "--prompt", "The cat sat", "--max_new_tokens", "8", "--temperature", "0",
             "--no_stop", "--num_samples", "1"]
    generate_tokens.main(flags + ["--int8"])  # --device auto picks the CPU for --int8
    out, err = capsys.readouterr()
    assert "int8 weights" in err and "Warning" not in err  # torch.ao's deprecation notes are not shown
    enc = get_tokenizer()
    tokens = enc.encode("The cat sat")
    want = generate_tokens.quantize_int8(copy.deepcopy(model)).generate(torch.tensor([tokens]), 8, temperature=0)
    assert out == "--- sample 1/1 ---\nThe cat sat" + enc.decode(want[0, len(tokens):].tolist()) + "\n"
    # --int8 took effect: without it the CLI gives fp32's text, which differs on this random model
    # (its logits are close enough that int8's rounding changes some greedy picks)
    generate_tokens.main(flags + ["--device", "cpu"])
    fp32_out = capsys.readouterr().out
    want32 = model.generate(torch.tensor([tokens]), 8, temperature=0)
    assert fp32_out == "--- sample 1/1 ---\nThe cat sat" + enc.decode(want32[0, len(tokens):].tolist()) + "\n"
    assert fp32_out != out
    # on a GPU (pretended here), --int8 is one clear error
    monkeypatch.setattr(generate_tokens, "pick_device", lambda name: name)
    with pytest.raises(UserError, match="--int8 runs on the CPU only"):
        generate_tokens.main(flags + ["--int8", "--device", "cuda:0"])
