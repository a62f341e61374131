"""
The bookkeeping of a training run, so that train_gpt2.py's loop shows only the lecture's story: the
console (rank 0 speaks), log.txt and the trackers, checkpoints at their cadence (and the previous step's
when a step fails), the ranks' agreement at each step (a signal, rank 0's failure), the health of the
weights, and the summary line. A Run decides its own cadence; the loop calls it with plain names.
"""

import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from nanogpt.arguments import widening_flags
from nanogpt.checkpoints import checkpoint_path, find_checkpoints, prune_checkpoints, save_checkpoint, training_checkpoint
from nanogpt.cli import ReportedByRankZero, UserError
from nanogpt.fitting import release_memory, smaller_batch_size, update_count_now, weights_untouched
from nanogpt.log_kinds import PARAMS, STEP_MS, VAL_FINEWEB_EDU
from nanogpt.optimizers import MATRIX_OPTIMIZERS, rates_beside
from nanogpt.runlog import RunLog, number_lines, run_summary, step_line, step_scalars
from nanogpt.runtime import (STOP_SIGNALS, RankZeroWork, StopFlag, StuckCollectiveWatch, console, is_out_of_memory,
                             local_peers, peer_gone, peer_gone_error)
from nanogpt.shard_manifest import says_fineweb_edu
from nanogpt.sharding import gathered_state_dicts, optimizer_state_line


