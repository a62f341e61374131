"""chunked_cross_entropy (the loss head that never holds the (N, V) logits) against F.cross_entropy
over materialised logits, and GPT's loss_impl "chunked" against "plain".

fp64: equal to the reference to 1e-12 relative (both are exact up to ~1e-16 roundings).
fp32 and bf16: within a rounding-error bound derived below (rounding_error_bounds), elementwise, that
the reference itself must also satisfy. The tiny GPT: each parameter's gradient is within 4x the
plain fp32 path's own error (see test_gpt_chunked_equals_plain_fp32).

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_loss_head.py
    TEST_INDUCTOR_CPU=1 python -m pytest -q tests/test_loss_head.py   # adds the inductor test (~1 min)
"""

import copy
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, run_script
from nanogpt.loss_head import chunked_cross_entropy, default_loss_chunk_size
from train_gpt2 import GPT, GPTConfig, make_gpt

U32 = 2.0**-24  # unit roundoff of fp32
U_BF16 = 2.0**-8
TINY32 = 2.0**-126  # smallest normal fp32: bounds the absolute error of an underflow to a subnormal or 0


def gamma(k, u=U32):
    return k * u / (1 - k * u)


def reference(x, w, t):
    return F.cross_entropy(x @ w.T, t, ignore_index=-1)


def loss_and_grads(fn, x, w, t, upstream=1.0):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(x, w, t)
    gx, gw = torch.autograd.grad(loss * upstream, (x, w))
    return loss.detach(), gx, gw


def rel_err(a, ref):
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def make_inputs(n, c, v, scale=1.0, ignore_frac=0.2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, generator=g) * scale).to(dtype)
    w = torch.randn(v, c, generator=g).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -1
    t[0] = 1  # at least one target counts
    return x, w, t


def rounding_error_bounds(x, w, t, u_lowp=0.0, u_logits=None):
    """Exact (fp64) loss, grad_x, grad_w of mean cross-entropy of x @ w.T, and elementwise bounds on
    the error of any evaluation that does the matmuls with fp32 accumulation (inputs and outputs
    rounded to a format of unit roundoff u_lowp: 0 for fp32, 2^-8 for bf16) and the softmax in fp32.
    u_logits (default u_lowp) is that rounding for the logits' matmul: 0 when x, w and x @ w.T are
    exactly representable in the low-precision format, which leaves only fp32 error in the loss.
    First-order rounding-error analysis (Higham, Accuracy and Stability, ch. 3), u = 2^-24:
      logits      |dz_ij| <= (3 u_logits + gamma_C) (|x||w|^T)_ij,          D_i = max_j |dz_ij|
      logsumexp   |dlse_i| <= D_i + r_i, r_i = 2u max_j|z_ij| + gamma_{V+1} + u (log V + |lse_i|) + 8u
                  (the shift by the max, V positive terms summed, the log, the shift back; 8u:
                  exp and log of a few ulp, as CUDA's expf/logf)
      loss        |dL| <= (sum_i 2 D_i + r_i + u|l_i|  +  gamma_N sum_i |l_i|) / n  +  u |L|
      softmax     p = exp(z - lse): |dp_ij| <= p_ij expm1(2 D_i + r_i + u|z_ij - lse_i| + 8u)
                  (8u: exp, the 1/n scaling and the subtraction of the one-hot, a few ulp each)
      dlogits     |d(dl)| <= |dp| + (u + u_lowp)|dl| + TINY (underflow of p to subnormals or 0)
      grad_x      (|d(dl)| |w| + (2 u_lowp + gamma_V) |dl||w|) / n + 2u|gx| + (V+1) TINY
      grad_w      (|d(dl)|^T |x| + (2 u_lowp + 2 gamma_N) |dl|^T|x|) / n + 2u|gw| + (N+1) TINY
                  (2 gamma_N: sums within a chunk, then across chunks; u_lowp per chunk partial)
    The chunked head and F.cross_entropy both fit this model; a softmax in low precision, a
    dropped or doubled row, a wrong scale or an overflowing exp do not."""
    x, w = x.double(), w.double()
    (n_rows, c), v = x.shape, w.size(0)
    u = U32
    u_logits = u_lowp if u_logits is None else u_logits
    valid = t != -1
    n = valid.sum()
    tt, rows = t.clamp(min=0), torch.arange(n_rows)
    z = x @ w.T
    lse = z.logsumexp(1)
    p = (z - lse[:, None]).exp()
    dl = p.clone()
    dl[rows, tt] -= 1
    dl[~valid] = 0
    ell = torch.where(valid, lse - z[rows, tt], 0)
    loss, gx, gw = ell.sum() / n, dl @ w / n, dl.T @ x / n
    ax, aw, adl = x.abs(), w.abs(), dl.abs()
    D = ((3 * u_logits + gamma(c)) * (ax @ aw.T)).max(1).values
    r = 2 * u * z.abs().max(1).values + gamma(v + 1) + u * (math.log(v) + lse.abs()) + 8 * u
    b_loss = (torch.where(valid, 2 * D + r + u * ell.abs(), 0).sum() + gamma(n_rows) * ell.abs().sum()) / n + u * loss.abs()
    a = 2 * D[:, None] + r[:, None] + u * (z - lse[:, None]).abs() + 8 * u
    b_dl = p * torch.expm1(a) + (u + u_lowp) * adl + TINY32
    b_dl[~valid] = 0
    b_gx = (b_dl @ aw + (2 * u_lowp + gamma(v)) * adl @ aw) / n + 2 * u * gx.abs() + (v + 1) * TINY32
    b_gw = (b_dl.T @ ax + (2 * u_lowp + 2 * gamma(n_rows)) * adl.T @ ax) / n + 2 * u * gw.abs() + (n_rows + 1) * TINY32
    return (loss, gx, gw), (b_loss, b_gx, b_gw)


