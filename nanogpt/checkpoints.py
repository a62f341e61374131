"""
Checkpoint files: their names (model_<step>.pt in the log folder), atomic saves, loads that run no code
from the file, the checksum of what a checkpoint holds, what a training checkpoint holds and how a run is
put back from it, the newest one that resumes, and pruning. Every checkpoint keeps one layout, whatever
wrote it, so every script loads any.
"""

import hashlib
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import torch

from nanogpt.cli import UserError, brief
from nanogpt.config_fields import config_from_checkpoint
from nanogpt.files import CPUS, atomic_write, block_digests, disk_advice
from nanogpt.optimizers import OptimizerSettings, with_settings_of
from nanogpt.sharding import load_optimizer_state
from nanogpt.tokenizer import GPT2_VOCAB_SIZE


CHECKPOINT_RE = re.compile(r"^model_(\d+)\.pt$")
# The key of the checksum a checkpoint carries: the sha256 of what it holds (content_sha256). Checkpoints
# written before it have none, and load unchecked.
CHECKSUM_KEY = "content_sha256"


def checkpoint_path(log_dir, step):
    return os.path.join(log_dir, f"model_{step:05d}.pt")


def find_checkpoints(log_dir):
    """Checkpoint files in log_dir, newest step first (a folder named like one is not)."""
    if not os.path.isdir(log_dir):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(log_dir)
             if (m := CHECKPOINT_RE.match(n)) and os.path.isfile(os.path.join(log_dir, n))]
    return [os.path.join(log_dir, n) for _, n in sorted(found, reverse=True)]


def refuse_checkpoint_lookalikes(log_dir):
    """A run saves model_<step>.pt files in log_dir; a folder (or anything not a file) under such a name would end
    the run at that save, after the training before it, so it is refused before any work."""
    names = sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []
    for path in (os.path.join(log_dir, n) for n in names if CHECKPOINT_RE.match(n)):
        if not os.path.isfile(path):
            raise UserError(f"{path} is named like a checkpoint but is not a file, and a save there would fail; "
                            "move or rename it (nothing was changed)")


def newest_checkpoint(path):
    """path itself, or the newest model_*.pt in it when it is a directory (a run's --log_dir)."""
    if not os.path.isdir(path):
        return path
    found = find_checkpoints(path)
    if not found:
        hint = "; a transformers model folder is loaded with --init_from" if os.path.isfile(
            os.path.join(path, "config.json")) else ""
        raise UserError(f"no model_*.pt checkpoint in {path}{hint}")
    return found[0]


def strip_prefixes(state_dict):
    """Drop the `_orig_mod.` (torch.compile) and `module.` (DDP) prefixes older checkpoints may carry."""
    out = {}
    for k, v in state_dict.items():
        while k.startswith(("_orig_mod.", "module.")):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


