"""
Muon with the matrices of one shape stepped together (train_gpt2.py --optimizer muon). The update is
torch.optim.Muon's (momentum, Nesterov, Newton-Schulz in bf16, the "original" learning-rate adjustment, decoupled
weight decay), with its defaults, parameter-group keys and per-parameter state ("momentum_buffer"), so each loads
the other's state dict. torch.optim.Muon steps one matrix at a time (~30 small ops each); here the matrices of a
shape are stacked and orthogonalised by batched matmuls, and each shape's momentum buffers are slices of one
tensor, so a step's op count does not grow with the number of matrices. Under DDP (a process_group) each rank
orthogonalises its share of each stack and all-gathers the others'. `found_inf` skips a step on the device.
"""

import contextlib
import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
NS_STEPS = 5
EPS = 1e-7


def newton_schulz(stack, coefficients, steps, eps):
    """The orthogonalised matrices of stack (n, A, B), in bf16: torch.optim.Muon's iteration on each matrix (the
    wide way round: a tall one is transposed in and out), each scaled first by its own Frobenius norm."""
    a, b, c = coefficients
    x = stack.bfloat16()
    tall = stack.size(-2) > stack.size(-1)
    if tall:
        x = x.mT
    x = x.div(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def orthogonalised(stack, coefficients, steps, eps, process_group=None):
    """newton_schulz of stack; with a process_group of several ranks (each holding the same stack) every rank
    computes its share of the matrices (the stack padded with zero matrices to a multiple of the ranks) and the
    shares are all-gathered."""
    if process_group is None:
        return newton_schulz(stack, coefficients, steps, eps)
    import torch.distributed as dist

    ranks, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    n = stack.size(0)
    share = -(-n // ranks)
    if share * ranks != n:
        stack = torch.cat([stack, stack.new_zeros((share * ranks - n, *stack.shape[1:]))])
    mine = newton_schulz(stack[rank * share:(rank + 1) * share], coefficients, steps, eps).contiguous()
    everyone = mine.new_empty((share * ranks, *mine.shape[1:]))
    dist.all_gather_into_tensor(everyone, mine, group=process_group)
    return everyone[:n]


def adjusted_lr(lr, adjust_lr_fn, shape):
    """torch.optim.Muon's rate for a matrix of shape (A, B): "original" (the default) lr * sqrt(max(1, A / B)),
    "match_rms_adamw" 0.2 * lr * sqrt(max(A, B))."""
    rows, cols = shape
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def same_shape(params):
    """params that have a gradient, in lists of one shape, dtype and device (in their first one's order)."""
    stacks = {}
    for p in params:
        if p.grad is not None:
            stacks.setdefault((p.shape, p.dtype, p.device), []).append(p)
    return list(stacks.values())


def stacked(buffers):
    """The tensor whose slices along dim 0 are buffers, in order, or None when they are not."""
    base = buffers[0]._base if buffers[0] is not None else None
    if base is None or base.shape[0] != len(buffers) or base.shape[1:] != buffers[0].shape:
        return None
    first, stride = base.storage_offset(), base.stride(0)
    if all(b is not None and b._base is base and b.storage_offset() == first + i * stride
           for i, b in enumerate(buffers)):
        return base
    return None


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update, stepped a shape at a time. process_group: None in one process; under DDP the
    group whose ranks share the Newton-Schulz work (every rank holds the same all-reduced gradients and applies
    the same whole update). found_inf: None, or a 0-d float tensor on the parameters' device that the caller sets
    before step(): where it is 1 the step leaves the weights and momentum buffers as they were, bit for bit,
    without the host reading it (as torch's fused AdamW takes it from a GradScaler)."""

    takes_found_inf = True  # step() skips on the device where found_inf is set (nanogpt.optimizers.step_if_finite)

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=EPS, ns_steps=NS_STEPS, adjust_lr_fn=None, process_group=None):
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        if ns_steps >= 100 or len(ns_coefficients) != 3:
            raise ValueError("ns_steps must be below 100 and ns_coefficients three numbers")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: "
                                     f"{p.size()}")
        self.process_group = process_group
        self.found_inf = None

    @contextlib.contextmanager
    def alone(self):
        """Steps inside orthogonalise every matrix on this process, with no collective: for a step that another
        rank may not reach (fitting's trial step, where a rank that ran out of memory stops before it)."""
        group, self.process_group = self.process_group, None
        try:
            yield self
        finally:
            self.process_group = group

    def momentum_stack(self, params, like=None):
        """The momentum buffers of params (one shape) as one tensor (n, A, B) whose slices are their state's
        "momentum_buffer"s: the one they already are, or a new one they are copied into (zeros where a parameter
        has none, or all zeros like `like`), which their state then holds."""
        buffers = [self.state[p].get("momentum_buffer") for p in params]
        stack = stacked(buffers)
        if stack is None:
            if like is not None and all(b is None for b in buffers):
                stack = torch.zeros_like(like)
            else:
                stack = torch.stack([torch.zeros_like(p) if b is None else b for p, b in zip(params, buffers)])
            for p, buffer in zip(params, stack.unbind(0)):
                self.state[p]["momentum_buffer"] = buffer
        return stack

    def load_state_dict(self, state_dict):
        """torch's, then each shape's loaded momentum buffers copied into one stack (now, while no gradients and
        activations are held, rather than at the next step)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            held = [p for p in group["params"] if "momentum_buffer" in self.state.get(p, {})]
            shapes = {}
            for p in held:
                shapes.setdefault((p.shape, p.dtype, p.device), []).append(p)
            for params in shapes.values():
                self.momentum_stack(params)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = None if self.found_inf is None else self.found_inf != 0
        for group in self.param_groups:
            for params in same_shape(group["params"]):
                self.step_stack(group, params, skip)
        return loss

    def step_stack(self, group, params, skip):
        """One step of params (one shape): torch.optim.Muon's arithmetic, element for element, on stacked tensors
        (the weights themselves by foreach ops). skip: None, or a 0-d bool tensor; where it is True, the momentum
        buffers are put back and the weights multiplied by 1 and moved by 0."""
        grads = torch.stack([p.grad for p in params])
        buffers = self.momentum_stack(params, like=grads)
        momentum, rest = group["momentum"], 1 - group["momentum"]
        if torch.is_tensor(momentum):  # a schedule's momentum computed on the device (a float64 0-d tensor)
            momentum, rest = momentum.to(grads.dtype), rest.to(grads.dtype)  # as a number is taken: rounded once
        moved = buffers.lerp_(grads, rest) if skip is None else buffers.lerp(grads, rest)
        update = grads.lerp_(moved, momentum) if group["nesterov"] else moved  # (grads: the stack, a copy)
        ortho = orthogonalised(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.process_group)
        # exact in the weights' dtype; contiguous like them, so that foreach ops take their fast path on a GPU
        ortho = ortho.to(params[0].dtype, memory_format=torch.contiguous_format)
        if skip is not None:
            buffers.copy_(torch.where(skip, buffers, moved))
            ortho = torch.where(skip, 0.0, ortho)
        lr, decay = group["lr"], 1 - group["lr"] * group["weight_decay"]
        if decay != 1:  # (x * 1 is x: torch.optim.Muon's multiplication by 1 left out)
            torch._foreach_mul_(params, decay if skip is None else torch.where(skip, 1.0, decay))
        torch._foreach_add_(params, ortho.unbind(0), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], params[0].shape))
