"""
Loss heads that never hold the (rows, vocabulary) logits: the linear layer and the cross-entropy computed
together, chunk by chunk over the rows: ours in torch operations (train_gpt2.py --loss_impl chunked), and
Liger-Kernel's Triton kernel (--loss_impl fused, a CUDA GPU's). At GPT-2's vocabulary the logits are the largest
activation of a step; here only (chunk, V) of them exist at once.

A head's objective is open: row_losses(lse, target_logit, targets) gives each row's terms from its logits'
log-sum-exp and its target's logit (the cross-entropy is lse - target_logit; z-loss adds c * lse**2), and every
head that takes it (the plain one through autograd, the chunked one folding their gradients into its own) gives
the mean of their sum over the rows whose target counts, and each term's mean to log.
"""

import importlib.util
import os

import torch

LOSS_IMPLS = ("plain", "chunked", "fused")
FUSED_CHUNK_BUDGET = 8  # --loss_impl fused: a chunk's logits at most 8 x (rows, C), Liger's chunk_mem_const (see below)


def cross_entropy_rows(lse, target_logit, targets):
    """The next-token loss alone, as row_losses (what every head computes when given none)."""
    return {"loss": lse - target_logit}


def row_terms(row_losses, lse, target_logit, targets, valid):
    """(the sum over the valid rows of every term, [each term's sum]) of row_losses' terms."""
    sums = [torch.where(valid, term, 0.0).sum() for term in row_losses(lse, target_logit, targets).values()]
    return sum(sums), sums


def term_names(row_losses):
    """The names of row_losses' terms, in order (it is called on no rows)."""
    empty = torch.zeros(0)
    return list(row_losses(empty, empty, empty.long()))


def logits_loss(logits, targets, row_losses, ignore_index=-1):
    """(loss, {name: mean}) of row_losses over materialised logits (N, V): the plain head's, in fp32 at least, as
    F.cross_entropy's softmax is under autocast; autograd differentiates the terms."""
    logits, valid = logits.to(torch.promote_types(logits.dtype, torch.float32)), targets != ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
    total, sums = row_terms(row_losses, lse, target_logit, targets, valid)
    n_valid = valid.sum()
    return total / n_valid, {name: term / n_valid for name, term in zip(term_names(row_losses), sums)}


