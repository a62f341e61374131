"""
Checks of the scripts' settings before any work is done, each refusal one line naming the flag and the
fix. train_gpt2.py's: ranges, flags that would do nothing, the batch split, memory, the log folder,
--init_from's shape, and what a --resume may change (and what a change of the learning-rate schedule does).
fineweb.py's: its count arguments, its inputs, flags that would do nothing. Imports no torch.
"""

import argparse
import math
import os
import re

from nanogpt.cli import UserError
from nanogpt.files import CPUS
from nanogpt.shard_manifest import REPEATED_INPUT
from nanogpt.text_inputs import INPUT_TYPES, open_parquet


INT_MAX = 2**31 - 1  # counts beyond this are typos, and overflow C integers in torch
# flags that act only through another one: given while it is off (say by --model tiny), they would be ignored
FLAGS_NEEDING = {"hellaswag_data": ("hellaswag_every", "N"), "hellaswag_limit": ("hellaswag_every", "N"),
                 "wandb_id": ("wandb", "PROJECT"), "tensorboard_run": ("tensorboard", "DIR")}
LARGEST_RATE = 1e3  # the largest --max_lr and --weight_decay taken: their product stays far inside fp32's range
RUN_LOCAL_ARGS = ("log_dir", "resume", "overwrite")  # a resumed run takes these from today's command line only
# the model's architecture beyond its shape (GPTConfig's fields of the same names)
ARCH_ARGS = ("arch", "n_kv_head", "qk_norm", "rope_theta", "tie_embeddings")
# what a resumed run cannot change: the model's shape and architecture, its optimizer, the batch, and the data order
# (--seed draws each epoch's shuffle)
SHAPE_ARGS = ("model", "n_layer", "n_head", "n_embd", *ARCH_ARGS, "recipe", "optimizer", "init_from", "seq_len",
              "total_batch_size", "no_shuffle", "seed")


def check_args(args, run_presets):
    """Refuse settings that cannot work before any work is done (run_presets: train_gpt2's RUN_PRESETS)."""
    counts = {"batch_size": 1, "seq_len": 1, "total_batch_size": 1, "max_steps": 1, "val_steps": 1, "warmup_steps": 0,
              "eval_every": 0, "hellaswag_every": 0, "sample_every": 0, "save_every": 0, "keep_checkpoints": 0,
              "max_bad_steps": 1}
    for name in ("n_layer", "n_head", "n_embd", "n_kv_head", "hellaswag_limit"):
        if getattr(args, name) is not None:
            counts[name] = 1
    for name, low in counts.items():
        if not low <= getattr(args, name) <= INT_MAX:
            raise UserError(f"--{name} {getattr(args, name)}: must be a whole number from {low} to {INT_MAX}")
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed {args.seed}: must be from 0 to 2**63-1")
    floats = {"max_lr": (0, False), "min_lr_frac": (0, True), "weight_decay": (0, True), "grad_clip": (0, True),
              "muon_lr": (0, False)}
    if args.peak_tflops is not None:
        floats["peak_tflops"] = (0, False)
    for name, (low, low_ok) in floats.items():
        value = getattr(args, name)
        if not math.isfinite(value) or value < low or (value == low and not low_ok):
            raise UserError(f"--{name} {value}: must be a finite number {'>=' if low_ok else '>'} {low}")
    if args.min_lr_frac > 1:
        raise UserError(f"--min_lr_frac {args.min_lr_frac}: must be from 0 to 1")
    for name in ("max_lr", "weight_decay", "muon_lr"):  # beyond this, the fp32 arithmetic overflows mid-run
        if getattr(args, name) > LARGEST_RATE:
            usual = "Muon's usual rate is ~0.02" if name == "muon_lr" else "AdamW's usual range is ~1e-3"
            raise UserError(f"--{name} {getattr(args, name)}: must be at most {LARGEST_RATE:g} ({usual})")
    for name in ("data_dir", "log_dir", "hellaswag_data", "tensorboard", "tensorboard_run", "wandb", "wandb_id"):
        if getattr(args, name) == "":  # "$UNSET_VARIABLE": an empty name would switch the thing off, or mean "."
            raise UserError(f"--{name} is empty; give a value, or drop the flag")
    if args.tensorboard_run is not None and (args.tensorboard_run in (".", "..") or re.search(r"[/\\]", args.tensorboard_run)):
        raise UserError(f"--tensorboard_run {args.tensorboard_run}: give a folder name, not a path")
    if "schedule_change" in args.explicit and not args.resume:
        raise UserError(f"--schedule_change {args.schedule_change} does nothing without --resume (it says what a "
                        "resume that changes the schedule's flags does); drop it, or add --resume")
    for name, (switch, value) in FLAGS_NEEDING.items():
        if name in args.explicit and not getattr(args, switch):
            preset = switch not in args.explicit and switch in run_presets.get(args.model, {})
            by = f" (--model {args.model} turns it off)" if preset else ""
            raise UserError(f"--{name} does nothing while --{switch} is off{by}; "
                            f"give --{switch} {value} too, or drop --{name}")
    if args.optimizer == "muon" and (args.zero or args.fsdp):
        raise UserError(f"--optimizer muon trains with DDP only, not {'--fsdp' if args.fsdp else '--zero 1'}: Muon "
                        "orthogonalises each whole weight matrix (FSDP splits them) and ZeRO-1 shards one optimizer "
                        "class; drop the flag, or use --optimizer adamw")
    if "muon_lr" in args.explicit and args.optimizer != "muon":
        raise UserError(f"--muon_lr does nothing with --optimizer {args.optimizer}; add --optimizer muon, or drop it")
    if args.zero and args.fsdp:
        raise UserError("--zero 1 and --fsdp do not combine (FSDP already shards the optimizer state); pick one "
                        "(when resuming, --zero 0 or --no_fsdp turns off the checkpoint's setting)")
    if args.resume and args.overwrite:
        raise UserError("--overwrite starts a new run over the one in --log_dir, --resume continues it; pick one")


