"""
What rank 0 records of a run: log.txt in build-nanogpt's line format, the lock that keeps a second run out
of the log folder, TensorBoard and W&B, and the console's step and summary lines.
"""

import os
import statistics
import sys
import time
from contextlib import suppress

import torch

from nanogpt.checkpoints import CHECKPOINT_RE, find_checkpoints
from nanogpt.cli import UserError, brief
from nanogpt.files import atomic_write, disk_advice, lock_folder, temporary_of, unlock_folder
from nanogpt.log_kinds import RUN_KINDS, timed_steps
from nanogpt.runtime import console


LOG_DIR_LOCK = "run.lock"  # in --log_dir while a run uses it; no checkpoint, log or temporary name matches it


def lock_log_dir(log_dir):
    """The lock that keeps a second run out of log_dir while this one uses it (files.lock_folder): held
    from once the run's set-up checks have passed until unlock_log_dir or the end of the process."""
    return lock_folder(log_dir, LOG_DIR_LOCK, "--log_dir", "another training run")


def unlock_log_dir(log_dir, fd):
    unlock_folder(log_dir, LOG_DIR_LOCK, fd)


def check_tracking(args):
    """--tensorboard / --wandb need optional packages: say which is missing before any work."""
    import importlib.util

    for flag, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(args, flag) and importlib.util.find_spec(package) is None:
            raise UserError(f"--{flag} needs the {package} package, which is not installed; "
                            f"`pip install {package}`, or drop --{flag}")


def tensorboard_run_folder(args, fresh):
    """The folder of this run's TensorBoard events: a subfolder of --tensorboard DIR of its own, so that
    runs sharing DIR show as separate runs and a resume purges only its own run's later points. A fresh run
    names a new one (start time and --log_dir's name) unless --tensorboard_run names it; a resumed run
    continues the checkpoint's. The name is kept in args, and so in every checkpoint."""
    if args.tensorboard_run:
        folder = os.path.join(args.tensorboard, args.tensorboard_run)
        if fresh and os.path.isdir(folder) and os.listdir(folder):
            raise UserError(f"--tensorboard_run {args.tensorboard_run}: {folder} already holds another run's events; "
                            "drop the flag (a new run gets a folder of its own) or name a new one")
        return folder
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.path.basename(os.path.abspath(args.log_dir))}"
    name, n = base, 1
    while os.path.lexists(os.path.join(args.tensorboard, name)):  # two runs started in the same second
        n += 1
        name = f"{base}-{n}"
    args.tensorboard_run = name
    return os.path.join(args.tensorboard, name)


class RunLog:
    """What rank 0 records of a run: log.txt in build-nanogpt's format (`<step> <kind> <value>`) and the
    same scalars for TensorBoard and W&B. A resumed run keeps the log up to its checkpoint's step and
    appends, continues the same TensorBoard curves (events from the checkpoint's step on are purged) and
    the same W&B run (its id is kept in the checkpoint's arguments). It holds the lock on --log_dir from
    open() to close(). Other ranks record nothing (args None)."""

    def __init__(self, args=None):
        self.log_dir = args.log_dir if args is not None else None
        self.path = os.path.join(args.log_dir, "log.txt") if args is not None else None
        self.tensorboard = self.wandb = self.lock = None

    def open(self, args, ckpt, ckpt_path, start_step):
        """The log folder, its lock and the trackers first, then the log itself: a refusal leaves log.txt
        as it was."""
        if self.path is None:
            return
        made = not os.path.isdir(args.log_dir)
        try:
            try:
                os.makedirs(args.log_dir, exist_ok=True)
                # locked before anything in the folder changes: a live run's temporaries are its writes in progress
                self.lock = lock_log_dir(args.log_dir)
                for name in os.listdir(args.log_dir):  # left by a process killed while writing
                    if (final := temporary_of(name)) and (final == "log.txt" or CHECKPOINT_RE.match(final)):
                        os.remove(os.path.join(args.log_dir, name))
            except OSError as e:
                raise UserError(f"cannot create --log_dir {args.log_dir} ({e.strerror or e}); "
                                "pick another folder") from None
            self.open_trackers(args, start_step if ckpt is not None else None)
        except UserError:
            self.unlock()
            if made:  # refused: no empty --log_dir left behind (rmdir leaves one that is not empty)
                with suppress(OSError):
                    os.rmdir(args.log_dir)
            raise
        if ckpt is not None:
            console(f"resuming from {ckpt_path} at step {ckpt['step'] + 1}")
        for path in find_checkpoints(args.log_dir) if ckpt is None and args.overwrite else []:
            try:  # asked for: the earlier run's checkpoints go, now that this run has passed its checks
                os.remove(path)
            except OSError as e:
                raise UserError(f"--overwrite: cannot delete {path} ({e.strerror or e}); delete it yourself, "
                                "or choose another --log_dir") from None
        try:
            if ckpt is not None:
                trim_log(self.path, ckpt["step"])
            elif os.path.lexists(self.path):
                os.remove(self.path)
        except OSError as e:
            raise UserError(f"cannot rewrite {self.path} ({e.strerror or e}); "
                            f"{disk_advice(e)}make it a writable file") from None

    def open_trackers(self, args, purge_step):
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            folder = tensorboard_run_folder(args, fresh=purge_step is None)
            try:
                self.tensorboard = SummaryWriter(folder, purge_step=purge_step)
            except OSError as e:
                raise UserError(f"--tensorboard {args.tensorboard}: cannot write there ({e.strerror or e}); "
                                "pick another folder") from None
        if args.wandb:
            import wandb

            if not args.wandb_id:
                args.wandb_id = os.urandom(6).hex()  # W&B's id alphabet; saved with the arguments in every checkpoint
            try:
                self.wandb = wandb.init(project=args.wandb, id=args.wandb_id, resume="allow",
                                        config={k: v for k, v in vars(args).items() if k not in ("explicit", "given_as")})
            except Exception as e:
                raise UserError(f"--wandb {args.wandb}: cannot start the W&B run ({brief(e)}); run `wandb login`, "
                                "or set WANDB_MODE=offline to log on this machine only") from None

    def record(self, step, lines, scalars):
        """`<step> <line>` into log.txt for each of lines (`<kind> <value>` each), the scalars to the trackers."""
        if self.path is None:
            return
        try:
            with open(self.path, "a") as f:
                f.write("".join(f"{step} {line}\n" for line in lines))
        except OSError as e:
            raise UserError(f"cannot append to {self.path} ({e.strerror or e}); "
                            f"{disk_advice(e)}pick another --log_dir") from None
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, step)
        if self.wandb is not None and scalars:  # (a line that describes the run has none)
            self.wandb.log(scalars, step=step)

    def close(self):
        try:
            if self.tensorboard is not None:
                self.tensorboard.close()
            if self.wandb is not None:
                self.wandb.finish()
        finally:
            self.tensorboard = self.wandb = None
            self.unlock()

    def unlock(self):
        unlock_log_dir(self.log_dir, self.lock)
        self.lock = None


