"""--loss_impl fused (nanogpt.loss_head.fused_cross_entropy: Liger-Kernel's fused linear cross-entropy in a custom
op) against F.cross_entropy over materialised logits and against the chunked head, on the CPU in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1): loss and gradients within the rounding bounds of
tests/test_loss_head.py, with the speedrun's softcap and a masked padding; one custom op under torch.compile (no
graph break); a tiny training run; and the refusals where it cannot run. Skipped where Liger-Kernel or Triton is
not installed (.ci/run installs both).

    python -m pytest -q tests/test_fused_head.py
"""

import importlib.util
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt2
from conftest import TINY_FLAGS, assert_cli_error, make_shards, read_log, script_cli
from nanogpt.loss_head import chunked_cross_entropy, fused_cross_entropy
from test_loss_head import loss_and_grads, make_inputs, rounding_error_bounds

triton = pytest.importorskip("triton", reason="Triton is not installed (.ci/run installs it with Liger-Kernel)")
pytest.importorskip("liger_kernel", reason="Liger-Kernel is not installed (pip install liger-kernel)")
import triton.language as tl  # noqa: E402


@triton.jit
def interpreted_tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (on a CUDA machine the kernels are compiled)
DEVICE = "cpu" if INTERPRETED else "cuda"


@pytest.fixture(autouse=True)
def interpreted_as_compiled(monkeypatch):
    if INTERPRETED:
        interpret_as_compiled(monkeypatch)
    elif not torch.cuda.is_available():
        pytest.skip("Triton's kernels need CUDA, or its interpreter (TRITON_INTERPRET=1)")
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32 matmuls in fp32 (a training run in this process sets TF32)
    yield
    torch.set_float32_matmul_precision(precision)


def interpret_as_compiled(monkeypatch):
    """Two things Triton's interpreter does not do as compiled Triton does, given here as a GPU has them: a float
    argument of a kernel is an fp32 scalar (the interpreter hands over the Python float, and Liger's kernel calls
    .to() on its softcap); and libdevice's tanh (the softcap's), which the interpreter lacks, is 2 sigmoid(2x) - 1."""
    from liger_kernel.ops import cross_entropy
    from triton.runtime import interpreter

    cvt = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return cvt(arg)

    monkeypatch.setattr(interpreter, "_implicit_cvt", implicit_cvt)
    monkeypatch.setattr(cross_entropy, "tanh", interpreted_tanh)


def fused(x, w, t):
    return fused_cross_entropy(x, w, t)


@pytest.mark.parametrize("n,c,v", [(48, 16, 96), (40, 24, 300)])
def test_fused_is_cross_entropy_within_the_rounding_bound(n, c, v):
    """fp32 inputs: the loss and every gradient entry within the bound the exact (fp64) result gives any fp32
    evaluation (test_loss_head.rounding_error_bounds), which F.cross_entropy itself must meet too."""
    x, w, t = make_inputs(n, c, v, scale=2.0)
    exact, bounds = rounding_error_bounds(x, w, t)
    for name, fn in (("fused", fused), ("reference", lambda x, w, t: F.cross_entropy(x @ w.T, t, ignore_index=-1))):
        loss, gx, gw = (r.cpu() for r in loss_and_grads(fn, x.to(DEVICE), w.to(DEVICE), t.to(DEVICE)))
        assert abs(loss.double() - exact[0]) <= bounds[0], name
        assert ((gx.double() - exact[1]).abs() <= bounds[1]).all(), name
        assert ((gw.double() - exact[2]).abs() <= bounds[2]).all(), name


@pytest.mark.parametrize("softcap,real_vocab", [(15.0, None), (0.0, 250), (15.0, 250)])
def test_fused_takes_the_softcap_and_the_masked_padding_as_the_chunked_head_does(softcap, real_vocab):
    """float64 inputs (the kernel's softmax runs in fp32): the fused loss and gradients equal the chunked head's
    (float64 throughout) to fp32 rounding: relative 1e-5 of each gradient's largest entry."""
    x, w, t = (a.to(DEVICE) for a in make_inputs(40, 24, 256, scale=2.0, dtype=torch.float64))
    t = t.clamp(max=(real_vocab or 256) - 1)
    ours = loss_and_grads(lambda x, w, t: fused_cross_entropy(x, w, t, softcap=softcap, real_vocab=real_vocab), x, w, t)
    chunked = loss_and_grads(lambda x, w, t: chunked_cross_entropy(x, w, t, 16, softcap=softcap, real_vocab=real_vocab),
                             x, w, t)
    assert abs(ours[0].item() - chunked[0].item()) <= 1e-5 * chunked[0].item()
    for a, b in zip(ours[1:], chunked[1:]):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
    if real_vocab:
        assert torch.equal(ours[2][real_vocab:], torch.zeros_like(ours[2][real_vocab:]))