def assert_within(got, exact, bound, what):
    excess = ((got.double() - exact).abs() / bound).max().item()
    assert excess <= 1.0, f"{what}: error is {excess:.3g}x its rounding-error bound"


# ---------------------------------------------------------------------------------------------
# the function


@pytest.mark.parametrize("n, chunk", [(37, 8), (37, 1), (37, 37), (37, 100), (64, 16)])
def test_fp64_equals_reference(n, chunk):
    # chunks that divide N, that do not, one row each, one chunk, a chunk larger than N
    x, w, t = make_inputs(n, 24, 301, dtype=torch.float64)
    ref = loss_and_grads(reference, x, w, t, upstream=0.37)  # an upstream scale, as grad accumulation gives
    got = loss_and_grads(lambda x, w, t: chunked_cross_entropy(x, w, t, chunk), x, w, t, upstream=0.37)
    for name, g, r in zip(("loss", "grad_x", "grad_w"), got, ref):
        assert g.dtype == torch.float64
        assert rel_err(g, r) < 1e-12, name


@pytest.mark.parametrize("scale, chunk", [(1.0, 7), (1.0, 64), (0.05, 13), (30.0, 5)])
def test_fp32_within_rounding_error_bound(scale, chunk):
    # scale 30 gives logits of several hundred: exp overflows unless shifted, softmax is nearly one-hot
    x, w, t = make_inputs(64, 40, 257, scale=scale, seed=1)
    exact, bound = rounding_error_bounds(x, w, t)
    ref = loss_and_grads(reference, x, w, t)
    got = loss_and_grads(lambda x, w, t: chunked_cross_entropy(x, w, t, chunk), x, w, t)
    for name, g, r, e, b in zip(("loss", "grad_x", "grad_w"), got, ref, exact, bound):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        assert_within(r, e, b, f"reference {name}")  # the bound holds for F.cross_entropy itself
        assert_within(g, e, b, f"chunked {name}")
        assert b.max() < 1e-2 * e.abs().max()  # and says something


def test_fp32_large_vocab_many_chunks():
    x, w, t = make_inputs(300, 32, 4099, seed=2)
    exact, bound = rounding_error_bounds(x, w, t)
    got = loss_and_grads(lambda x, w, t: chunked_cross_entropy(x, w, t, 128), x, w, t)
    for name, g, e, b in zip(("loss", "grad_x", "grad_w"), got, exact, bound):
        assert_within(g, e, b, name)