def trim_log(log_file, last_step):
    """Keep the log lines of steps <= last_step (a resumed run appends after them)."""
    if not os.path.isfile(log_file):
        return
    with open(log_file, errors="replace") as f:
        lines = f.readlines()
    kept = [ln for ln in lines if ln.split() and ln.split()[0].isdigit() and int(ln.split()[0]) <= last_step]
    with atomic_write(log_file, "w") as f:
        f.writelines(kept)


def run_header(args, device, dtype, use_compile, world_size, model, accumulation_steps, lr_schedule, ramp=None,
               borrowed=(), val_rows=None):
    """The run's first lines: where it runs, the model, the batch split (and the batch warm-up's, ramp), the
    validation's size, the recipe and its learning-rate schedule, and the settings the run took from its --model
    preset or --recipe rather than the command line (borrowed: [(source, {name: value})], e.g. ("--model tiny",
    {"batch_size": 8})); val_rows: the rows of a validation batch, fixed when the run started (default: the
    micro-batch)."""
    B, T = args.batch_size, args.seq_len
    lines = [f"device {device} | dtype {dtype} | compile {use_compile} | world size {world_size}",
             f"model {model.config} | {model.num_params():,} parameters",
             f"total batch {args.total_batch_size} tokens = {B} x {T} x {world_size} ranks "
             f"x {accumulation_steps} accumulation steps"]
    if args.eval_every:
        rows = val_rows or B
        lines.append(f"validation {args.val_steps * rows * T * world_size:,} tokens every {args.eval_every} steps = "
                     f"{args.val_steps} val_steps x {rows} x {T} x {world_size} ranks")
    lines.append(f"recipe {args.recipe} | optimizer {args.optimizer} | lr schedule {lr_schedule.describe()}")
    for source, settings in borrowed:
        if settings:
            values = ", ".join(f"--{name} {value}" + (f" (now {getattr(args, name)})" if getattr(args, name) != value
                                                      else "") for name, value in settings.items())
            lines.append(f"from {source} (not given on the command line): {values}")
    if args.init_from != "scratch" and not args.resume:
        preset = f"; --model {args.model} brings only its run settings" if "model" in args.explicit else ""
        lines.append(f"weights from --init_from {args.init_from}, with their shape{preset}; trained without dropout "
                     "(a transformers config's dropout settings are not used)")
    if args.batch_size_warmup_tokens:
        ramp = ramp or {}  # nanogpt.fitting.batch_ramp's
        unit = ramp.get("unit") or B * T * world_size
        lines.append(f"batch warm-up: from {ramp.get('start') or unit} to {args.total_batch_size} tokens per step over "
                     f"the first {args.batch_size_warmup_tokens:,} tokens, in steps of {unit} tokens")
    return "\n".join(lines)