def test_the_gradient_follows_the_incoming_one_and_no_gradient_gives_the_loss_alone():
    x, w, t = (a.to(DEVICE) for a in make_inputs(32, 16, 64))
    plain = loss_and_grads(fused, x, w, t)
    scaled = loss_and_grads(fused, x, w, t, upstream=0.25)
    assert torch.equal(scaled[1], plain[1] * 0.25) and torch.equal(scaled[2], plain[2] * 0.25)
    with torch.no_grad():
        assert abs(fused(x, w, t).item() - plain[0].item()) <= 1e-6 * plain[0].item()


def test_the_fused_head_is_one_operation_to_torch_compile():
    """Dynamo sees one custom op where the head is: one graph, no break; AOTAutograd's backward of it (the eager
    backend behind) gives the gradients of the uncompiled model."""
    torch.manual_seed(0)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=16, vocab_size=128, n_layer=1, n_head=2, n_embd=16))
    model.to(DEVICE).loss_impl = "fused"
    x = torch.randint(0, 128, (2, 16), device=DEVICE)
    explained = torch._dynamo.explain(model)(x, x.roll(1, 1))
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    ops = [str(node.target) for graph in explained.graphs for node in graph.graph.nodes]
    assert any("fused_linear_cross_entropy" in op for op in ops), ops
    grads = []
    for run in (model, torch.compile(model, backend="aot_eager", fullgraph=True)):
        model.zero_grad(set_to_none=True)
        run(x, x.roll(1, 1))[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.slow
def test_a_tiny_run_with_the_fused_head_trains_as_the_chunked_one(tmp_path):
    """On the CPU in Triton's interpreter (a row of the logits a kernel program: slow), 3 steps of 2 x 16 tokens of
    the tiny model, whose losses equal the chunked head's to fp32 rounding (the same arithmetic, another order)."""
    data = make_shards(str(tmp_path / "data"))
    losses = {}
    for impl in ("fused", "chunked"):
        log_dir = str(tmp_path / impl)
        train_gpt2.main([*TINY_FLAGS, "--data_dir", data, "--log_dir", log_dir, "--max_steps", "3", "--eval_every", "0",
                         "--save_every", "0", "--batch_size", "2", "--seq_len", "16", "--total_batch_size", "32",
                         "--loss_impl", impl, "--device", DEVICE])
        losses[impl] = read_log(log_dir)["train"]
    for step, loss in losses["chunked"].items():
        assert abs(losses["fused"][step] - loss) <= 1e-4 * loss, (step, losses)


def test_where_the_fused_head_cannot_run_it_is_one_line(tmp_path, monkeypatch, capsys):
    data = make_shards(str(tmp_path / "data"))
    flags = [*TINY_FLAGS, "--data_dir", data, "--log_dir", str(tmp_path / "log"), "--max_steps", "1", "--loss_impl",
             "fused"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_cli_error(script_cli(capsys, train_gpt2.main, *flags), "--loss_impl fused runs Triton kernels",
                     "device is cpu", "--loss_impl chunked")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real_find_spec(name, *a))
    assert_cli_error(script_cli(capsys, train_gpt2.main, *flags), "--loss_impl fused needs Liger-Kernel",
                     "pip install liger-kernel")
    assert not (tmp_path / "log").exists()


def test_terms_of_the_objective_with_the_fused_head_are_refused_in_one_line():
    """Liger-Kernel's kernel computes the cross-entropy alone: an objective with terms of its own (row_losses) is
    refused, naming the head that takes them."""
    from nanogpt.cli import UserError
    from nanogpt.loss_head import cross_entropy_rows

    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=16, vocab_size=128, n_layer=1, n_head=2, n_embd=16))
    model.loss_impl = "fused"
    x = torch.randint(0, 128, (2, 16))
    with pytest.raises(UserError, match="--loss_impl fused: .* use --loss_impl chunked"):
        model(x, x, row_losses=cross_entropy_rows)