class Run:
    """One training run's bookkeeping, on every rank (rank 0 writes). Use it as a context: from start() on
    it catches SIGTERM, Ctrl-C, SIGHUP and SIGUSR1 (the loop stops after the step, with a checkpoint); at the end it
    closes the log, and turns a collective that failed because another process died into one line naming the
    checkpoint to resume."""

    def __init__(self, args, ddp, rank, device):
        self.args, self.ddp, self.rank, self.device = args, ddp, rank, device
        self.master, self.device_type = rank == 0, device.split(":")[0]
        self.say = console if self.master else (lambda *a, **k: None)
        self.warn = (lambda m: print(f"warning: {m}", file=sys.stderr)) if self.master else None
        self.rank0 = RankZeroWork(ddp, self.master, device)  # rank 0's work, failing on every rank alike
        self.log_file = RunLog(args if self.master else None)
        self.stop = StopFlag()
        self.step_times, self.bad_steps, self.val_loss = [], 0, None
        self.modes, self.evaluating = False, False  # an optimizer with modes; in eval mode now (evaluation_weights)

    def __enter__(self):
        self.old_handlers, self.stuck_watch, self.saving = {}, None, False
        return self

    def __exit__(self, kind, error, traceback):
        for s, handler in self.old_handlers.items():
            signal.signal(s, handler)
        if self.stuck_watch is not None:
            self.stuck_watch.stop()
        self.log_file.close()
        if self.ddp and isinstance(error, RuntimeError) and peer_gone(error):
            raise peer_gone_error(error, self.args.log_dir, self.rank) from None

    def on_rank0(self, work, *args):
        """work(*args) on rank 0, every rank waiting for it (and ending with it if it fails)."""
        self.rank0.do(work, *args)
        self.rank0.agree()

    def start(self, header, *, ckpt, ckpt_path, start_step, model, optimizer, scaler, loader, zero, fsdp, lr_schedule,
              flops_per_token, peak, fixed=None, warnings=()):
        """Everything is checked and built: open the log folder (rank 0) and print the run's header, then the
        warnings about its settings (arguments.settings_not_kept's lines). What a
        checkpoint saves: the (unwrapped) model, the optimizer (zero, fsdp: sharded how), the loss scaler, the
        loader's position, where lr_schedule was moved, what the run fixed when it started (fixed: the batch warm-up,
        validation's rows); flops_per_token and peak (FLOP/s, 0: unknown) give MFU."""
        self.model, self.optimizer, self.scaler, self.loader, self.fixed = model, optimizer, scaler, loader, fixed
        # the optimizer's step, through the loop's own call: an out-of-memory in it is one line (step_optimizer)
        self.optimizer_step, optimizer.step = optimizer.step, self.step_optimizer
        self.zero, self.fsdp, self.lr_schedule = zero, fsdp, lr_schedule
        self.flops_per_token, self.peak = flops_per_token, peak
        self.modes = MATRIX_OPTIMIZERS[self.args.optimizer].modes
        if self.modes and ckpt is not None:  # it holds the weights to evaluate: the trained ones back, as after a save
            optimizer.train()
        self.on_rank0(self.log_file.open, self.args, ckpt, ckpt_path, start_step)
        self.say(header)
        for line in warnings:  # with the header, on stdout: advice on the run's settings
            self.say(f"warning: {line}")
        if ckpt is None:  # what a plot of the log shows beside its curves (nanogpt.log_kinds)
            fineweb_edu = int(says_fineweb_edu(self.args.data_dir))
            self.rank0.do(self.log_file.record, start_step, [f"{PARAMS} {model.num_params()}",
                                                             f"{VAL_FINEWEB_EDU} {fineweb_edu}"], {})
        # from here SIGTERM (a scheduler's), Ctrl-C, SIGHUP (a closed terminal) and SIGUSR1 (Slurm's warning before a
        # time limit) end the run after the step, with a checkpoint
        self.old_handlers = {s: signal.signal(s, self.stop) for s in STOP_SIGNALS}
        peers = local_peers(self.rank) if self.ddp else {}
        if peers:  # a process that a signal finds waiting for a dead one cannot run that handler
            self.stuck_watch = StuckCollectiveWatch(self.args.log_dir, self.rank, peers, lambda: self.saving).start()
        self.start_step, self.t_start = start_step, time.time()

    def due(self, step, every):
        """Whether something done every `every` steps (0: never) is due at this step; the last step always."""
        return bool(every) and (step % every == 0 or step == self.args.max_steps - 1)

    def evaluation_due(self, step):
        """Whether one of the loop's evaluations (its *_every flags but --save_every) is due at this step."""
        return any(self.due(step, every) for name, every in vars(self.args).items()
                   if name.endswith("_every") and name != "save_every")

    @contextmanager
    def evaluation_weights(self, step=None):
        """The weights to evaluate in the model for the block inside: where --optimizer's entry has modes (an average
        of the weights, as schedule-free's and an EMA's), the optimizer is put in eval mode and back in train mode
        after; around the loop's evaluations (when one is due at `step`) and every checkpoint's state, which so holds
        the weights that hellaswag.py, evaluate.py and generate_tokens.py should load, and resumes exactly: a resume
        (start()) switches back to train mode as the saving run did after the save. Every rank enters it, outside any
        rank-0 branch (sampling's): a rank that did not switch would evaluate, or go on training, other weights. Inside
        it again: nothing more."""
        if not self.modes or self.evaluating or (step is not None and not self.evaluation_due(step)):
            yield
            return
        self.optimizer.eval()
        self.evaluating = True
        try:
            yield
        finally:
            self.evaluating = False
            self.optimizer.train()

    def log(self, step, line, scalars, text):
        """An evaluation's result: `text` on the console, `<step> <line>` in log.txt, the scalars to the trackers."""
        self.val_loss = scalars.get("val/loss", self.val_loss)  # the summary's
        self.say(text)
        self.rank0.do(self.log_file.record, step, [line], scalars)

    @contextmanager
    def keeping_progress(self, step, attempt=None):
        """Around a step's forward and backward passes: if they fail (out of memory, an error, Ctrl-C met in
        a collective), the weights are still those after the last step, so that state is saved first (plain
        and DDP runs; sharded state cannot be gathered while other ranks may be failing). With attempt (the
        training step's), an out-of-memory in one process is instead readied to run again at a smaller
        micro-batch (attempt.retry)."""
        loader_state = self.loader.state_dict()
        self.step, self.step_loader_state = step, loader_state  # the step running, and where its data began
        if attempt is not None:
            attempt.retry = False
        try:
            yield
        except BaseException as e:
            out_of_memory = isinstance(e, Exception) and is_out_of_memory(e)
            if attempt is not None and out_of_memory and self.ready_smaller_micro_batch(step, loader_state):
                attempt.retry = True
            else:
                if (self.master and step > self.start_step and not self.saved_at(step - 1)
                        and not (self.zero or self.fsdp) and weights_finite(self.model)):
                    path = self.save(step - 1, loader_state, self.tokens_seen)
                    self.say(f"stopping at step {step}: saved {path} first; --resume continues from there")
                if out_of_memory:
                    raise out_of_memory_error(e, self.args) from None
                raise
        if attempt is not None and attempt.retry:  # the failed try's tensors are free now: give the cache back too
            release_memory(self.device_type)

    def ready_smaller_micro_batch(self, step, loader_state):
        """After the training step ran out of memory in one process: its gradients dropped, the data position
        rewound to the step's start and the micro-batch made smaller (kept in args, so checkpoints save it), saying
        so. False where it cannot be: at a micro-batch of 1, or under torchrun, whose other processes are in the
        step's collectives already."""
        smaller = smaller_batch_size(self.args.batch_size)
        if self.ddp or smaller is None:
            return False
        self.optimizer.zero_grad(set_to_none=True)
        self.say(f"step {step}: out of memory at micro-batch {self.args.batch_size}; the step runs again from its start "
                 f"at {smaller} (gradient accumulation keeps --total_batch_size), and the run goes on at {smaller}")
        self.args.batch_size = self.loader.B = smaller
        self.loader.load_state_dict(loader_state)
        return True

    def step_optimizer(self, *args, **kwargs):
        """The optimizer's step (Run.start puts it in the optimizer's place). Where it runs out of memory (AdamW makes
        its state at its first step, two numbers a weight), a smaller micro-batch cannot help: one line naming what
        does, and the state after the last completed step saved first, where the failed update changed no weight."""
        before = update_count_now(self.optimizer)
        try:
            return self.optimizer_step(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (only an out-of-memory is answered here; the rest is raised)
            if not is_out_of_memory(e):
                raise
            untouched = weights_untouched(self.optimizer, before)
        self.optimizer.zero_grad(set_to_none=True)
        release_memory(self.device_type)
        step, wide = self.step, "".join(f", {flag}" for flag in widening_flags(self.args))
        shard = ("shard it across GPUs with --zero 1 or --fsdp (torchrun), or" if MATRIX_OPTIMIZERS[self.args.optimizer]
                 .shardable else f"--optimizer {self.args.optimizer} cannot be sharded (--zero 1, --fsdp), so")
        where = (f"out of memory in the optimizer's step at step {step}; a smaller --batch_size does not shrink the "
                 f"optimizer's state: {shard} pick a smaller --model{wide}")
        newest = find_checkpoints(self.args.log_dir)
        if not untouched:
            raise UserError(f"{where}; the update may have changed part of the weights, so nothing was saved after it; "
                            f"last good checkpoint: {newest[0] if newest else 'none'}")
        if self.master and step > self.start_step and not self.saved_at(step - 1) and not (self.zero or self.fsdp):
            newest = [self.save(step - 1, self.step_loader_state, self.tokens_seen)]
        resume = (f"--resume continues from {newest[0]}" if newest and step > 0
                  else "no step was completed, so nothing was saved")
        raise UserError(f"{where}; the weights are unchanged, {resume}")

    def log_step(self, step, loss, lr, norm, dt, tokens, tokens_seen, finite, numbers=None):
        """A training step's line on the console, in log.txt and to the trackers; then the weights' health.
        numbers: {name: value} the objective logs beside the loss (train_gpt2.batch_loss): the console, the trackers and
        log.txt (`<step> <name> <value>`, after the step's own line)."""
        self.step_times.append((dt, tokens))
        self.tokens_seen = tokens_seen  # trained on up to and with this step
        eta = (time.time() - self.t_start) / (step + 1 - self.start_step) * (self.args.max_steps - step - 1)
        others = rates_beside(self.optimizer)  # the matrices' optimizer's (Muon's), beside AdamW's lr
        self.say(step_line(step, self.args.max_steps, loss, lr, norm, dt, tokens, self.flops_per_token, self.peak, eta,
                           finite, bool(self.args.batch_size_warmup_tokens), others, numbers))
        self.rank0.do(self.log_file.record, step, [f"{'train' if finite else 'skipped'} {loss:.6f}",
                                                   *number_lines(numbers or {}), f"{STEP_MS} {dt * 1000:.1f}"],
                      step_scalars(loss, lr, norm, dt, tokens, tokens_seen, self.flops_per_token, self.peak, others,
                                   numbers, finite))
        self.bad_steps = 0 if finite else self.bad_steps + 1
        # the weights are looked at where it matters, not every step: after a non-finite step (did an update break
        # them?) and before a checkpoint (checkpoint())
        self.stop_if_broken(step, not finite and not weights_finite(self.model))

    def stop_if_broken(self, step, weights_broken):
        """Stop when the weights hold NaN or inf after this step (an update broke them: the steps skipped since have
        not), naming the last good checkpoint; or when too many steps in a row were skipped as non-finite, saving
        first the state they left, the last good update's (a skipped step changes nothing; its data is passed)."""
        if not weights_broken and self.bad_steps < self.args.max_bad_steps:
            return
        # every rank stops here alike (the ranks agree on the loss, the norm and the weights): rank 0 says why
        said = UserError if self.master else ReportedByRankZero
        if weights_broken:
            last_good = find_checkpoints(self.args.log_dir)
            raise said(f"the weights hold NaN or inf after step {step}: an update made them non-finite (nothing "
                       f"was saved after it); last good checkpoint: {last_good[0] if last_good else 'none'}; "
                       f"lower {rate_flags(self.args)}")
        path = self.save_on_every_rank(step, self.tokens_seen)
        steps = f"{self.bad_steps} non-finite step{'s' if self.bad_steps != 1 else ''}"
        raise said(f"{steps} in a row at step {step}; the weights were not updated by them, and the state after the "
                   f"last good update is saved in {path}; lower {rate_flags(self.args)} or check the data, then "
                   "--resume")

    def saved_at(self, step):
        """Whether --save_every checkpoints the state after this step."""
        return bool(self.args.save_every) and (step + 1) % self.args.save_every == 0

    def checkpoint(self, step, tokens_seen):
        """After a step: agree with the other ranks whether to stop (a signal to any of them, or rank 0's
        failure), save when --save_every, the last step or a stop asks for it, and say whether to stop."""
        stop_now = self.rank0.agree(self.stop.set)
        if step == self.args.max_steps - 1 or self.saved_at(step) or stop_now:
            self.stop_if_broken(step, not weights_finite(self.model))  # no checkpoint holds weights that broke
            self.save_on_every_rank(step, tokens_seen)
        if stop_now:
            self.say(f"stopped by signal after step {step}; "
                     f"`--resume` continues from {checkpoint_path(self.args.log_dir, step)}")
        return stop_now

    def save_on_every_rank(self, step, tokens_seen):
        """The checkpoint of the state after `step`, every rank taking part (under --zero 1 / --fsdp in gathering
        the state); its path."""
        with self.evaluation_weights():  # (every rank: under --zero 1 / --fsdp each takes part in gathering)
            gathered = self.freeing_memory_once(lambda: gathered_state_dicts(self.model, self.optimizer, self.zero,
                                                                             self.fsdp, self.master),
                                                f"gathering the state of step {step} for its checkpoint")
            self.rank0.do(self.save, step, self.loader.state_dict(), tokens_seen, gathered)
            del gathered  # under --zero 1 / --fsdp rank 0's gathered copies: not kept until the next save
        if self.ddp:
            self.rank0.agree()  # the barrier after a checkpoint: every rank leaves if it could not be written
        return checkpoint_path(self.args.log_dir, step)

    def save(self, step, loader_state, tokens_seen, gathered=None):
        """Rank 0: the checkpoint of the state after `step` (gathered: gathered_state_dicts' model and optimizer
        state under --zero 1 / --fsdp), with the weights to evaluate (evaluation_weights: checkpoint()'s on every rank;
        a save as a failing run stops, rank 0's alone), then --keep_checkpoints' pruning. Returns its path."""
        path = checkpoint_path(self.args.log_dir, step)
        self.saving = True  # StuckCollectiveWatch does not end a process while it writes a checkpoint
        try:  # (the state is copied to the host as it is written)
            with self.evaluation_weights():
                model_state, optimizer_state = gathered if gathered is not None else (self.model.state_dict(),
                                                                                   self.optimizer.state_dict())
                self.freeing_memory_once(lambda: save_checkpoint(path, training_checkpoint(
                    model_state, optimizer_state, self.model.config, step, tokens_seen, loader_state, self.scaler,
                    self.args, self.device_type, self.lr_schedule.moved(), self.fixed)), f"writing {path}")
        finally:
            self.saving = False
        if self.args.keep_checkpoints:
            prune_checkpoints(self.args.log_dir, step, self.args.keep_checkpoints)
        self.say(f"saved {path}")
        return path

    def freeing_memory_once(self, work, what):
        """work(), run once more after an out-of-memory, with what the step left freed first (its gradients, the
        allocator's cached blocks); a second out-of-memory is one line naming `what` (an atomic write leaves the
        earlier checkpoints intact)."""
        try:
            return work()
        except Exception as e:  # noqa: BLE001 (only an out-of-memory is answered here; the rest is raised)
            if not is_out_of_memory(e):
                raise
        self.optimizer.zero_grad(set_to_none=True)
        release_memory(self.device_type)
        try:
            return work()
        except Exception as e:  # noqa: BLE001
            if not is_out_of_memory(e):
                raise
        newest = find_checkpoints(self.args.log_dir)
        raise UserError(f"out of memory {what}, also after freeing the step's gradients and cached memory; earlier "
                        f"checkpoints are intact (newest: {newest[0] if newest else 'none'}): free memory on this "
                        "machine (other processes) and --resume") from None

    def summary(self, world_size, tokens_seen, epoch_tokens):
        """The run's last lines: optimizer state per rank (torchrun), then the summary."""
        if self.ddp:
            self.say(optimizer_state_line(self.optimizer, world_size, self.device))
        self.say(run_summary(self.step_times, self.flops_per_token, self.peak, self.device_type, self.val_loss,
                             time.time() - self.t_start, tokens_seen, epoch_tokens,
                             self.start_step + len(self.step_times)))


def rate_flags(args):
    """The flags of the run's peak learning rates, for a message that says to lower them: the matrices' optimizer's
    own (--muon_lr), --max_lr, and the rates by role a recipe gives (--embed_lr, ...)."""
    names = [MATRIX_OPTIMIZERS[args.optimizer].rate_flag, "max_lr",
             *(f"{role}_lr" for role in ("embed", "head", "scalar") if getattr(args, f"{role}_lr", None) is not None)]
    flags = [f"--{name}" for name in names if name]
    return flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} or {flags[-1]}"