def default_loss_chunk_size(vocab_size):
    """Rows per chunk of chunked_cross_entropy: the largest power of two whose (rows, V) fp32 block
    fits in 2 GiB, i.e. 8192 rows (1.65 GB) at GPT-2's padded vocab, against ~33 GB of bf16 logits,
    their fp32 copy and log-softmax in the plain loss at B=64, T=1024. Not smaller: every chunk
    reads and writes the whole fp32 (V, C) grad_weight (~0.5 GB of traffic at d12), and
    torch.compile unrolls the chunk loop (8 chunks at B·T = 65536)."""
    rows = max(1, 2**29 // vocab_size)
    return 1 << (rows.bit_length() - 1)

def _linear_cross_entropy_chunks(x, weight, targets, chunk_size, ignore_index, need_grad_x, need_grad_w, softcap=0.0,
                                 real_vocab=None, row_losses=None):
    """Mean cross-entropy of x @ weight.T (squashed to softcap * tanh(logits / softcap) when softcap > 0; the
    columns from real_vocab on, when given, -inf) against targets, and optionally its gradients w.r.t. x and weight,
    computed chunk by chunk over the rows so that only (chunk_size, V) logits ever exist. Under autocast the matmuls
    run in the autocast dtype; softmax and sums always run in >= fp32. row_losses: the objective's terms instead of
    the cross-entropy (the module's docstring); each row's gradient is then a * softmax + b * onehot(target), a and b
    the derivatives of its terms by its lse and target logit, taken per chunk. Returns (loss, grad_x, grad_w,
    [each term's mean] (row_losses') or [])."""
    device_type = x.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    acc = torch.promote_types(compute, torch.float32)
    xs, w = x.to(compute), weight.to(compute)  # one cast of the weight, as autocast's linear would do
    valid = targets != ignore_index
    n_valid = valid.sum()
    # the gradient scale clamps 0 to 1 so that all-ignored targets give zero gradients (and a nan
    # loss), as F.cross_entropy does; scaling after the matmuls keeps fp16 gradients from underflowing
    grad_scale = 1.0 / n_valid.clamp(min=1).to(acc)
    loss_sum = torch.zeros((), dtype=acc, device=x.device)
    term_sums = 0
    grad_x = torch.empty_like(x) if need_grad_x else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_grad_w else None
    for start in range(0, x.size(0), chunk_size):
        end = min(start + chunk_size, x.size(0))
        xc, ok = xs[start:end], valid[start:end]
        tc = torch.where(ok, targets[start:end], 0)  # any in-range index for ignored rows; masked below
        logits = (xc @ w.t()).to(acc)  # the only (rows, V) fp32 block (two with a softcap)
        if softcap:
            squashed = logits.div_(softcap).tanh_()  # in place: the fewest (rows, V) passes on a CPU too
            logits = squashed * softcap
        if real_vocab is not None:  # the padded vocabulary's ids: no probability, so no gradient either
            logits[:, real_vocab:] = float("-inf")
        lse = torch.logsumexp(logits, dim=1)
        target_logit = logits.gather(1, tc[:, None]).squeeze(1)
        if row_losses is None:
            loss_sum = loss_sum + torch.where(ok, lse - target_logit, 0.0).sum()
        else:  # the terms' sums, and their derivatives by each row's lse and target logit (a, b)
            (total, sums), pullback = torch.func.vjp(
                lambda lse, target_logit: row_terms(row_losses, lse, target_logit, targets[start:end], ok),
                lse, target_logit)
            a, b = pullback((torch.ones_like(total), [torch.zeros_like(t) for t in sums]))
            loss_sum, term_sums = loss_sum + total, [*map(sum, zip(term_sums, sums))] if term_sums else sums
        if not (need_grad_x or need_grad_w):
            continue
        # d(sum of row losses)/d logits = softmax - onehot(target), zero on ignored rows; in place
        dlogits = logits.sub_(lse[:, None]).exp_()
        if row_losses is None:
            dlogits.scatter_add_(1, tc[:, None], torch.full_like(lse[:, None], -1.0))
        else:  # a * softmax + b * onehot(target)
            dlogits.mul_(a[:, None]).scatter_add_(1, tc[:, None], b[:, None].to(dlogits.dtype))
        dlogits.masked_fill_(~ok[:, None], 0.0)
        if softcap:  # through the squash: d(softcap * tanh(z / softcap))/dz = 1 - tanh(z / softcap)^2
            dlogits.mul_(squashed.square_().neg_().add_(1.0))
        dlogits = dlogits.to(compute)
        if need_grad_x:
            grad_x[start:end] = (dlogits @ w).to(acc) * grad_scale
        if need_grad_w:
            if compute == acc:
                grad_w.addmm_(dlogits.t(), xc)
            else:  # low-precision matmul, fp32 accumulation across chunks
                grad_w += dlogits.t() @ xc
    loss = loss_sum / n_valid
    if need_grad_w:
        grad_w = (grad_w * grad_scale).to(weight.dtype)
    return loss, grad_x, grad_w, [term / n_valid for term in term_sums or []]

class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The loss head as one autograd node. Forward computes the loss and, while each chunk's logits
    exist, its gradients (as fused linear-cross-entropy heads do), so nothing (N, V) is kept and
    no logits are recomputed; backward only scales them by the incoming gradient. weight receives
    its gradient like any parameter, so a tied embedding accumulates both uses and DDP hooks fire."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk_size, ignore_index, need_grad_x, need_grad_w, softcap, real_vocab,
                row_losses):
        loss, grad_x, grad_w, terms = _linear_cross_entropy_chunks(x, weight, targets, chunk_size, ignore_index,
                                                                   need_grad_x, need_grad_w, softcap, real_vocab,
                                                                   row_losses)
        ctx.save_for_backward(grad_x, grad_w)
        if row_losses is None:
            return loss
        terms = torch.stack(terms)  # the terms' means, to log: their gradients are in the loss's
        ctx.mark_non_differentiable(terms)
        return loss, terms

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, *_):
        grad_x, grad_w = ctx.saved_tensors
        grad_x = grad_x * grad_loss if grad_x is not None else None
        grad_w = grad_w * grad_loss if grad_w is not None else None
        return grad_x, grad_w, None, None, None, None, None, None, None, None

def chunked_cross_entropy(x, weight, targets, chunk_size=None, ignore_index=-1, softcap=0.0, real_vocab=None,
                          row_losses=None):
    """F.cross_entropy(x @ weight.T, targets, ignore_index=ignore_index) (mean over the targets that
    are not ignore_index) without materialising the (N, V) logits: x (N, C) are the final hidden
    states, weight (V, C) the output embedding, targets (N,). Only (chunk_size, V) logits exist at a
    time (default: default_loss_chunk_size(V)). With gradients enabled the gradients are computed
    in the forward pass (see _ChunkedLinearCrossEntropy); without, only the loss. softcap > 0: the logits
    squashed first, as --logit_softcap's head does. real_vocab: the ids from it on (a padded vocabulary's) get no
    probability, as --mask_padding's head gives them none. row_losses: the objective's terms (the module's
    docstring); then (loss, {name: mean}) is returned."""
    if chunk_size is None:
        chunk_size = default_loss_chunk_size(weight.size(0))
    need_grad_x = torch.is_grad_enabled() and x.requires_grad
    need_grad_w = torch.is_grad_enabled() and weight.requires_grad
    if not (need_grad_x or need_grad_w):
        loss, _, _, terms = _linear_cross_entropy_chunks(x, weight, targets, chunk_size, ignore_index, False, False,
                                                         softcap, real_vocab, row_losses)
    else:
        out = _ChunkedLinearCrossEntropy.apply(x, weight, targets, chunk_size, ignore_index, need_grad_x, need_grad_w,
                                               softcap, real_vocab, row_losses)
        loss, terms = (out, None) if row_losses is None else out
    if row_losses is None:
        return loss
    return loss, dict(zip(term_names(row_losses), terms))


