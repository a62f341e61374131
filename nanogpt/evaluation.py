"""
What the evaluations (HellaSwag's nanogpt/hellaswag_eval.py, CORE's nanogpt/core_eval.py) share: their data
downloaded once, read line by line with errors naming the line, handed from rank 0 to the others under
torchrun; continuations scored many rows per forward pass; and the run of their command lines (hellaswag.py,
evaluate.py) around it.
"""

import codecs
import os
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from nanogpt.arguments import check_scoring_context
from nanogpt.checkpoints import newest_checkpoint
from nanogpt.cli import UserError
from nanogpt.files import atomic_write
from nanogpt.runtime import RankZeroWork, autocast_context, is_out_of_memory, pick_dtype

PAD_MULTIPLE = 32  # a compiled model's batch lengths are rounded up to this, so it sees few shapes

# -----------------------------------------------------------------------------
# Data


def download(url, path, fix):
    """Fetch url into path with a progress bar: to a temporary name first, so an interrupted download never
    leaves a partial file under the final name. fix: what to do instead, for the message when it fails."""
    import urllib.request

    from tqdm import tqdm

    try:  # torchrun ranks may download at once: each writes its own temporary file, and the rename is atomic
        with urllib.request.urlopen(url, timeout=60) as response, atomic_write(path) as f:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {os.path.basename(path)}") as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
            if total is not None and f.tell() != total:
                raise OSError(f"got {f.tell()} of {total} bytes")
    except OSError as e:  # URLError and HTTPError are OSErrors too
        raise UserError(f"cannot download {url} ({e}); check the network, or {fix}") from None


def text_lines(data, path, fix):
    """(line number, text) of each line of data (a file's bytes) that is not blank. A byte-order mark at the
    start is read past; a line that is not UTF-8 is named by its number (fix: what to give instead)."""
    if data.startswith(codecs.BOM_UTF8):  # a byte-order mark (Windows editors) at the start of the file
        data = data[len(codecs.BOM_UTF8):]
    for lineno, raw in enumerate(data.splitlines(), 1):  # \n, \r\n or \r, as text mode splits
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1} of the line is {raw[e.start]:#04x}); "
                            f"{fix}") from None
        if line.strip():
            yield lineno, line


def from_rank0(load, ddp, rank, device):
    """load() on rank 0, its result handed to the other ranks under torchrun: a pipe can be read once, by one
    process, and a download is made once. Rank 0's error ends every rank alike."""
    if not ddp:
        return load()
    import torch.distributed as dist

    rank0 = RankZeroWork(ddp, rank == 0, device)
    shared = [rank0.do(load)]
    rank0.agree()
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


# -----------------------------------------------------------------------------
# Scoring


def unwrap(model):
    """The GPT module inside torch.compile / DDP wrappers (for its config)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module"):
            model = model.module
        else:
            return model


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def scoring_context(model, what):
    """The model's context (block_size); a context of one token, a --seq_len 1 run's, predicts nothing, so
    every continuation would tie at a loss of 0: refused, naming `what` it was to score."""
    block_size = unwrap(model).config.block_size
    check_scoring_context(block_size, what, "use a checkpoint of a run with --seq_len 2 or more")
    return block_size


def pad_multiple_of(model, pad_multiple):
    """pad_multiple, by default PAD_MULTIPLE for a compiled model (buckets spare it recompiles), else 1 (eager,
    every pad token is waste)."""
    if pad_multiple is not None:
        return pad_multiple
    return PAD_MULTIPLE if hasattr(model, "_orig_mod") else 1


@torch.no_grad()
def score_rows(model, rows, R, T, device, n_vocab=None):
    """One forward pass over rows, a list of (tokens, k) with len(tokens) <= T: for each row, the summed
    cross-entropy of its last k tokens and whether greedy decoding (the argmax at each position) gives every
    one of them. Two CPU tensors of len(rows).

    The rows are right-padded to T tokens, and the batch to R rows with empty ones (one shape for a compiled
    model); padding only sits after the real tokens, so causal attention makes it invisible to them.
    n_vocab: score over the tokenizer's tokens only (a padded vocabulary's extra logits are left out)."""
    idx = torch.zeros(R, T, dtype=torch.long)
    targets = torch.zeros(R, T, dtype=torch.long)
    scored = torch.zeros(R, T, dtype=torch.bool)  # positions whose next token is one to score
    for r, (tokens, k) in enumerate(rows):
        t = torch.as_tensor(tokens, dtype=torch.long)
        idx[r, : len(t)] = t
        targets[r, : len(t) - 1] = t[1:]
        scored[r, len(t) - 1 - k : len(t) - 1] = True
    idx, targets, scored = idx.to(device), targets.to(device), scored.to(device)
    logits, _ = model(idx)
    sel = logits[scored][:, :n_vocab].float()  # only the scored positions
    wanted = targets[scored]
    losses = F.cross_entropy(sel, wanted, reduction="none")
    misses = (sel.argmax(1) != wanted).float()
    row_of_loss = scored.nonzero()[:, 0]
    sums = torch.zeros(R, device=losses.device).index_add_(0, row_of_loss, losses)
    missed = torch.zeros(R, device=losses.device).index_add_(0, row_of_loss, misses)
    return sums[: len(rows)].cpu(), (missed[: len(rows)] == 0).cpu()


# -----------------------------------------------------------------------------
# The command line's run


@contextmanager
def evaluation_run(args, setup_distributed, load_model):
    """What an evaluation script's main() runs in: torchrun's process group joined (one share of the examples
    per process; left at the end), the device and --dtype picked, and the model of --checkpoint / --init_from
    loaded first (a wrong model fails before any download), compiled where asked (--compile's default: on
    CUDA). setup_distributed and load_model are train_gpt2's (the package imports no script)."""
    import torch.distributed as dist

    ddp, rank, _, world_size, device = setup_distributed(args.device)
    try:
        device_type = device.split(":")[0]
        dtype = pick_dtype(args.dtype, device_type)
        use_compile = args.compile if args.compile is not None else device_type == "cuda"
        model = load_model(args.checkpoint, args.init_from, device)
        source = newest_checkpoint(args.checkpoint) if args.checkpoint else args.init_from
        yield SimpleNamespace(ddp=ddp, rank=rank, master=rank == 0, world_size=world_size, device=device,
                              device_type=device_type, autocast=autocast_context(device_type, dtype),
                              model=torch.compile(model) if use_compile else model,
                              header=f"{source} | device {device} | dtype {dtype} | compile {use_compile} | "
                                     f"world size {world_size}")
    finally:
        if ddp and dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def out_of_memory_said(device, scoring, fix="lower --batch_size, or score on another --device (cpu)"):
    """Running out of memory inside is one line: scoring says what one pass held, fix what helps (a script's own
    flags; in the training loop, the flag that turns the evaluation off: its --batch_size does not reach it)."""
    try:
        yield
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        raise UserError(f"out of memory on {device} scoring {scoring}; {fix}") from None


def in_loop_fix(every, script):
    """out_of_memory_said's fix for an evaluation of the training loop, which --batch_size does not size."""
    return (f"the training loop's --batch_size does not size it: pass --{every} 0 to turn it off, and score the saved "
            f"checkpoints with {script} (its own --batch_size and --device)")