def check_schedule(args, master):
    if master and args.warmup_steps and args.warmup_steps * 2 >= args.max_steps:
        print(f"note: --warmup_steps {args.warmup_steps} covers half or more of the {args.max_steps}-step run, "
              "so the learning rate spends most of it warming up; lower --warmup_steps for a short run")


def check_batch_warmup(args, world_size):
    """Refuse a batch warm-up that cannot be made of whole micro-batches."""
    micro = args.batch_size * args.seq_len * world_size
    if not 0 <= args.batch_size_warmup_tokens < 2**63:
        raise UserError(f"--batch_size_warmup_tokens {args.batch_size_warmup_tokens}: "
                        "must be a whole number from 0 to 2**63-1")
    if args.batch_size_start is None:
        return
    if not args.batch_size_warmup_tokens:
        raise UserError(f"--batch_size_start {args.batch_size_start} needs --batch_size_warmup_tokens N > 0 "
                        "(the tokens to ramp over)")
    if not micro <= args.batch_size_start <= args.total_batch_size or args.batch_size_start % micro:
        raise UserError(f"--batch_size_start {args.batch_size_start}: must be a multiple of "
                        f"batch_size*seq_len*world_size = {args.batch_size}*{args.seq_len}*{world_size} = {micro} "
                        f"from {micro} to --total_batch_size {args.total_batch_size}")