def bf16_exact_inputs(n, c, v, seed=0):
    """x, w whose entries and products x @ w.T are all exact in bf16 (multiples of 1/128, |z| <= c/4),
    so that bf16 logits are the exact logits and a softmax in fp32 leaves only fp32 error in the loss."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (n, c), generator=g) / 8.0
    w = torch.randint(-8, 9, (v, c), generator=g) / 16.0
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -1
    t[0] = 1
    return x, w, t


@pytest.mark.parametrize("exact_logits", [True, False])
def test_bf16_autocast_on_cpu(exact_logits):
    # the CUDA recipe's arithmetic on CPU: bf16 matmuls, fp32 softmax, fp32 gradients out. With
    # bf16-exact logits the loss must be fp32-accurate (a bf16 softmax is 10x outside that bound) and
    # many chunks test that grad_w is accumulated in fp32.
    if exact_logits:
        x, w, t = bf16_exact_inputs(256, 16, 515)
        assert torch.equal((x @ w.T).bfloat16().float(), x @ w.T)
    else:
        x, w, t = make_inputs(96, 32, 515, seed=3)
    exact, bound = rounding_error_bounds(x, w, t, u_lowp=U_BF16, u_logits=0.0 if exact_logits else U_BF16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loss_and_grads(reference, x, w, t)
        got = loss_and_grads(lambda x, w, t: chunked_cross_entropy(x, w, t, 4 if exact_logits else 40), x, w, t)
    for name, g, r, e, b in zip(("loss", "grad_x", "grad_w"), got, ref, exact, bound):
        assert g.dtype == torch.float32
        assert_within(r, e, b, f"reference {name}")
        assert_within(g, e, b, f"chunked {name}")


def test_ignored_targets():
    x, w, t = make_inputs(20, 8, 50, dtype=torch.float64)
    t[:] = -1
    ref = loss_and_grads(reference, x, w, t)
    got = loss_and_grads(lambda x, w, t: chunked_cross_entropy(x, w, t, 6), x, w, t)
    assert torch.isnan(ref[0]) and torch.isnan(got[0])  # the mean over no targets, as F.cross_entropy
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])  # zero gradients
    t[7] = 3  # one target left
    ref = loss_and_grads(reference, x, w, t)
    got = loss_and_grads(lambda x, w, t: chunked_cross_entropy(x, w, t, 6), x, w, t)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-12


def test_without_grad_and_with_one_input_needing_grad():
    x, w, t = make_inputs(30, 8, 50, dtype=torch.float64)
    ref_loss, ref_gx, ref_gw = loss_and_grads(reference, x, w, t)
    with torch.no_grad():
        loss = chunked_cross_entropy(x.requires_grad_(), w, t, 7)
    assert loss.grad_fn is None and rel_err(loss, ref_loss) < 1e-12
    w1 = w.detach().requires_grad_()  # x a constant: only grad_w is computed
    (gw,) = torch.autograd.grad(chunked_cross_entropy(x.detach(), w1, t, 7), w1)
    assert rel_err(gw, ref_gw) < 1e-12
    x1 = x.detach().requires_grad_()
    (gx,) = torch.autograd.grad(chunked_cross_entropy(x1, w.detach(), t, 7), x1)
    assert rel_err(gx, ref_gx) < 1e-12


@pytest.mark.parametrize("vocab", [50304, 50257, 32000, 128256, 300, 2**20])
def test_default_chunk_size(vocab):
    """Its docstring's rule: the largest power of two whose (rows, V) fp32 block fits in 2 GiB."""
    rows = default_loss_chunk_size(vocab)
    assert rows >= 1 and rows & (rows - 1) == 0  # a power of two
    assert rows * vocab * 4 <= 2**31 < 2 * rows * vocab * 4  # fits; the next power of two does not
    assert default_loss_chunk_size(10**9) == 1  # not even one row fits: still one row per chunk


@pytest.mark.slow
def test_compiled_fullgraph_equals_reference():
    # aot_eager: dynamo traces the autograd.Function (no graph break) and AOTAutograd functionalises it
    x, w, t = make_inputs(37, 16, 101, dtype=torch.float64)
    ref = loss_and_grads(reference, x, w, t)
    fn = torch.compile(lambda x, w, t: chunked_cross_entropy(x, w, t, 8), backend="aot_eager", fullgraph=True)
    got = loss_and_grads(fn, x, w, t)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-12
    with torch.no_grad():
        assert rel_err(fn(x, w, t), ref[0]) < 1e-12


