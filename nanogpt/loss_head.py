"""
A loss head that never holds the (rows, vocabulary) logits: the linear layer and the cross-entropy
computed together, chunk by chunk over the rows (train_gpt2.py --loss_impl chunked). At GPT-2's
vocabulary the logits are the largest activation of a step; here only (chunk, V) of them exist at once.
"""

import torch

LOSS_IMPLS = ("plain", "chunked")

def default_loss_chunk_size(vocab_size):
    """Rows per chunk of chunked_cross_entropy: the largest power of two whose (rows, V) fp32 block
    fits in 2 GiB, i.e. 8192 rows (1.65 GB) at GPT-2's padded vocab, against ~33 GB of bf16 logits,
    their fp32 copy and log-softmax in the plain loss at B=64, T=1024. Not smaller: every chunk
    reads and writes the whole fp32 (V, C) grad_weight (~0.5 GB of traffic at d12), and
    torch.compile unrolls the chunk loop (8 chunks at B·T = 65536)."""
    rows = max(1, 2**29 // vocab_size)
    return 1 << (rows.bit_length() - 1)

def _linear_cross_entropy_chunks(x, weight, targets, chunk_size, ignore_index, need_grad_x, need_grad_w, softcap=0.0):
    """Mean cross-entropy of x @ weight.T (squashed to softcap * tanh(logits / softcap) when softcap > 0)
    against targets, and optionally its gradients w.r.t. x and weight, computed chunk by chunk over the rows
    so that only (chunk_size, V) logits ever exist. Under autocast the matmuls run in the autocast dtype;
    softmax and sums always run in >= fp32."""
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
        lse = torch.logsumexp(logits, dim=1)
        target_logit = logits.gather(1, tc[:, None]).squeeze(1)
        loss_sum = loss_sum + torch.where(ok, lse - target_logit, 0.0).sum()
        if not (need_grad_x or need_grad_w):
            continue
        # d(sum of row losses)/d logits = softmax - onehot(target), zero on ignored rows; in place
        dlogits = logits.sub_(lse[:, None]).exp_()
        dlogits.scatter_add_(1, tc[:, None], torch.full_like(lse[:, None], -1.0))
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
    return loss, grad_x, grad_w

class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The loss head as one autograd node. Forward computes the loss and, while each chunk's logits
    exist, its gradients (as fused linear-cross-entropy heads do), so nothing (N, V) is kept and
    no logits are recomputed; backward only scales them by the incoming gradient. weight receives
    its gradient like any parameter, so a tied embedding accumulates both uses and DDP hooks fire."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk_size, ignore_index, need_grad_x, need_grad_w, softcap):
        loss, grad_x, grad_w = _linear_cross_entropy_chunks(x, weight, targets, chunk_size, ignore_index,
                                                            need_grad_x, need_grad_w, softcap)
        ctx.save_for_backward(grad_x, grad_w)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        grad_x = grad_x * grad_loss if grad_x is not None else None
        grad_w = grad_w * grad_loss if grad_w is not None else None
        return grad_x, grad_w, None, None, None, None, None, None

def chunked_cross_entropy(x, weight, targets, chunk_size=None, ignore_index=-1, softcap=0.0):
    """F.cross_entropy(x @ weight.T, targets, ignore_index=ignore_index) (mean over the targets that
    are not ignore_index) without materialising the (N, V) logits: x (N, C) are the final hidden
    states, weight (V, C) the output embedding, targets (N,). Only (chunk_size, V) logits exist at a
    time (default: default_loss_chunk_size(V)). With gradients enabled the gradients are computed
    in the forward pass (see _ChunkedLinearCrossEntropy); without, only the loss. softcap > 0: the logits
    squashed first, as --logit_softcap's head does."""
    if chunk_size is None:
        chunk_size = default_loss_chunk_size(weight.size(0))
    need_grad_x = torch.is_grad_enabled() and x.requires_grad
    need_grad_w = torch.is_grad_enabled() and weight.requires_grad
    if not (need_grad_x or need_grad_w):
        return _linear_cross_entropy_chunks(x, weight, targets, chunk_size, ignore_index, False, False, softcap)[0]
    return _ChunkedLinearCrossEntropy.apply(x, weight, targets, chunk_size, ignore_index, need_grad_x, need_grad_w,
                                            softcap)
