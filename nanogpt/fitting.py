"""
The micro-batch that fits the device (docs/training.md, "Fitting the GPU"). Gradient accumulation makes the
micro-batch a free choice: any divisor of a process's share of --total_batch_size trains the same run up to
float rounding. `--batch_size auto` (the default on CUDA and MPS) tries the largest first with one real
training step that changes nothing, and takes the first that fits on every process; a step that runs out of
memory later is run again from its start at half the micro-batch.
"""

import argparse
import collections
import contextlib
import copy
import functools
import gc

import torch

from nanogpt import arguments
from nanogpt.cli import UserError
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
    if value < 1:  # argparse shows an ArgumentTypeError's words (of a ValueError, this function's name)
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive whole number nor auto")
    return value


def fits_by_trial(args, ckpt, device_type):
    """Whether this run picks its micro-batch by trial: --batch_size auto, or on a GPU (CUDA, MPS) the default
    (the preset's, 64 for GPT-2) on a fresh run. A resumed run keeps its checkpoint's unless told; on a CPU the
    default stays the lecture's, as given."""
    return args.batch_size == "auto" or ("batch_size" not in args.explicit and ckpt is None and device_type != "cpu")


def largest_batch_size(args, preset_batch_size, config, params, dtype, device_type, world_size, local_world_size,
                       free_gpu_bytes=None, smallest=int):
    """(the micro-batch --batch_size auto tries first, [the larger ones left out]): the largest divisor of this
    process's share of the total batch up to --batch_size (auto: the preset's micro-batch); on a CPU, whose
    out-of-memory the kernel answers by killing the process, the largest whose estimated memory
    (arguments.run_estimated_bytes, with the process's margin: cpu_process_bytes) is available; under --fsdp on a
    GPU, which takes no trial (a sharded step's collectives cannot be tried one process at a time), the largest whose
    estimate, its weights and their state sharded, fits the GPU's free memory (free_gpu_bytes: its measure). Each
    process measures its own memory, so the processes agree on the smallest of their picks (smallest:
    smallest_of_every_rank's), which every one then tries first: ranks running different numbers of micro-steps
    would hang in their collectives."""
    cap = args.batch_size if args.batch_size != "auto" else preset_batch_size
    candidates = candidate_batch_sizes(args.total_batch_size, args.seq_len, world_size, cap)
    estimate = functools.partial(arguments.run_estimated_bytes, config, params, args, dtype=dtype,
                                 device_type=device_type)
    fits = None
    if device_type == "cpu" and (have := arguments.available_memory_bytes()) is not None:
        def fits(b):
            return arguments.cpu_process_bytes(estimate(b)) * local_world_size <= have
    elif device_type == "cuda" and args.fsdp and world_size > 1:
        free = free_gpu_bytes() if free_gpu_bytes else torch.cuda.mem_get_info()[0]

        def fits(b):
            return arguments.fits_on_gpu(estimate(b, shards=world_size), free)
    if fits is not None:
        candidates = [b for b in candidates if fits(b)] or candidates[-1:]
    first = smallest(candidates[0] if candidates else 1)  # none: the share is not whole rows (check_batch_split)
    return first, [b for b in candidate_batch_sizes(args.total_batch_size, args.seq_len, world_size, cap) if b > first]


def smallest_of_every_rank(ddp, device):
    """smallest(n) for largest_batch_size: the smallest n of every process (an all-reduce of the minimum)."""
    if not ddp:
        return int

    def smallest(n):
        import torch.distributed as dist

        value = torch.tensor([n], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value.item())
    return smallest


def describe_split(batch_size, seq_len, world_size, total_batch_size):
    """The batch split in words: `8 x 256 tokens x 1 process x 2 accumulation steps = 4096 tokens a step`."""
    steps = total_batch_size // (batch_size * seq_len * world_size)
    return (f"{batch_size} x {seq_len} tokens x {world_size} process{'es' * (world_size != 1)} x {steps} accumulation "
            f"step{'s' * (steps != 1)} = {total_batch_size} tokens a step")


def batch_ramp(args, world_size, ckpt):
    """The batch warm-up's start and rounding unit in tokens, micro_batches_per_step's keywords: fixed when
    the run starts, from the largest micro-batch it may take (--batch_size, or the largest auto tries first; every
    smaller one it may pick, or an out-of-memory retry falls to, divides it), and kept in its checkpoints (key
    "ramp"), so that --batch_size auto, a retry and a resume elsewhere train the same tokens each step. A checkpoint
    written before the key existed ramps as it did: in whole micro-batches of the run's micro-batch at each step. A
    --batch_size_start a resume gives is the ramp's start from there. {}: no warm-up."""
    if not args.batch_size_warmup_tokens:
        return {}
    if ckpt is not None:
        ramp = ckpt.get("ramp", {"start": args.batch_size_start})
        return {**ramp, "start": args.batch_size_start or ramp.get("start")}
    unit = args.batch_size * args.seq_len * world_size
    return {"start": args.batch_size_start or unit, "unit": unit}