@pytest.mark.skipif(not os.environ.get("TEST_INDUCTOR_CPU"), reason="inductor's first CPU compile takes ~1 min; set TEST_INDUCTOR_CPU=1")
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="inductor on CPU needs a C++ compiler")
def test_inductor_cpu():
    x, w, t = make_inputs(37, 16, 101, seed=4)
    exact, bound = rounding_error_bounds(x, w, t)
    fn = torch.compile(lambda x, w, t: chunked_cross_entropy(x, w, t, 8), backend="inductor", fullgraph=True)
    got = loss_and_grads(fn, x, w, t)
    for name, g, e, b in zip(("loss", "grad_x", "grad_w"), got, exact, bound):
        assert_within(g, e, b, name)


# ---------------------------------------------------------------------------------------------
# GPT with loss_impl "chunked"


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=16, vocab_size=300, n_layer=2, n_head=2, n_embd=32))


def gpt_step(model, idx, targets):
    """loss and every parameter's gradient of one training step, and the hidden states after ln_f"""
    seen = []
    hook = model.transformer.ln_f.register_forward_hook(lambda m, i, out: seen.append(out.detach()))
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, targets)
    loss.backward()
    hook.remove()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, seen[0]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    idx, targets = torch.randint(0, 300, (3, 16), generator=g), torch.randint(0, 300, (3, 16), generator=g)
    targets[0, :5] = -1
    return idx, targets


def test_gpt_chunked_equals_plain_fp32():
    """Tolerances: the loss by the bound above at the shared hidden states (the two paths run the same
    code up to ln_f, so those are bitwise equal: asserted). Each parameter gradient: its max error
    against fp64 is at most 4x the plain fp32 path's own. Both paths do the same operations with the
    same reduction lengths, so their errors against fp64 are alike; the 4x is margin for a different
    rounding of the same size (over 30 seeds the ratio stayed below 2.2). Weight tying: wte's single
    gradient holds the embedding's and the head's contributions in both paths."""
    model = tiny_gpt()
    model64 = copy.deepcopy(model).double()
    idx, targets = batch()
    _, _, grads64, _ = gpt_step(model64, idx, targets)
    logits_p, loss_p, grads_p, x_p = gpt_step(model, idx, targets)
    model.loss_impl, model.loss_chunk_size = "chunked", 7  # 48 rows: chunks of 7 do not divide them
    logits_c, loss_c, grads_c, x_c = gpt_step(model, idx, targets)
    assert logits_c is None and logits_p.shape == (3, 16, 300)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(x_c, x_p)
    exact, bound = rounding_error_bounds(x_p.view(-1, 32), model.lm_head.weight.detach(), targets.view(-1))
    assert abs(loss_p.double() - exact[0]) <= bound[0] and abs(loss_c.double() - exact[0]) <= bound[0]
    for name, g64 in grads64.items():
        err_plain = (grads_p[name].double() - g64).abs().max()
        err_chunked = (grads_c[name].double() - g64).abs().max()
        assert err_chunked <= 4 * err_plain, name