def step_line(step, max_steps, loss, lr, norm, dt, tokens, flops_per_token, peak, eta, finite, ramping=False,
              other_rates=None, numbers=None):
    """The console's line of a step (`ramping`: the batch still grows, so its size is shown too; other_rates:
    {name: rate} of the optimizers beside AdamW, whose rate is lr; numbers: {name: value} logged beside the loss)."""
    tokens_per_sec = tokens / dt
    mfu = f"{100 * flops_per_token * tokens_per_sec / peak:.1f}%" if peak else "n/a"
    others = "".join(f" | {name} lr {rate:.4e}" for name, rate in (other_rates or {}).items())
    logged = "".join(f" | {name} {value:.6f}" for name, value in (numbers or {}).items())
    return (f"step {step:5d}/{max_steps} | loss {loss:.6f}{logged} | lr {lr:.4e}{others} | norm {norm:.4f} | "
            f"dt {dt * 1000:.2f}ms | tok/sec {tokens_per_sec:.0f} | mfu {mfu} | eta {format_seconds(eta)}"
            + (f" | batch {tokens} tokens" if ramping else "")
            + ("" if finite else " | SKIPPED (non-finite loss or grad norm)"))


# log.txt's kinds of build-nanogpt's lines, this program's evaluations and the lines that describe a run: no number of
# batch_loss may take them
OWN_KINDS = ("train", "skipped", "val", "hella", "core", *RUN_KINDS)


def number_lines(numbers):
    """log.txt's lines (`<name> <value>`) of the numbers batch_loss logs beside the loss ({name: value}); a name that is
    not one word of ASCII letters, digits and _ (log.txt's lines are split at spaces), or is one of log.txt's own
    kinds, is a ValueError naming it."""
    for name in numbers:
        if not (name.isascii() and name.isidentifier()) or name in OWN_KINDS:
            raise ValueError(f"batch_loss logs a number named {name!r}: log.txt needs a name of ASCII letters, digits "
                             f"and _ that is none of {', '.join(OWN_KINDS)}")
    return [f"{name} {value:.6g}" for name, value in numbers.items()]


def step_scalars(loss, lr, norm, dt, tokens, tokens_seen, flops_per_token, peak, other_rates=None, numbers=None,
                 finite=True):
    """A step's numbers for TensorBoard / W&B (other_rates as step_line's: train/<name>_lr; numbers: train/<name>).
    A step skipped as non-finite (finite False) logs its loss as train/skipped_loss and train/skipped 1, as log.txt
    says `<step> skipped <loss>`: train/loss holds the steps applied."""
    loss = {"train/loss": loss} if finite else {"train/skipped_loss": loss, "train/skipped": 1}
    scalars = {**loss, "train/lr": lr, "train/grad_norm": norm, "train/tokens_per_sec": tokens / dt,
               "train/batch_tokens": tokens, "train/tokens": tokens_seen,
               **{f"train/{name}_lr": rate for name, rate in (other_rates or {}).items()},
               **{f"train/{name}": value for name, value in (numbers or {}).items()}}
    if peak:
        scalars["train/mfu"] = 100 * flops_per_token * tokens / dt / peak
    return scalars


def format_seconds(seconds):
    seconds = int(seconds)
    return (f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600
            else f"{seconds // 60}m{seconds % 60:02d}s")


def run_summary(step_times, flops_per_token, peak, device_type, val_loss, wall, tokens_seen=None,
                epoch_tokens=None, run_steps=None):
    """One line at the end of a run: the steps taken (this session's, and the run's when it was resumed),
    the median step time after warm-up (the first steps compile and fill caches), tokens/s, MFU, peak memory
    (the GPU's allocations on CUDA, else the process's resident memory), the tokens trained on in the whole
    run (and how many epochs of the train split that is), the last val loss and the wall time. step_times:
    this session's (seconds, tokens) of each step; run_steps: the run's steps so far, this session's included."""
    timed = timed_steps(step_times)
    if not timed:
        return "summary: no steps run"
    seconds, tokens = zip(*timed)
    ms = 1000 * statistics.median(seconds)
    # a fixed batch: from the median step; a batch still ramping up (--batch_size_warmup_tokens): over the timed steps
    tok_s = tokens[0] / (ms / 1000) if len(set(tokens)) == 1 else sum(tokens) / sum(seconds)
    steps = f"{len(step_times)} step{'s' * (len(step_times) != 1)}"
    if run_steps is not None and run_steps != len(step_times):  # resumed: the tokens below are the whole run's
        steps += f" this session, {run_steps} in the run"
    parts = [f"summary: {steps}", f"median {ms:.1f} ms/step over the last {len(timed)}", f"{tok_s:,.0f} tok/s"]
    if peak:
        parts.append(f"mfu {100 * flops_per_token * tok_s / peak:.1f}%")
    if device_type == "cuda":
        parts.append(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    elif (rss := peak_resident_bytes()) is not None:
        parts.append(f"peak memory {rss / 2**30:.2f} GiB (resident)")
    if tokens_seen is not None:
        parts.append(f"{tokens_seen:,} tokens in the run"
                     + (f" ({tokens_seen / epoch_tokens:.2f} epochs)" if epoch_tokens else ""))
    if val_loss is not None:
        parts.append(f"val loss {val_loss:.4f}")
    parts.append(f"wall {format_seconds(wall)}")
    return " | ".join(parts)


def peak_resident_bytes():
    """The most memory this process has held resident (its peak RSS), or None where it cannot be read."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