def micro_batches_per_step(tokens_seen, micro, total, warmup_tokens=0, start=None, unit=None):
    """Micro-batches (of micro = batch_size * seq_len * world_size tokens) each process runs in the step
    that starts after tokens_seen tokens: total // micro, or during a batch warm-up (GPT-3's) a batch that
    grows linearly in tokens seen from `start` tokens to `total` over warmup_tokens, rounded down to whole
    `unit`s of tokens (at least one); integer arithmetic, so every rank agrees. unit (default: micro) and start
    (default: unit) are batch_ramp's: fixed when the run starts, so the micro-batch does not change the ramp."""
    full = total // micro
    if tokens_seen >= warmup_tokens:
        return full
    unit = unit or micro
    start = start or unit
    tokens = max(unit, min(total, (start + (total - start) * tokens_seen // warmup_tokens) // unit * unit))
    return tokens // micro


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


def update_count(state):
    """A parameter's count of updates in AdamW's state (its "step"), as a 0-d tensor of this process."""
    count = torch.as_tensor(state["step"])
    return (count.to_local() if hasattr(count, "to_local") else count).detach().float().reshape(())


def update_count_now(optimizer):
    """AdamW's count of updates (its "step") as it is before an optimizer step, or None (no state yet, or another
    optimizer beside AdamW: Muon keeps no count), copied without waiting for the device: one parameter's, since
    between steps every parameter's count is the same (each step updates them all, or skips them all). What
    weights_untouched compares a failed step with; a few operations a step, whatever the model's size."""
    optimizers = local_optimizers(optimizer)
    if not all(isinstance(opt, torch.optim.Adam) for opt in optimizers):  # (AdamW is one) another keeps no count
        return None
    for opt in optimizers:
        for state in opt.state.values():
            return update_count(state).clone() if "step" in state else None
    return None


def weights_untouched(optimizer, before):
    """Whether an optimizer step that failed changed no weight: every parameter's update count is still before's
    (update_count_now's before the step; none: 0, and a parameter whose state the step made counts 0), and no state
    keeps no count (Muon's momentum: its update may have begun). A group's counts move as its update begins, so a
    group begun shows. The state the step made (zeros) is dropped."""
    was = float(before) if before is not None else 0.0
    made = []
    for opt in local_optimizers(optimizer):
        for p, state in opt.state.items():
            if "step" not in state or update_count(state).item() != was:
                return False
            if was == 0.0:
                made.append((opt, p))
    for opt, p in made:
        del opt.state[p]
    return True


def trial_step(model, optimizer, loss_of, batch_size, seq_len, device, autocast):
    """A training step's peak at this micro-batch, changing nothing: a forward and backward, the optimizer's step
    at a rate of 0 on zero gradients (the weights stay as they are, bit for bit), which makes its state, then a
    second forward and backward with that state and the gradients held, as every later micro-step of a run has
    them; the tokens are zeros (no random draw, no data read). Every optimizer's state and its groups' settings
    (counters an optimizer keeps there too) are put back as they were. loss_of: the loop's objective
    (train_gpt2.batch_loss). model: the training module (under DDP its wrapper, whose gradients are not synchronised
    here). Raises what the step raises: an out-of-memory among others."""
    optimizers = local_optimizers(optimizer)
    kept = [(copy.deepcopy(opt.state_dict()["param_groups"]), dict(opt.state)) for opt in optimizers]
    model.train()  # the graph training runs (a loaded model comes in eval mode)
    try:
        x = torch.zeros((batch_size, seq_len), dtype=torch.long, device=device)
        forward_backward(model, loss_of, x, autocast)
        for opt in optimizers:
            opt.state = collections.defaultdict(dict)  # the step makes its own; the kept one is not touched
            for group in opt.param_groups:
                group["lr"] = 0.0
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.zero_()
            with getattr(opt, "alone", contextlib.nullcontext)():  # no collective (Muon's: see alone)
                opt.step()
        forward_backward(model, loss_of, x, autocast)  # a real step's peak: its optimizer state and gradients held
    finally:
        for opt, (settings, state) in zip(optimizers, kept):
            for group, setting in zip(opt.param_groups, settings):
                params = group["params"]
                group.clear()
                group.update(setting, params=params)
            opt.state = collections.defaultdict(dict, state)
        optimizer.zero_grad(set_to_none=True)


def forward_backward(model, loss_of, x, autocast):
    # targets apart from the inputs, as the loop's are: torch.compile guards on the two being one tensor, and would
    # compile a graph for the trial that training never uses. Under DDP through its wrapper (so that Dynamo splits
    # the graph at the gradient buckets as training's is), but without its all-reduce: ranks try on their own
    with getattr(model, "no_sync", contextlib.nullcontext)():
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


def fit_batch_size(candidates, fits, agree, say, split=str, skipped=()):
    """The first of candidates (largest first) for which fits(batch_size) holds on every process: agree(ok) is
    every process's verdict together (all of them call it for the same candidate). Says in one line what it
    tried, what fit and the split it makes (split(batch_size): describe_split's words); skipped: the larger
    micro-batches left out before any trial (the CPU's memory estimate). Raises UserError when none does."""
    tried = []
    left_out = f"{', '.join(map(str, skipped))} left out (estimated memory above what is available); " if skipped else ""
    for batch_size in candidates:
        if agree(fits(batch_size)):
            tries = f"{', '.join(map(str, tried))} did not fit; " if tried else f"tried {batch_size} first, it fits; "
            say(f"--batch_size auto: {left_out}{tries}micro-batch {batch_size}: {split(batch_size)}")
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