def test_gpt_chunked_fp64_and_compiled():
    model = tiny_gpt(1).double()
    idx, targets = batch(1)
    _, loss_p, grads_p, _ = gpt_step(model, idx, targets)
    model.loss_impl, model.loss_chunk_size = "chunked", 10
    _, loss_c, grads_c, _ = gpt_step(model, idx, targets)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled.zero_grad(set_to_none=True)
    logits_k, loss_k = compiled(idx, targets)
    loss_k.backward()
    assert logits_k is None
    assert rel_err(loss_c, loss_p) < 1e-12 and rel_err(loss_k, loss_p) < 1e-12
    for name, p in model.named_parameters():
        assert rel_err(grads_c[name], grads_p[name]) < 1e-12, name
        assert rel_err(p.grad, grads_p[name]) < 1e-12, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gpt_logits_without_targets_and_eval_loss(dtype):
    """Validation's loss under no_grad, chunked and plain. fp32: each within the rounding-error bound
    of the float64 loss at the hidden states both share (bitwise: the same code up to ln_f). fp64:
    equal to 1e-12 relative, as everywhere in this file."""
    model = tiny_gpt(2).to(dtype)
    idx, targets = batch(2)
    seen = []
    hook = model.transformer.ln_f.register_forward_hook(lambda m, i, out: seen.append(out))
    with torch.no_grad():
        logits_p, loss_p = model(idx, targets)
        model.loss_impl = "chunked"
        logits, none = model(idx)  # HellaSwag and generation: logits as before
        no_logits, loss_c = model(idx, targets)  # validation under no_grad
    hook.remove()
    assert none is None and torch.equal(logits, logits_p) and no_logits is None
    assert torch.equal(seen[0], seen[2])
    if dtype == torch.float64:
        assert loss_c.dtype == torch.float64 and rel_err(loss_c, loss_p) < 1e-12
    else:
        x, w = seen[0].view(-1, 32), model.lm_head.weight.detach()
        exact, bound = rounding_error_bounds(x, w, targets.view(-1))
        assert abs(loss_p.double() - exact[0]) <= bound[0] and abs(loss_c.double() - exact[0]) <= bound[0]
    model.loss_impl = "unknown"
    with pytest.raises(ValueError, match="loss_impl"):
        model(idx, targets)


DDP_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from test_loss_head import batch, gpt_step, rel_err, tiny_gpt

model = tiny_gpt(3).double()
model.loss_impl, model.loss_chunk_size = "chunked", 9
idx, targets = batch(3)
_, _, expected, _ = gpt_step(model, idx, targets)
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
ddp = DDP(model)
for _ in range(2):
    ddp.zero_grad(set_to_none=True)
    logits, loss = ddp(idx, targets)
    loss.backward()
assert logits is None
for name, p in model.named_parameters():
    assert rel_err(p.grad, expected[name]) < 1e-12, name
print("ok", flush=True)
os._exit(0)  # skip teardown: destroying a gloo group while its worker frees a finished work can deadlock on the GIL
"""


def test_gpt_chunked_under_ddp(tmp_path):
    # one gloo process: DDP's reducer must see the tied weight's gradient from the autograd.Function
    # (with find_unused_parameters=False it raises on the next step if any parameter went without)
    result = run_script(["-c", DDP_SCRIPT, ROOT, str(tmp_path / "pg")], timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)

cuda = pytest.mark.cuda


@cuda
def test_cuda_bf16_chunked_vs_plain_and_peak_memory():
    """bf16 autocast as in training: both heads within the bf16 bound; the chunked head's peak memory
    well under the plain one's (the plain head holds bf16 logits, their fp32 copy and log-softmax)."""
    n, c, v = 8192, 768, 50304
    x, w, t = make_inputs(n, c, v, seed=5)
    x, w, t = x.cuda(), (w * 0.02).cuda(), t.cuda()
    exact, bound = rounding_error_bounds(x, w, t, u_lowp=U_BF16)
    old = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # the bound assumes fp32 sums
    try:
        peaks, results = {}, {}
        for name, fn in (("plain", reference), ("chunked", lambda x, w, t: chunked_cross_entropy(x, w, t, 1024))):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                results[name] = loss_and_grads(fn, x, w, t)
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - base
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = old
    for name in results:
        for q, g, e, b in zip(("loss", "grad_x", "grad_w"), results[name], exact, bound):
            assert g.dtype == torch.float32
            assert_within(g.cpu(), e.cpu(), b.cpu(), f"{name} {q}")
    # plain: bf16 logits 0.8 GB + fp32 logits and log-softmax 1.6 GB each; chunked: (1024, V) blocks
    assert peaks["chunked"] < 0.25 * peaks["plain"], peaks


@cuda
def test_cuda_compiled_gpt_chunked_vs_plain_bf16():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=128, n_layer=2, n_head=4, n_embd=128)).cuda()
    idx = torch.randint(0, 50257, (4, 128), device="cuda")
    out = {}
    for impl in ("plain", "chunked"):
        model.loss_impl = impl
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = torch.compile(model)(idx, idx)
        loss.backward()
        out[impl] = loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}
    assert abs(out["chunked"][0] - out["plain"][0]) < 2e-2  # bf16 logits: ~3 significant digits
    for name, g in out["plain"][1].items():
        assert (out["chunked"][1][name] - g).norm() <= 2e-2 * g.norm() + 1e-6, name


