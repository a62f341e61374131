"""
The micro-batch that fits the device (docs/training.md, "Fitting the GPU"). Gradient accumulation makes the
micro-batch a free choice: any divisor of a process's share of --total_batch_size trains the same run up to
float rounding. `--batch_size auto` (the default on CUDA and MPS) tries the largest first with one real
training step that changes nothing, and takes the first that fits on every process; a step that runs out of
memory later is run again from its start at half the micro-batch.
"""

import contextlib
import gc

import torch

from nanogpt import arguments
from nanogpt.cli import UserError
from nanogpt.muon import Muon
from nanogpt.optimizers import local_optimizers
from nanogpt.runtime import is_out_of_memory


def batch_size_arg(text):
    """--batch_size: a positive whole number, or auto."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{text!r} is neither a positive whole number nor auto")
    return value


def fits_by_trial(args, ckpt, device_type):
    """Whether this run picks its micro-batch by trial: --batch_size auto, or on a GPU (CUDA, MPS) the default
    (the preset's, 64 for GPT-2) on a fresh run. A resumed run keeps its checkpoint's unless told; on a CPU the
    default stays the lecture's, as given."""
    return args.batch_size == "auto" or ("batch_size" not in args.explicit and ckpt is None and device_type != "cpu")


def micro_batches_per_step(tokens_seen, micro, total, warmup_tokens=0, start=None):
    """Micro-batches (of micro = batch_size * seq_len * world_size tokens) each process runs in the step
    that starts after tokens_seen tokens: total // micro, or during a batch warm-up (GPT-3's) a batch that
    grows linearly in tokens seen from `start` (default: one micro-batch) to `total` over warmup_tokens,
    rounded down to whole micro-batches (at least one); integer arithmetic, so every rank agrees."""
    full = total // micro
    if tokens_seen >= warmup_tokens:
        return full
    start = start or micro
    return max(1, min(full, (start + (total - start) * tokens_seen // warmup_tokens) // micro))


def largest_batch_size(args, preset_batch_size, config, n_params, dtype, device_type, world_size, local_world_size):
    """The micro-batch --batch_size auto tries first: the largest divisor of this process's share of the total batch
    up to --batch_size (auto: the preset's micro-batch); on a CPU, whose out-of-memory the kernel answers by killing
    the process, the largest whose estimated memory (arguments.run_estimated_bytes) is available."""
    cap = args.batch_size if args.batch_size != "auto" else preset_batch_size
    candidates = candidate_batch_sizes(args.total_batch_size, args.seq_len, world_size, cap)
    have = arguments.available_memory_bytes() if device_type == "cpu" else None
    if have is not None:
        candidates = [b for b in candidates
                      if arguments.run_estimated_bytes(config, n_params, args, b, dtype, device_type) * local_world_size <= have
                      ] or candidates[-1:]
    return candidates[0] if candidates else 1  # none: the share is not whole rows, which check_batch_split names


def candidate_batch_sizes(total_batch_size, seq_len, world_size, cap):
    """Micro-batches a process may take, largest first: the largest divisor of its share of the total batch (in
    rows of seq_len tokens) up to cap, then that one's divisors, so that each splits the ones before it (as a
    --batch_size_start ramp needs). [] when the share is not whole rows (check_batch_split then names the fix)."""
    rows, left = divmod(total_batch_size, seq_len * world_size)
    if left or rows < 1:
        return []
    largest = next(b for b in range(min(cap, rows), 0, -1) if rows % b == 0)
    return [b for b in range(largest, 0, -1) if largest % b == 0]


def smaller_batch_size(batch_size):
    """The micro-batch a step that ran out of memory is tried again at: the largest divisor of batch_size up to
    half of it (half, when it is even), so that it still splits the total batch; None below 2."""
    return next((b for b in range(batch_size // 2, 0, -1) if batch_size % b == 0), None)


def trial_step(model, optimizer, loss_of, batch_size, seq_len, device, autocast, reserve_bytes=0):
    """A training step's peak at this micro-batch, changing nothing: a forward and backward, the optimizer's step
    at a rate of 0 on zero gradients (the weights stay as they are, bit for bit), which makes its state, then a
    second forward and backward with that state and the gradients held, as every later micro-step of a run has
    them; the tokens are zeros (no random draw, no data read), and the state is dropped again (the trial runs
    before a fresh run's first step, whose optimizer has none). reserve_bytes: memory held besides (DDP's
    gradient buckets). loss_of: the loop's objective (train_gpt2.batch_loss). Raises what the step raises: an
    out-of-memory among others."""
    reserve = torch.empty(reserve_bytes, dtype=torch.uint8, device=device) if reserve_bytes else None
    model.train()  # the graph training runs (a loaded model comes in eval mode)
    try:
        x = torch.zeros((batch_size, seq_len), dtype=torch.long, device=device)
        forward_backward(model, loss_of, x, autocast)
        for opt in local_optimizers(optimizer):
            rates = [group["lr"] for group in opt.param_groups]
            for group in opt.param_groups:
                group["lr"] = 0.0
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.zero_()
            try:
                with opt.alone() if isinstance(opt, Muon) else contextlib.nullcontext():  # no collective: see alone
                    opt.step()
            finally:
                for group, rate in zip(opt.param_groups, rates):
                    group["lr"] = rate
        forward_backward(model, loss_of, x, autocast)  # the peak of a real step: its optimizer state and gradients held
    finally:
        del reserve
        for opt in local_optimizers(optimizer):
            opt.state.clear()
        optimizer.zero_grad(set_to_none=True)


def forward_backward(model, loss_of, x, autocast):
    # targets apart from the inputs, as the loop's are: torch.compile guards on the two being one tensor, and would
    # compile a graph for the trial that training never uses
    with autocast:
        loss, _ = loss_of(model, x, torch.zeros_like(x))
    loss.backward()


def release_memory(device_type):
    """Give back what a failed step left: its tensors (held by the exception's frames until now) and, on a GPU,
    the allocator's cached blocks, so the next try starts from the same free memory."""
    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()
    elif device_type == "mps":
        torch.mps.empty_cache()


def fit_batch_size(candidates, fits, agree, say):
    """The first of candidates (largest first) for which fits(batch_size) holds on every process: agree(ok) is
    every process's verdict together (all of them call it for the same candidate). Raises UserError when
    none does."""
    tried = []
    for batch_size in candidates:
        if agree(fits(batch_size)):
            if tried:
                say(f"--batch_size auto: {', '.join(map(str, tried))} did not fit; micro-batch {batch_size}")
            return batch_size
        tried.append(batch_size)
    raise UserError("--batch_size auto: not even a micro-batch of 1 fits in memory; lower --seq_len, pick a smaller "
                    "--model, or try --recompute or --loss_impl chunked")


def fits_in_memory(step, device_type):
    """A function of batch_size: whether step(batch_size) ran without running out of memory (any other error
    is raised)."""
    def fits(batch_size):
        try:
            step(batch_size)
            return True
        except Exception as e:  # noqa: BLE001 (only an out-of-memory is an answer; the rest is raised)
            if not is_out_of_memory(e):
                raise
        release_memory(device_type)
        return False
    return fits


def every_rank_agrees(ddp, device):
    """agree() for fit_batch_size: True only where every process's ok is (an all-reduce of the minimum)."""
    if not ddp:
        return bool

    def agree(ok):
        import torch.distributed as dist

        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())
    return agree