def check_batch_split(args, world_size, resuming=False):
    """Refuse a --total_batch_size that does not split into micro-batches of every process, naming what
    would split it: a resumed run's --total_batch_size is fixed, so the process counts that can take it."""
    per_micro_step = args.batch_size * args.seq_len * world_size
    if args.total_batch_size % per_micro_step:
        row = args.batch_size * args.seq_len
        counts = [n for n in range(1, args.total_batch_size // row + 1) if args.total_batch_size % (row * n) == 0]
        if not resuming:
            fix = "pick a multiple"
        elif counts:
            fix = (f"a resume keeps the run's --total_batch_size: run it on {', '.join(map(str, counts[:-1]))}"
                   f"{' or ' if len(counts) > 1 else ''}{counts[-1]} processes, or give a --batch_size that splits it")
        else:
            fix = "a resume keeps the run's --total_batch_size: give a --batch_size that splits it"
        raise UserError(f"--total_batch_size {args.total_batch_size} is not divisible by batch_size*seq_len*world_size "
                        f"= {args.batch_size}*{args.seq_len}*{world_size} = {per_micro_step}; {fix}")


def estimated_bytes(config, n_params, B, T, dtype):
    """A low estimate of the memory one training process needs for a model of config's shape with n_params
    parameters: fp32 weights, gradients and AdamW's two moments, activations kept for backward (~34 values
    per layer, token and channel, as in Korthikanti et al. without attention scores, which SDPA does not
    keep) and the logits with the fp32 copies cross-entropy makes of them."""
    act = 2 if dtype in ("bf16", "fp16") else 4
    return (16 * n_params + config.n_layer * B * T * config.n_embd * 17 * act + B * T * config.vocab_size * (act + 8))


def available_memory_bytes():
    """MemAvailable of this machine (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(config, n_params, args, dtype, device_type, local_world_size):
    """The kernel kills a process that runs out of memory without a word: say it before starting.
    Every model is built in main memory first; on a CPU it also trains there. (A GPU's out-of-memory
    is an error the loop turns into one line.) config is model_config's, --init_from's shape included;
    n_params its model's parameters."""
    have = available_memory_bytes()
    if have is None:
        return
    smaller = ("a smaller --model or --n_layer/--n_embd" if args.init_from == "scratch"
               else f"a smaller model than --init_from {args.init_from}")
    weights = 4 * n_params
    if weights * local_world_size > have:
        raise UserError(f"the model's weights alone need {weights / 2**30:.1f} GiB per process "
                        f"but {have / 2**30:.1f} GiB of memory is available; pick {smaller}")
    need = estimated_bytes(config, n_params, args.batch_size, args.seq_len, dtype) * local_world_size
    if device_type == "cpu" and need > have:
        raise UserError(f"this run needs at least {need / 2**30:.1f} GiB of memory "
                        f"({local_world_size} process(es) of batch_size {args.batch_size} x seq_len {args.seq_len}) "
                        f"but {have / 2**30:.1f} GiB is available; lower --batch_size "
                        "(gradient accumulation keeps --total_batch_size) or --seq_len, or use "
                        + ("--model tiny" if args.init_from == "scratch" else smaller))


def check_log_dir(log_dir):
    """Refuse a --log_dir that cannot be written, before any work; it is made once the run has started."""
    parent = log_dir
    while not os.path.exists(parent) and os.path.dirname(os.path.abspath(parent)) != os.path.abspath(parent):
        parent = os.path.dirname(os.path.abspath(parent))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        what = "cannot be written" if os.path.isdir(parent) else "is not a folder"
        raise UserError(f"cannot create --log_dir {log_dir} ({parent} {what}); pick another folder")


def model_settings(config):
    """The settings of the flags --n_layer ... --tie_embeddings that a model config (GPTConfig) has."""
    settings = {name: getattr(config, name) for name in ("n_layer", "n_head", "n_embd", *ARCH_ARGS)}
    settings["n_kv_head"] = config.n_kv_head or config.n_head
    return settings


def check_init_from_shape(args, config):
    """--init_from brings its shape and architecture (a --model preset brings only its run settings then):
    refuse --n_layer/--n_head/--n_embd/--arch/... given on the command line that ask for another (the same,
    e.g. repeated by a script, is fine), and a --recipe whose architecture is another."""
    have = model_settings(config)
    flags = [f"--{name} {getattr(args, name)}" for name in have
             if name in args.explicit and getattr(args, name) != have[name]]
    if flags:
        shown = [name for name in have if name in ("n_layer", "n_head", "n_embd", "arch") or name in args.explicit]
        raise UserError(f"{' '.join(flags)} conflicts with --init_from {args.init_from}, whose weights have "
                        f"{', '.join(f'{name} {have[name]}' for name in shown)}; drop the flags (the weights bring "
                        "their shape)")
    if "recipe" in args.explicit and "arch" not in args.explicit and args.arch != have["arch"]:
        raise UserError(f"--recipe {args.recipe} trains --arch {args.arch}, but --init_from {args.init_from}'s weights "
                        f"are a {have['arch']}; give --optimizer {args.optimizer} in its place, or drop --init_from")


def check_architecture(args, n_head, n_embd):
    """A new model's architecture flags (docs/recipes.md): the options of llama refused with --arch gpt2 (GPT-2's
    architecture has none of them, and its transformers export could not hold them), a --n_kv_head that
    does not divide n_head, heads of an odd size (rotary positions turn pairs of dimensions) and a rotary base
    below 1 (its frequencies alias, and below ~1e-38 they overflow to NaN)."""
    if args.arch == "gpt2":
        given = [flag for flag in ARCH_ARGS if flag != "arch" and flag in args.explicit]
        if given:
            spelt = args.given_as.get(given[0], f"--{given[0]}")
            raise UserError(f"{spelt} is an option of --arch llama; GPT-2's architecture (the default) has learned "
                            "positions, all heads for keys and values and a tied head: add --arch llama, or drop it")
    elif args.n_kv_head is not None and not (0 < args.n_kv_head <= n_head and n_head % args.n_kv_head == 0):
        raise UserError(f"--n_kv_head {args.n_kv_head} does not divide --n_head {n_head}: each key/value head serves "
                        "the same number of query heads; pick a divisor")
    elif (n_embd // n_head) % 2:
        raise UserError(f"--n_embd {n_embd} / --n_head {n_head} gives heads of {n_embd // n_head} dimensions; rotary "
                        "positions turn pairs of them, so --arch llama needs an even head size: pick another "
                        "--n_head or --n_embd")
    if args.rope_theta < 1 or not math.isfinite(args.rope_theta):
        raise UserError(f"--rope_theta {args.rope_theta}: must be a finite number >= 1 (Llama's is 10000 or 500000)")


def check_resume_args(args, saved_args, master, saved_config, model_presets, recipes):
    """Resuming continues the same run: args are the checkpoint's settings (saved_args) with the command
    line's over them; what the command line changes is printed. The shape and the batch cannot change.
    saved_config is the checkpoint's model config: --n_layer/--n_head/--n_embd are compared with the shape
    the run has (a preset's or --init_from's), not with the flag as saved (None where the run did not give
    it). model_presets, recipes: train_gpt2's MODEL_PRESETS and RECIPES; a --recipe given is compared by the
    settings it stands for (--recipe modern resumes a run started as --arch llama --optimizer muon)."""
    if "no_shuffle" not in saved_args:  # a checkpoint from before shuffling read the fixed order
        saved_args = {**saved_args, "no_shuffle": True}
        args.no_shuffle = True
    # a checkpoint from before the options beyond GPT-2: GPT-2's architecture, AdamW
    saved_args = {"recipe": "gpt2", "optimizer": "adamw", **saved_args}
    if isinstance(saved_config, dict):
        shape = {k: saved_config[k] for k in ("n_layer", "n_head", "n_embd") if k in saved_config}
        arch = {"arch": "gpt2", "qk_norm": False, "rope_theta": 10000.0, "tie_embeddings": True, **{
            k: saved_config[k] for k in ARCH_ARGS if k in saved_config}}
        arch["n_kv_head"] = saved_config.get("n_kv_head") or saved_config.get("n_head")
        saved_args = {**saved_args, **arch, **shape}
        if "model" in args.explicit and saved_args.get("init_from", "scratch") == "scratch":
            # a preset is its shape (with the shape flags given beside it), whatever the run's --model said
            asked = {**model_presets[args.model], **{k: getattr(args, k) for k in shape if k in args.explicit}}
            if any(asked[k] != shape[k] for k in shape if k not in args.explicit):  # a flag given is checked below
                have = ", ".join(f"{k} {v}" for k, v in shape.items())
                raise UserError(f"--model {args.model} ({', '.join(f'{k} {asked[k]}' for k in shape)}) conflicts with "
                                f"the checkpoint's model ({have}); drop the flag to resume, or use another --log_dir "
                                "for a new run")
            saved_args = {**saved_args, "model": args.model}
    if "recipe" in args.explicit:
        implied = recipes[args.recipe]
        clash = {k: v for k, v in implied.items() if k not in args.explicit and saved_args.get(k, v) != v}
        if clash:
            raise UserError(f"--recipe {args.recipe} ({' '.join(f'--{k} {v}' for k, v in implied.items())}) conflicts "
                            f"with the checkpoint's {', '.join(f'{k} {saved_args[k]}' for k in clash)}; drop the flag "
                            "to resume, or use another --log_dir for a new run")
        saved_args = {**saved_args, "recipe": args.recipe}
    for name in sorted(args.explicit - set(RUN_LOCAL_ARGS)):
        if name not in saved_args or getattr(args, name) == saved_args[name]:
            continue
        if name in SHAPE_ARGS:
            raise UserError(f"--{name} {getattr(args, name)} conflicts with the checkpoint's {saved_args[name]}; "
                            "drop the flag to resume, or use another --log_dir for a new run")
        if master:
            print(f"--resume: --{name} changes from {saved_args[name]} to {getattr(args, name)}")
    return args


def resumed_run_finished(step, max_steps, ckpt_path, master):
    """Whether a resumed run has no step left to take (said on the console); a --max_steps the run is
    already past is refused."""
    if step + 1 > max_steps:
        raise UserError(f"--max_steps {max_steps}: the run has already taken {step + 1} steps ({ckpt_path}); "
                        f"give --max_steps above {step + 1} to train on")
    if step + 1 == max_steps and master:
        print(f"--resume: the run is finished ({ckpt_path} is after its last step, {step}); "
              "give a larger --max_steps to train on")
    return step + 1 == max_steps


NEW_SCHEDULE = {"start": 0, "start_lr": None}  # get_lr's schedule from step 0
SCHEDULE_ARGS = ("max_steps", "warmup_steps", "max_lr", "min_lr_frac")


def resumed_schedule(ckpt, args, master, get_lr):
    """Where the resumed run's learning-rate schedule begins (get_lr's start, start_lr). When the command
    line changes the schedule's flags, --schedule_change says what becomes of it from the resume step:
    recompute (the schedule of the new flags, as if the run had always had them: the rate may jump), stretch
    (from the rate it has now, a cosine down to the new minimum at the new --max_steps) or restart (a new
    warmup to --max_lr, then the cosine). What the rate does at the resume step is said on the console."""
    saved, schedule = ckpt.get("args", {}), ckpt.get("schedule", NEW_SCHEDULE)
    if not isinstance(schedule, dict) or set(schedule) != set(NEW_SCHEDULE):
        raise UserError("the checkpoint's learning-rate schedule is not one this program writes; "
                        "it is damaged or not a checkpoint of train_gpt2.py")
    before = {name: saved.get(name, getattr(args, name)) for name in SCHEDULE_ARGS}
    if all(before[name] == getattr(args, name) for name in SCHEDULE_ARGS):
        return schedule
    step = ckpt["step"] + 1
    lr_before = get_lr(step, before["max_lr"], before["max_lr"] * before["min_lr_frac"], before["warmup_steps"],
                       before["max_steps"], **schedule)
    if args.schedule_change == "stretch":
        schedule = {"start": step, "start_lr": lr_before}
    elif args.schedule_change == "restart":
        schedule = {"start": step, "start_lr": None}
    lr_now = get_lr(step, args.max_lr, args.max_lr * args.min_lr_frac, args.warmup_steps, args.max_steps, **schedule)
    if master:
        what = {"recompute": "the schedule of the new settings from step 0 (--schedule_change stretch continues from "
                             "the rate it has, restart warms up again)",
                "stretch": f"from there a cosine down to {args.max_lr * args.min_lr_frac:.4e} at step {args.max_steps}",
                "restart": f"a new warmup of {args.warmup_steps} steps to {args.max_lr:.4e}, then a cosine to step "
                           f"{args.max_steps}"}[args.schedule_change]
        print(f"--resume: the learning-rate schedule changes: at step {step} the rate is {lr_now:.4e} "
              f"({lr_before:.4e} under the checkpoint's settings); {what}")
    return schedule


# -----------------------------------------------------------------------------
# fineweb.py


def count_arg(text):
    """1e8, 100000000 or 100_000_000: a whole number from 1 to 2**31-1."""
    try:
        if (value := float(text)).is_integer() and 1 <= value < 2**31:
            return int(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to 2**31-1")


def val_tokens_arg(text):
    """A fraction in (0, 1), or a count of tokens as count_arg takes it."""
    try:
        return value if 0 < (value := float(text)) < 1 else count_arg(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a fraction between 0 and 1 "
                                         "nor a whole number of tokens") from None


def check_fineweb_args(args):
    """Refuse fineweb.py's settings that cannot work, or flags that would do nothing, before any work."""
    if not 1 <= args.num_proc <= 4 * CPUS:
        raise UserError(f"--num_proc {args.num_proc}: use 1 to {4 * CPUS} (4x the {CPUS} cores)")
    if args.max_shards < 0:
        raise UserError("--max_shards must be 0 (all) or more")
    if not args.output_dir or (os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir)):
        what = "a file" if args.output_dir else "empty"
        raise UserError(f"--output_dir {args.output_dir!r} is {what}; name a folder")
    # a flag that would change nothing is refused, not passed over
    hub = ("dataset", "name", "split")
    idle = [(k, "with --download, which fetches shards made elsewhere as they are") for k in (
        "input", "val_tokens", "shard_size", "prefix", "text_field", "seed", *hub, "overwrite", "num_proc")
        if args.download]
    idle += [(k, "with --input, which tokenizes local files instead") for k in hub if args.input]
    if args.val_tokens is None:
        idle.append(("seed", "without --val_tokens, whose draw it picks"))
    for key, why in idle:
        if key in args.explicit:
            raise UserError(f"--{key} does nothing {why}: leave it out")
    if args.download == "" or (args.download is None and not args.input and not args.dataset):
        flag = "--dataset" if args.download is None else "--download"
        raise UserError(f"{flag} is empty; name a Hugging Face dataset repo")
    if not args.text_field:
        raise UserError("--text_field must not be empty")
    files = {}  # (device, inode) of each --input: the index of the first given for it
    for i, path in enumerate([] if args.download else args.input or []):
        if not os.path.isfile(path):
            what = ("is a directory; pass its files (DIR/*.txt)" if os.path.isdir(path)
                    else "is not a regular file (a pipe or a device); save it to a file first"
                    if os.path.exists(path) else "does not exist")
            raise UserError(f"--input {path!r} {what}")
        if not path.lower().endswith(INPUT_TYPES):
            raise UserError(f"--input {path}: unknown file type; use {', '.join(INPUT_TYPES)}")
        if path.lower().endswith(".parquet"):
            open_parquet(path, args.text_field)
        stat = os.stat(path)  # a link, or another spelling of the path, is the same file
        if (first := files.setdefault((stat.st_dev, stat.st_ino), i)) != i:
            raise UserError(f"--input {args.input[first]} and {path} are the same file: {REPEATED_INPUT}")
    if args.prefix is None and args.input:
        args.prefix = re.sub(r"[^a-z0-9]", "", os.path.splitext(os.path.basename(args.input[0]))[0].lower()) or "local"
    elif args.prefix is None:
        args.prefix = "edufineweb"
    # list_shards tells the splits apart by "_val_" / "_train_" in the name: the prefix must not fake one
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.prefix) or re.search("_(val|train)_", args.prefix + "_"):
        raise UserError(f"--prefix {args.prefix!r}: use letters, digits, '.', '-', '_' and no '_val'/'_train' part")