def z_loss_and_weights(lse, target_logit, targets):
    """Two terms of a row, as a researcher writes them once: the cross-entropy weighted by the target's id (odd ids
    count double), and PaLM's z-loss."""
    weight = 1.0 + (targets % 2)
    return {"loss": weight * (lse - target_logit), "z_loss": 1e-2 * lse.square()}


@pytest.mark.parametrize("arch", ["gpt2", "speedrun"])  # (the speedrun's: a softcap and a masked padding)
def test_terms_written_once_hold_for_the_plain_and_the_chunked_head(arch):
    """row_losses' terms, of each row's log-sum-exp and target logit: the plain head (autograd through them) and the
    chunked one (their derivatives folded into its gradient) give the same loss, terms and gradients (float64: to
    rounding), and the plain head's equal the same terms computed here from the logits by F.cross_entropy."""
    torch.manual_seed(0)
    model = make_gpt(GPTConfig(block_size=16, vocab_size=50304, n_layer=2, n_head=2, n_embd=16, arch=arch)).double()
    x = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(2))
    y[0, :4] = -1
    results = {}
    for impl in ("plain", "chunked"):
        model.loss_impl, model.loss_chunk_size = impl, 8
        model.zero_grad(set_to_none=True)
        _, loss, terms = model(x, y, row_losses=z_loss_and_weights)
        loss.backward()
        results[impl] = loss.item(), {k: v.item() for k, v in terms.items()}, [p.grad.clone() for p in model.parameters()]
    (plain, plain_terms, plain_grads), (chunked, chunked_terms, chunked_grads) = results["plain"], results["chunked"]
    assert abs(plain - chunked) <= 1e-12 * plain
    assert plain_terms.keys() == chunked_terms.keys() == {"loss", "z_loss"}
    assert all(abs(plain_terms[k] - chunked_terms[k]) <= 1e-12 * abs(plain_terms[k]) for k in plain_terms)
    assert abs(sum(plain_terms.values()) - plain) <= 1e-12 * plain
    largest = max(g.abs().max().item() for g in plain_grads)
    for a, b in zip(plain_grads, chunked_grads):
        assert (a - b).abs().max().item() <= 1e-10 * b.abs().max().item() + 1e-12 * largest
    with torch.no_grad():  # the reference: the same terms from the logits
        model.loss_impl = "plain"
        logits = model(x)[0].flatten(0, 1)
        valid = y.flatten() != -1
        rows = F.cross_entropy(logits, y.flatten(), ignore_index=-1, reduction="none")[valid]
        weight = 1.0 + (y.flatten()[valid] % 2)
        z = 1e-2 * torch.logsumexp(logits, -1)[valid].square()
    assert abs((weight * rows).mean().item() - plain_terms["loss"]) <= 1e-12 * plain_terms["loss"]
    assert abs(z.mean().item() - plain_terms["z_loss"]) <= 1e-12 * plain_terms["z_loss"]


def test_the_cross_entropy_as_a_term_is_the_heads_own_loss():
    """cross_entropy_rows, the terms of the plain objective, through either head: the head's loss without terms."""
    from nanogpt.loss_head import cross_entropy_rows

    x, w, t = make_inputs(40, 16, 96, dtype=torch.float64)
    for fn in (lambda x, w, t: chunked_cross_entropy(x, w, t, 16, row_losses=cross_entropy_rows)[0],
               lambda x, w, t: __import__("nanogpt.loss_head").loss_head.logits_loss(x @ w.T, t, cross_entropy_rows)[0]):
        ours, theirs = loss_and_grads(fn, x, w, t), loss_and_grads(reference, x, w, t)
        assert abs(ours[0].item() - theirs[0].item()) <= 1e-12 * theirs[0].item()
        assert all((a - b).abs().max().item() <= 1e-12 * b.abs().max().item() for a, b in zip(ours[1:], theirs[1:]))