def linear_loss(impl, x, weight, targets, chunk_size=None, softcap=0.0, real_vocab=None, row_losses=None):
    """The loss of --loss_impl chunked or fused over hidden states x (N, C) and the head's weight (V, C):
    chunked_cross_entropy's or fused_cross_entropy's, with their arguments."""
    if impl == "chunked":
        return chunked_cross_entropy(x, weight, targets, chunk_size, softcap=softcap, real_vocab=real_vocab,
                                     row_losses=row_losses)
    if row_losses is not None:
        from nanogpt.cli import UserError

        raise UserError("--loss_impl fused: Liger-Kernel's kernel computes the cross-entropy alone, and this objective "
                        "has terms of its own (batch_loss's row_losses); use --loss_impl chunked, which takes them")
    return fused_cross_entropy(x, weight, targets, softcap=softcap, real_vocab=real_vocab)


def fused_cross_entropy(x, weight, targets, ignore_index=-1, softcap=0.0, real_vocab=None):
    """F.cross_entropy(x @ weight.T, targets, ignore_index=ignore_index) by Liger-Kernel's fused linear
    cross-entropy (a Triton kernel: a CUDA GPU's, or Triton's interpreter on a CPU with TRITON_INTERPRET=1), which
    like the chunked head computes the gradients in the forward pass, a chunk of rows at a time, and never holds
    the (N, V) logits. softcap and real_vocab as chunked_cross_entropy's. One opaque operation to torch.compile (a
    custom op): no graph break, and inductor never rewrites the kernel's buffers. Without gradients (the
    evaluations) the chunked head's loss, the same number."""
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return chunked_cross_entropy(x, weight, targets, ignore_index=ignore_index, softcap=softcap,
                                     real_vocab=real_vocab)
    device_type = x.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    loss, _, _ = fused_linear_cross_entropy(x, weight, targets, compute, float(softcap), real_vocab or weight.size(0),
                                            ignore_index)
    return loss


@torch.library.custom_op("nanogpt::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, compute: torch.dtype,
                               softcap: float, real_vocab: int, ignore_index: int
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, grad_x, grad_weight) of fused_cross_entropy by Liger-Kernel's forward, the matmuls in compute;
    a custom op (one operation to torch.compile), whose gradient (autograd's, below) scales the two by the incoming
    one. Liger-Kernel is imported at the first call."""
    from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

    with torch.autocast(x.device.type, enabled=False):  # the casts autocast's linear would make, made here
        total, _, _, _, grad_x, grad_w, _ = fused_linear_cross_entropy_forward(
            x.to(compute), weight[:real_vocab].to(compute), targets, ignore_index=ignore_index, reduction="sum",
            softcap=softcap or None, accum_dtype=torch.float32, compute_gradients=True, weight_requires_grad=True,
            chunk_mem_const=FUSED_CHUNK_BUDGET)
    # the mean, scaled on the device (the kernel's own "mean" scales by a count it reads on the host)
    n_valid = (targets != ignore_index).sum()
    scale = 1.0 / n_valid.clamp(min=1)
    if real_vocab < weight.size(0):  # the padding's rows: no gradient
        grad_w = torch.cat([grad_w, grad_w.new_zeros((weight.size(0) - real_vocab, weight.size(1)))])
    return total / n_valid, (grad_x.float() * scale).to(x.dtype), (grad_w.float() * scale).to(weight.dtype)


@fused_linear_cross_entropy.register_fake
def _(x, weight, targets, compute, softcap, real_vocab, ignore_index):
    return x.new_empty((), dtype=torch.float32), torch.empty_like(x), torch.empty_like(weight)


def _keep_gradients(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _scaled_gradients(ctx, grad_loss, _grad_x, _grad_w):
    grad_x, grad_w = ctx.saved_tensors
    return grad_x * grad_loss, grad_w * grad_loss, None, None, None, None, None


fused_linear_cross_entropy.register_autograd(_scaled_gradients, setup_context=_keep_gradients)


def fused_head_problem(device_type):
    """Why --loss_impl fused cannot run here, in words, or None: Liger-Kernel is not installed, or the device runs
    no Triton kernel (a CUDA GPU does; a CPU only under Triton's interpreter, TRITON_INTERPRET=1, for tests)."""
    if importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None:
        return ("needs Liger-Kernel (`pip install liger-kernel` on a CUDA machine; it brings Triton); or use "
                "--loss_impl chunked, the same head in torch operations")
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"runs Triton kernels, which need a CUDA GPU (this run's device is {device_type}); use --loss_impl "
                "chunked, the same head in torch operations")
    return None