def content_sha256(checkpoint):
    """The sha256 of what a checkpoint holds, as torch.load gives it back: every tensor's bytes (in 8 MiB
    blocks hashed on all cores, a tensor shared by two names once) and every other value's repr, each with
    its place in the dict.

    Why of the contents, kept inside the file, and not of the file's bytes: torch.load checks no CRC, so a
    flipped bit in tensor data loads as another number, and a bit flipped elsewhere either stops torch.load
    or changes a value this sees. Inside, the checksum goes wherever the file is copied, and no second file
    has to be kept in step with it through pruning and crashes; and a load hashes the tensors torch.load has
    just put in memory instead of reading the file twice. sha256 runs at ~2 GB/s a core (SHA-NI): 0.8 s for
    a d12 checkpoint (1.5 GB) on 2 busy cores, where its save took 2.4-4.6 s (bench/checkpoint_checksum.py)."""
    digest, hashed = hashlib.sha256(), set()
    with ThreadPoolExecutor(CPUS) as pool:
        def add(place, value):
            if isinstance(value, dict):
                for k, v in value.items():
                    add(f"{place}[{k!r}]", v)
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    add(f"{place}[{i}]", v)
            elif torch.is_tensor(value):
                digest.update(f"{place} {value.dtype} {tuple(value.shape)}\n".encode())
                # tied weights: two names of one storage at one offset and shape, as torch.load restores them
                key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), value.dtype,
                       tuple(value.shape), value.stride())
                if value.numel() and key in hashed:
                    return
                hashed.add(key)
                data = memoryview(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                digest.update(block_digests(len(data), lambda start, end: data[start:end], pool))
            else:
                digest.update(f"{place} {value!r}\n".encode())

        add("", checkpoint)
    return digest.hexdigest()


def save_checkpoint(path, checkpoint):
    """torch.save through atomic_write, with the checksum of what it holds: a crash or a full disk never
    harms the previous checkpoint, nor leaves a half-written one under a final name."""
    checkpoint = {**checkpoint, CHECKSUM_KEY: content_sha256(checkpoint)}
    try:
        with atomic_write(path) as f:
            torch.save(checkpoint, f)
    except (OSError, RuntimeError) as e:
        # torch's zip writer reports a failed write (a full disk) as a RuntimeError raised while handling the OSError
        cause = e if isinstance(e, OSError) else e.__context__
        if not isinstance(cause, OSError):
            raise
        raise UserError(f"cannot write checkpoint {path} ({cause.strerror or cause}); "
                        f"{disk_advice(cause)}pick another --log_dir (earlier checkpoints are intact)") from None


def load_checkpoint(path, map_location="cpu"):
    """A checkpoint dict, loaded with weights_only=True (no code from the file runs), checked against the
    checksum it carries (if it was written with one); the checksum itself is not in the dict returned."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise UserError(f"{path}: cannot load checkpoint ({type(e).__name__}); "
                        "it is truncated or not a checkpoint of train_gpt2.py") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise UserError(f"{path}: not a checkpoint of train_gpt2.py (no model/config)")
    saved = ckpt.pop(CHECKSUM_KEY, None)
    if saved is not None and saved != content_sha256(ckpt):
        raise UserError(f"{path}: damaged: what it holds no longer matches the checksum written with it (a bit "
                        "changed on disk or in a copy); use an earlier checkpoint, or a good copy of this one")
    return ckpt


# The fields every checkpoint's model config holds: a GPT-2's held only these until its whole config was saved.
GPT2_SHAPE = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")


def checkpoint_config(ckpt, path, config_class):
    """The model config a checkpoint stores, as a config_class (train_gpt2's GPTConfig), checked to describe a
    model this program can build; a field the file lacks (written before the field existed) takes its
    default. A UserError naming the file if not."""
    config = config_from_checkpoint(config_class, ckpt["config"], path, required=GPT2_SHAPE)
    if config.vocab_size < GPT2_VOCAB_SIZE:  # the tokenizer's ids would index past the embedding
        raise UserError(f"{path}: vocab_size {config.vocab_size} is smaller than the GPT-2 tokenizer's "
                        f"{GPT2_VOCAB_SIZE} token ids; it is not a GPT-2 checkpoint of this program")
    return config


def training_checkpoint(model_state, optimizer_state, config, step, tokens, loader_state, scaler, args, device_type,
                        schedule=None, fixed=None):
    """What a checkpoint holds: the state after `step`'s update (weights, optimizer, loss scaler), the tokens
    trained on up to and with it, the model config (every field), the data position, the RNGs and the run's arguments;
    `schedule` only where a resume moved the learning-rate schedule (a plain run's file is as it always was); `fixed`:
    what the run fixed when it started, whatever micro-batch it takes now: validation's rows per batch (val_rows) and,
    where the batch warms up, the ramp (nanogpt.fitting.batch_ramp's start and unit in tokens)."""
    fixed = {k: v for k, v in (fixed or {}).items() if v and (k != "ramp" or v.get("unit"))}
    return {**({"schedule": schedule} if schedule else {}),
            **fixed,
            "model": model_state,
            "optimizer": optimizer_state,
            "step": step,
            "tokens": tokens,
            "config": asdict(config),
            "loader": loader_state,
            "rng": {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None},
            "scaler": scaler.state_dict() if scaler.is_enabled() else {},
            "args": {k: v for k, v in vars(args).items() if k not in ("explicit", "given_as")}}


def restore_training_state(ckpt, optimizer, scaler, train_loader, device_type, total_batch_size, fsdp_model=None):
    """Put the optimizer, loss scaler, data position and RNGs back where the checkpoint left them; the optimizer's
    settings stay this run's (with_settings_of), so that what a resume changes is changed. Returns (the step to run
    next, tokens trained on so far): (0, 0) without a checkpoint."""
    if ckpt is None:
        return 0, 0
    try:  # the state of each parameter from the file, the settings (today's flags) this run's
        load_optimizer_state(optimizer, with_settings_of(optimizer, ckpt["optimizer"]), fsdp_model)
        if getattr(optimizer, "before_step", None) and "steps" not in ckpt["optimizer"]:
            optimizer.steps = ckpt["step"] + 1  # a schedule (Muon's momentum warm-up) the run had not: the steps taken
        train_loader.load_state_dict(ckpt["loader"])
        if "rng" in ckpt:
            torch.set_rng_state(ckpt["rng"]["cpu"])
            if device_type == "cuda" and ckpt["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        if scaler.is_enabled() and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"the checkpoint's optimizer or loader state does not fit this run ({brief(e)}); "
                        "it is not a checkpoint of this program's training") from None
    step = ckpt["step"] + 1
    return step, ckpt["tokens"] if isinstance(ckpt.get("tokens"), int) else step * total_batch_size


def check_resumable(ckpt, path, config_class, make_model):
    """A UserError unless the checkpoint's weights and optimizer state fit the model its config describes
    (config_class: train_gpt2's GPTConfig; make_model(config): its GPT). Checked on the meta device: nothing the
    size of the model is allocated. resume_checkpoint's check, with the two given."""
    config = checkpoint_config(ckpt, path, config_class)
    try:
        with torch.device("meta"):
            model = make_model(config)
            optimizer = model.configure_optimizers(OptimizerSettings.of(ckpt.get("args", {})), "cpu")
            optimizer.load_state_dict(ckpt["optimizer"])
            for p, state in optimizer.state.items():
                if any(torch.is_tensor(v) and v.dim() and v.shape != p.shape for v in state.values()):
                    raise ValueError(f"optimizer state of shape {[tuple(v.shape) for v in state.values()]} "
                                     f"for a parameter of shape {tuple(p.shape)}")
            model.load_state_dict(strip_prefixes(ckpt["model"]), assign=True)  # checks names and shapes only
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise UserError(f"{path}: its weights or optimizer state do not fit the model its config describes "
                        f"({brief(e)})") from None


def resumed_schedule(ckpt, saved, args, say, schedule_class):
    """The resumed run's learning-rate schedule (schedule_class: train_gpt2's LRSchedule). When the command line
    changes the schedule's settings, --schedule_change says what becomes of it from the resume step: recompute (the
    new settings' schedule, as if the run had always had them, from where an earlier resume moved it if one did: the
    rate may jump), stretch (from the rate it has now, down to the new minimum at the new --max_steps, in the new
    shape) or restart (a new warmup, then the new shape). The rate is said on the console. saved: the checkpoint's
    arguments (nanogpt.arguments.saved_arguments')."""
    moved = ckpt.get("schedule", {"start": 0, "start_lr": None})
    if not isinstance(moved, dict) or set(moved) != {"start", "start_lr"}:
        raise UserError("the checkpoint's learning-rate schedule is not one this program writes; "
                        "it is damaged or not a checkpoint of train_gpt2.py")
    before = schedule_class({name: saved.get(name, getattr(args, name)) for name in schedule_class.SETTINGS}, **moved)
    if before.settings == schedule_class.of(args).settings:
        return schedule_class.of(args, **moved)
    step = ckpt["step"] + 1
    now = schedule_class.of(args, **{"recompute": moved, "restart": dict(start=step),
                                     "stretch": dict(start=step, start_lr=before(step))}[args.schedule_change])
    what = {"recompute": f"the schedule of the new settings from step {moved['start']} (--schedule_change stretch "
                         "continues from the rate it has, restart warms up again)",
            "stretch": f"from there {now.way_down()} down to {now.min_lr():.4e} at step {args.max_steps}",
            "restart": f"a new warmup of {args.warmup_steps} steps to {args.max_lr:.4e}, then {now.way_down()} to "
                       f"{now.min_lr():.4e} at step {args.max_steps}"}[args.schedule_change]
    say(f"--resume: the learning-rate schedule changes: at step {step} the rate is {now(step):.4e} "
        f"({before(step):.4e} under the checkpoint's settings); {what}")
    return now


def resume_checkpoint(log_dir, master, check_resumable):
    """(path, checkpoint) of the newest training checkpoint in log_dir that loads and passes
    check_resumable(checkpoint, path) (a UserError if not), or (None, None) when there is none at all."""
    paths = find_checkpoints(log_dir)
    for path in paths:
        try:
            ckpt = load_checkpoint(path)
            if not (isinstance(ckpt.get("step"), int) and isinstance(ckpt.get("optimizer"), dict)
                    and isinstance(ckpt.get("loader"), dict) and isinstance(ckpt.get("args", {}), dict)):
                raise UserError(f"{path}: not a training checkpoint of train_gpt2.py "
                                "(no step, optimizer or loader state)")
            check_resumable(ckpt, path)
            return path, ckpt
        except UserError as e:
            if master:
                print(f"skipping checkpoint: {e}", file=sys.stderr)
    if paths:
        raise UserError(f"none of the {len(paths)} checkpoints in {log_dir} loads; move them away to start fresh")
    return None, None


def prune_checkpoints(log_dir, saved_step, keep):
    """Keep the checkpoint just saved and the keep-1 newest before it. Checkpoints of later steps
    (left by an earlier life of the run; maybe unreadable, which is why it resumed from an older
    one) are not this function's to judge, so the newest loadable checkpoint is never removed."""
    older = [p for p in find_checkpoints(log_dir)
             if int(CHECKPOINT_RE.match(os.path.basename(p)).group(1)) < saved_step]
    for path in older[keep - 1 :]:
        try:
            os.remove(path)
        except OSError as e:  # an old checkpoint left in place loses nothing: the run goes on
            print(f"warning: cannot remove {path} for --keep_checkpoints ({e.strerror or e}); it is kept",
                  file=sys.stderr)