@dataclass
class Attempt:
    """A training step's try: retry is set when it ran out of memory and runs again at a smaller micro-batch."""
    retry: bool = True


def out_of_memory_error(e, args):
    """The one line for an out-of-memory that ends the run: what to lower (--vocab_size / --mlp_hidden too where
    they were given: they made the model big)."""
    memory = "GPU memory" if isinstance(e, torch.OutOfMemoryError) else "memory"
    smaller = smaller_batch_size(args.batch_size)
    wide = "".join(f" or {flag}" for flag in widening_flags(args))
    fix = (f"lower --batch_size (to {smaller}: gradient accumulation keeps --total_batch_size){wide}" if smaller else
           f"lower --seq_len{wide}, pick a smaller --model, or try --recompute or --loss_impl chunked")
    return UserError(f"out of {memory} at batch_size {args.batch_size} x seq_len {args.seq_len}; {fix}")


def weights_finite(model):
    # the largest absolute entry of each tensor, in one foreach op (a few kernels, not a few per tensor): NaN and
    # +-inf show there, and no temporary the size of the weights is made. Under --fsdp each rank looks at its own
    # shards (a tensor with fewer rows than ranks leaves some ranks an empty one) and the ranks agree, so that all
    # stop or none.
    params = list(model.parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    held = [t for t in local if t.numel()]
    with torch.no_grad():
        broken = (~torch.isfinite(torch.stack(torch._foreach_norm(held, float("inf"))))).any().float() if held else (
            torch.zeros(()))
    if any(hasattr(p, "to_local") for p in params):
        broken = broken.to(local[0].device)
        torch.distributed.all_reduce(broken, op=torch.distributed.ReduceOp.MAX)
    return not bool(broken)
