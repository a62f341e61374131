"""
Checks of the scripts' settings before any work is done, each refusal one line naming the flag and the
fix. train_gpt2.py's: ranges, flags that would do nothing, the batch split, memory, the log folder,
--init_from's recipe, and what a --resume may change.
fineweb.py's: its count arguments, its inputs, flags that would do nothing. Imports no torch.
"""

import argparse
import math
import os
import re
from dataclasses import asdict, dataclass, field

from nanogpt.cli import INT_MAX, UNSET, UserError
from nanogpt.config_fields import refuse_another_model
from nanogpt.files import CPUS
from nanogpt.shard_manifest import REPEATED_INPUT
from nanogpt.shards import list_shards, read_shard
from nanogpt.text_inputs import INPUT_TYPES, open_parquet
from nanogpt.tokenizer import get_tokenizer, prompt_tokens


LARGEST_RATE = 1e3  # the largest --max_lr and --weight_decay taken: their product stays far inside fp32's range
ADAMW_USUAL = "AdamW's usual range is ~1e-3"  # (the words beside LARGEST_RATE)
LARGEST_INT = 2**63 - 1  # a count torch takes in 64 bits (--seed, --batch_size_warmup_tokens)


def saved_arguments(ckpt, parser):
    """A training checkpoint's arguments, with the value each flag added since it was written had then (parser: the
    one that declares the flags: each one's RunOption.before, else its default)."""
    befores = {name: option.before for name, option in parser.options.items() if option.before is not UNSET}
    return {**vars(parser.parse_args([])), **befores, **ckpt.get("args", {})}  # (the defaults as parsing gives them)


def shown(value):
    """A flag's value in a message: None (a flag left unset, whose default decides) in words."""
    return "unset (the default)" if value is None else value


def out_of_range(option, value):
    """Why value is outside option's declared range (nanogpt.cli.RunOption), in words, or None."""
    low = option.at_least if option.at_least is not None else option.above
    if isinstance(value, bool) or value is None or low is None and option.at_most is None:
        return None
    if isinstance(value, int) and not isinstance(low, float):  # a count: a whole number in its range
        high = option.at_most if option.at_most is not None else INT_MAX
        if not low <= value <= high:
            return f"must be a whole number from {low} to {'2**63-1' if high == LARGEST_INT else high}"
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or (option.above is not None and value <= option.above) or (
                option.at_least is not None and value < option.at_least):
            return f"must be a finite number {'>' if option.above is not None else '>='} {low}"
        if option.at_most is not None and value > option.at_most:
            return f"must be at most {option.at_most:g} ({option.usual})" if option.usual else (
                f"must be from {low} to {option.at_most:g}")
    return None


def check_args(args, run_presets, options):
    """Refuse settings that cannot work before any work is done: what each flag declares (options: the parser's
    {dest: RunOption}: its range, an empty value, a flag that would do nothing while the one it needs is off), then
    what flags say together (run_presets: train_gpt2's RUN_PRESETS)."""
    for name, option in options.items():
        value = getattr(args, name)
        if (problem := out_of_range(option, value)) is not None:
            raise UserError(f"--{name} {value}: {problem}")
        if option.not_empty and value == "":  # "$UNSET_VARIABLE": an empty name would switch the thing off, or mean "."
            raise UserError(f"--{name} is empty; give a value, or drop the flag")
        if option.needs and name in args.explicit and not getattr(args, option.needs[0]):
            switch, on = option.needs
            preset = switch not in args.explicit and switch in run_presets.get(args.model, {})
            by = f" (--model {args.model} turns it off)" if preset else ""
            raise UserError(f"--{name} does nothing while --{switch} is off{by}; give --{switch}{f' {on}' if on else ''} "
                            f"too, or drop --{name}")
        if option.refused_with and value != option.default and getattr(args, option.refused_with[0]) == \
                option.refused_with[1]:
            other, bad = option.refused_with
            raise UserError(f"--{name} {value} does not work with --{other} {bad}; drop one of them")
    from nanogpt.optimizers import MATRIX_OPTIMIZERS  # (torch: not at the top, which fineweb.py imports)

    if "warmdown_frac" in args.explicit and args.lr_schedule != "wsd":
        raise UserError(f"--warmdown_frac does nothing with --lr_schedule {args.lr_schedule} (it is wsd's); "
                        "add --lr_schedule wsd, or drop it")
    asked = {"lr_schedule", "warmdown_frac"} & args.explicit  # (a recipe's on a smoke test of a few steps is let be)
    if asked and args.lr_schedule == "wsd" and args.warmdown_frac and round(args.warmdown_frac * args.max_steps) < 2:
        raise UserError(f"--warmdown_frac {args.warmdown_frac} of --max_steps {args.max_steps} is "
                        f"{round(args.warmdown_frac * args.max_steps)} step(s) of warm-down: too few for the rate to go "
                        "down; give a larger --warmdown_frac, or 0 to hold the rate to the end")
    if args.tensorboard_run not in (None, "") and (args.tensorboard_run in (".", "..")
                                                 or re.search(r"[/\\]", args.tensorboard_run)):
        raise UserError(f"--tensorboard_run {args.tensorboard_run}: give a folder name, not a path")
    if "schedule_change" in args.explicit and not args.resume:
        raise UserError(f"--schedule_change {args.schedule_change} does nothing without --resume (it says what a "
                        "resume that changes the schedule's flags does); drop it, or add --resume")
    entry = MATRIX_OPTIMIZERS[args.optimizer]
    if not entry.shardable and (args.zero or args.fsdp):
        sharding = "--fsdp" if args.fsdp else "--zero 1"
        raise UserError(f"--optimizer {args.optimizer} trains with DDP only, not {sharding}: ZeRO-1 shards one "
                        "optimizer class and FSDP splits the matrices, which its entry in MATRIX_OPTIMIZERS does not "
                        "allow; drop the flag, or use --optimizer adamw")
    for name, other in MATRIX_OPTIMIZERS.items():
        for flag in other.flags:
            if flag in args.explicit and flag not in entry.flags:
                raise UserError(f"--{flag} does nothing with --optimizer {args.optimizer}; add --optimizer {name}, "
                                "or drop it")
    if args.zero and args.fsdp:
        raise UserError("--zero 1 and --fsdp do not combine (FSDP already shards the optimizer state); pick one "
                        "(when resuming, --zero 0 or --no_fsdp turns off the checkpoint's setting)")
    if args.resume and args.overwrite:
        raise UserError("--overwrite starts a new run over the one in --log_dir, --resume continues it; pick one")


def settings_not_kept(args, val_loader=None):
    """A line for each setting the run will not keep to, said at its start (warnings: the run goes on): a warm-up
    as long as the run or longer (the learning rate's, Muon's momentum's, the batch's), or covering half of it, and a
    validation that asks for more tokens than the val split holds (val_loader: DataLoaderLite's of the val split,
    whose stride is one batch of every rank)."""
    from nanogpt.optimizers import MATRIX_OPTIMIZERS, MUON_MOMENTUM  # (torch: not at the top, which fineweb.py imports)

    lines, steps = [], args.max_steps
    if args.warmup_steps >= steps:
        lines.append(f"--warmup_steps {args.warmup_steps} is not shorter than the {steps}-step run: the learning rate "
                     "is still warming up when it ends, and never comes down; lower --warmup_steps")
    elif args.warmup_steps and args.warmup_steps * 2 >= steps:
        lines.append(f"--warmup_steps {args.warmup_steps} covers half or more of the {steps}-step run, so the "
                     "learning rate spends most of it warming up; lower --warmup_steps for a short run")
    momentum = args.muon_momentum_warmup if "muon_momentum_warmup" in MATRIX_OPTIMIZERS[args.optimizer].flags else 0
    if momentum >= steps:
        lines.append(f"--muon_momentum_warmup {momentum} is not shorter than the {steps}-step run: Muon's momentum "
                     f"is still climbing to {MUON_MOMENTUM[1]} when it ends; lower --muon_momentum_warmup")
    if args.batch_size_warmup_tokens >= steps * args.total_batch_size:
        lines.append(f"--batch_size_warmup_tokens {args.batch_size_warmup_tokens:,} is more than the run's {steps} "
                     f"steps of at most {args.total_batch_size:,} tokens: the batch is still growing when it ends; "
                     "lower --batch_size_warmup_tokens")
    if val_loader is not None:
        stride = val_loader.B * val_loader.T * val_loader.world_size  # one validation batch of every rank
        held = val_loader.total_tokens // stride  # batches of the split, in whole batches of each shard
        if args.val_steps > held:
            split = sum(len(read_shard(path)) for path in list_shards(args.data_dir, "val"))  # (headers only)
            lines.append(f"validation reads {args.val_steps * stride:,} tokens ({args.val_steps} val_steps x "
                         f"{val_loader.B} x {val_loader.T} x {val_loader.world_size} ranks), but the val split holds "
                         f"{split:,} ({held} such batches): its last {args.val_steps - held} "
                         f"batch(es) read the first again; give --val_steps {held}, or make a larger val split")
    return lines


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_torchrun_environment(environ):
    """RANK in the environment means torchrun started this process, which sets the others beside it; a cluster job's
    environment may set RANK alone. Refused in one line, before any work, naming what is missing."""
    if "RANK" not in environ:
        return
    missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
    bad = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if name in environ and not environ[name].isdigit()]
    if missing or bad:
        what = (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set" if missing
                else f"{', '.join(bad)} is not a whole number")
        raise UserError(f"RANK={environ['RANK']} is in the environment but {what}, as they are when torchrun starts "
                        "the processes (a cluster job's environment may set RANK alone): start with torchrun "
                        "(docs/scale.md), or unset RANK to run one process")


def check_batch_warmup(args, world_size):
    """Refuse a batch warm-up that cannot be made of whole micro-batches."""
    micro = args.batch_size * args.seq_len * world_size
    if args.batch_size_start is None:
        return
    if not args.batch_size_warmup_tokens:
        raise UserError(f"--batch_size_start {args.batch_size_start} needs --batch_size_warmup_tokens N > 0 "
                        "(the tokens to ramp over)")
    if not micro <= args.batch_size_start <= args.total_batch_size or args.batch_size_start % micro:
        raise UserError(f"--batch_size_start {args.batch_size_start}: must be a multiple of "
                        f"batch_size*seq_len*world_size = {args.batch_size}*{args.seq_len}*{world_size} = {micro} "
                        f"from {micro} to --total_batch_size {args.total_batch_size}")


def check_ramp_unit(ramp, args, world_size):
    """Refuse a micro-batch that does not divide the batch warm-up's unit (nanogpt.fitting.batch_ramp's; a resume on
    another number of processes may)."""
    micro = args.batch_size * args.seq_len * world_size
    if ramp.get("unit") and ramp["unit"] % micro:
        raise UserError(f"the run's batch warm-up grows in steps of {ramp['unit']} tokens, which micro-batches of "
                        f"batch_size*seq_len*world_size = {args.batch_size}*{args.seq_len}*{world_size} = {micro} "
                        f"tokens do not divide; give a --batch_size or a number of processes that divides it")


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


def loss_chunk_rows(vocab_size):
    """Rows per chunk of --loss_impl chunked (nanogpt.loss_head.default_loss_chunk_size, which imports torch)."""
    from nanogpt.loss_head import default_loss_chunk_size

    return default_loss_chunk_size(vocab_size)


def fused_chunk_rows(rows, vocab_size, width):
    """Rows per chunk of --loss_impl fused over `rows` rows: Liger-Kernel's rule, a chunk's logits at most
    FUSED_CHUNK_BUDGET x (rows, width) elements, in a power of two of rows."""
    from nanogpt.loss_head import FUSED_CHUNK_BUDGET

    chunks = -(-vocab_size // (FUSED_CHUNK_BUDGET * width))
    return min(rows, 1 << (-(-rows // chunks) - 1).bit_length())


@dataclass(frozen=True)
class ParameterCounts:
    """What the memory estimate reads of a model's parameters, counted on the built model (counted_parameters), so
    that a new layer's weights and their optimizer state count without an edit here; and what its layers declare
    they keep beyond the formula (a mixture of experts' routed rows: nanogpt.runtime says how a layer declares it)."""
    total: int  # every parameter: weights, gradients, AdamW's state
    matrices: int  # parameters_by_role's "matrix": the matrices' optimizer's (MATRIX_OPTIMIZERS' state bytes)
    linear_weights: int  # the nn.Linear layers' weights but the output head's: autocast's low-precision copies
    linear_biases: int  # and their biases, copied too
    extra_activation_bytes: dict = field(default_factory=dict)  # {a: bytes per token} at a = 2 and 4 bytes an
    # activation: the layers' extra_activation_bytes(a), summed


def counted_parameters(model):
    """ParameterCounts of model (built on the meta device: nothing allocated)."""
    import torch

    from nanogpt.optimizers import parameters_by_role

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    declaring = [m for m in model.modules() if hasattr(m, "extra_activation_bytes")]
    return ParameterCounts(total=sum(p.numel() for p in model.parameters()),
                           matrices=sum(p.numel() for p in parameters_by_role(model)["matrix"]),
                           linear_weights=sum(m.weight.numel() for m in linears),
                           linear_biases=sum(m.bias.numel() for m in linears if m.bias is not None),
                           extra_activation_bytes={a: sum(m.extra_activation_bytes(a) for m in declaring)
                                                   for a in (2, 4)})


def mlp_kept_bytes(config, a):
    """Per token, what one MLP of config keeps for backward, as peak_bytes_by_moment counts it at a bytes an activation:
    its input as its linear layers read it (under autocast a copy each; in fp32 the norm's output, which they share)
    and its hidden activations (SwiGLU's: both branches). A layer that runs several MLPs' worth (a mixture of
    experts) declares the rest as its extra_activation_bytes (nanogpt.runtime)."""
    readers = 2 if config.mlp_act == "swiglu" else 1
    return (readers * a * config.n_embd if a < 4 else 4 * config.n_embd) + readers * 2 * a * config.mlp_hidden


def peak_bytes_by_moment(config, params, B, T, dtype, optimizer="adamw", recompute=False, loss_impl="plain",
                         device_type="cpu"):
    """The bytes of the tensors alive at each moment of a training step where its peak can be, for a model of
    config's shape whose parameters params counts (ParameterCounts), a micro-batch of B x T tokens, run eagerly (no
    torch.compile) as train_gpt2.py's loop runs it, in a micro-step after the first of a step after the first (so
    the gradients of the micro-steps before and the optimizer's state exist). docs/speed.md ("Memory") has the
    tensors and the check against measurements (bench/memory_table.py)."""
    from nanogpt.optimizers import MATRIX_OPTIMIZERS

    a = 2 if dtype in ("bf16", "fp16") else 4  # bytes of an activation in the compute dtype
    low = a < 4  # autocast: each linear layer keeps its own low-precision copy of its input and weight
    C, F, V, L, H = config.n_embd, config.mlp_hidden, config.vocab_size, config.n_layer, config.n_head
    kv_heads, BT, cap = config.n_kv_head, B * T, 1 if config.logit_softcap else 0
    D = C // H
    kv = kv_heads * D
    gpt2, gain = config.arch == "gpt2", config.arch == "llama"  # gain: an RMSNorm with a learned gain
    swiglu = config.mlp_act == "swiglu"
    # weights, the gradients of the micro-steps before, the optimizers' state: --optimizer's (MATRIX_OPTIMIZERS) for
    # what it takes (the matrices, or every parameter), AdamW's two moments for the rest
    entry = MATRIX_OPTIMIZERS[optimizer]
    taken = params.total if entry.takes == "model" else params.matrices
    state = entry.state_bytes * taken + 8 * (params.total - taken)
    static = 8 * params.total + state
    # autocast's copies of the linear layers' weights and biases, cached through the forward pass; the weights'
    # are those backward needs
    cast_weights = 2 * (params.linear_weights + params.linear_biases) if low else 0
    saved_weights = 2 * params.linear_weights if low else 0
    head_weight = 2 * V * C if low else 0

    # Per token, what a block keeps for backward: its input and the residual stream after attention (fp32); each
    # norm's statistics (LayerNorm's mean and rstd; RMSNorm's rstd, and x * rstd where it has a gain); the norms'
    # outputs as the linear layers read them (under autocast one copy per layer); attention's inputs, output and
    # logsumexp (flash attention keeps no T x T scores); the MLP's hidden activations.
    norm = 8 if gpt2 else 4 + (4 * C if gain else 0)
    readers = 1 if gpt2 else 3  # attention's linear layers (the MLP's: mlp_kept_bytes)
    layer = 8 * C + 2 * norm + (readers * a * C if low else 4 * C) + mlp_kept_bytes(config, a) + 4 * H
    if gpt2:  # q, k, v in one tensor; the output
        layer += 4 * a * C
    else:  # q and k rotated, v, the output; QK-norm's fp32 q and k (llama's gain: and x * rstd) and its rstd, and a
        # contiguous copy of the output
        layer += 4 * a * C + (4 * (C + kv) * (2 if gain else 1) + 4 * (H + kv_heads) + a * C if config.qk_norm else 0)
    rotary = 0 if gpt2 else 4 * a * T * D  # each block's cos and sin for q and k (no batch dimension)
    value_embed = 4 * kv + 2 * a * kv_heads + (12 * a if low else 0)  # a value embedding and its gate
    n_value_embeds = (L + 1) // 2 if config.value_embeds else 0  # nanogpt.layers.value_embed_layers: every other
    tokens = 16  # x and y (int64)
    # speedrun: the normed embedding x0 (and the embedding); what x0_mix's and the U-net's products keep of the
    # residual stream besides each block's input
    if config.arch == "speedrun":
        tokens += 4 * C + 4 + (4 * C if config.x0_mix else 0)
    skips = 4 * C * ((L - 1 if config.x0_mix else 0) + (1 if config.unet_skips and L % 2 == 0 else 0))
    extra = params.extra_activation_bytes.get(a, 0)  # what the layers declare they keep beyond this count
    kept = ((4 * C * L if recompute else layer * L + extra) + skips
            + n_value_embeds * (4 * kv if recompute else value_embed))
    final = 4 * C + norm  # the last norm's input and statistics
    head_input = a * C if loss_impl == "plain" else 8 * C + (2 * C if low else 0)  # chunked: fp32, its gradient, a cast
    trunk = BT * (tokens + kept + final + head_input) + (0 if recompute else L * rotary)
    logits = a * V  # (batch_loss drops the logits as it returns: only what backward saves of them stays)
    moments = {}
    if loss_impl == "plain":
        # cross-entropy's fp32 log-softmax (kept; and the softcap's tanh), then in backward the gradients of it and
        # of its input, in fp32
        moments["head backward"] = static + head_weight + (0 if recompute else saved_weights) + trunk + BT * (
            logits * cap + 12 * V)
        # after the head's backward: its weight's gradient (and its fp32 cast under autocast) and its input's
        moments["head weight gradient"] = static + (0 if recompute else saved_weights) + trunk + BT * a * C + (
            V * C * (a + (4 if low else 0)))
        # the end of forward: the logits (and the softcap's tanh), an fp32 copy of them under autocast, and the
        # final norm's fp32 output
        moments["head forward"] = static + head_weight + cast_weights + trunk + BT * (
            logits * (1 + cap) + 4 * V + (4 * V + 4 * C if low else 0))
    elif loss_impl == "fused":
        # Liger-Kernel's (nanogpt.loss_head.fused_cross_entropy, read off its code; not measured: its kernel runs on a
        # GPU): (rows, V) logits per chunk in the matmuls' dtype, made their gradient in place, beside an fp32 sum of
        # the weight's gradient, the weight's cast and the input's gradient; at the end that sum scaled in fp32
        # (padded to the whole vocabulary first where the padding is masked)
        rows = fused_chunk_rows(BT, V, C)
        end = 4 * V * C * (2 if config.mask_padding and V > 50257 else 1)
        moments["fused head"] = static + cast_weights + trunk + V * C * (4 + (2 if low else 0)) + max(
            a * rows * V + a * BT * C, end)
    else:
        # nanogpt.loss_head: (rows, V) fp32 logits per chunk (two with a softcap) and their gradient's cast, with an
        # fp32 sum of the weight's gradient and the weight's cast; at the peak, the next chunk's logits made while the
        # last chunk's are held, or logsumexp's temporary of their size (inside the kernel), or a chunk's gradient of
        # x, or a chunk's gradient of the weight added to the sum (under autocast, in bf16 and cast to fp32 inside
        # add_) or the sum scaled at the end
        rows = min(BT, loss_chunk_rows(V))
        chunk = (4 * (1 + cap) + (2 if low else 0)) * rows * V
        weight = V * C * (4 + (2 if low else 0))
        more = BT > rows  # chunks before this one, whose gradient (fp32 without autocast) is still held
        loop = chunk + ((4 + (2 if low else 0)) * rows * V if more else 0)
        logsumexp = (4 * (1 + cap) + 4) * rows * V + ((2 if low else 4) * rows * V if more else 0)
        moments["chunked head"] = static + cast_weights + trunk + weight + max(
            loop, logsumexp, chunk + 8 * rows * C, chunk + (6 if low else 4) * V * C)
    # the end of backward: the embedding's gradient (a tied head's has waited for it, and their sum)
    moments["embedding gradient"] = static + BT * 16 + 4 * V * C * (3 if config.tie_embeddings else 1)
    if device_type != "cuda":  # (CUDA's AdamW is fused) AdamW's update of the embedding: two temporaries its size,
        # and the last of those of the tensor before it when that is one of (V, C) too: an untied head, value embeddings
        before = kv if config.value_embeds else C if not config.tie_embeddings else 0
        moments["optimizer step"] = static + BT * 16 + 8 * V * C + 4 * V * before
    if recompute:
        # the last block recomputed in backward: its activations (its input counted again, as the gradient of its
        # output) and the gradient of its MLP's hidden activations (SwiGLU's: both), beside every block's input; a
        # tied head's gradient waits for the embedding's until the end of backward. (What else its backward makes at
        # once depends on the order of the operations: this one is a low estimate.)
        moments["block backward"] = static + (saved_weights // L) + (4 * V * C if config.tie_embeddings else 0) + (
            rotary + BT * (tokens + kept + layer + extra // L + (2 if swiglu else 1) * a * F
                           + (value_embed if n_value_embeds else 0)))
    return moments


def estimated_bytes(config, params, B, T, dtype, optimizer="adamw", recompute=False, loss_impl="plain",
                    device_type="cpu"):
    """A low estimate of the memory one training process needs: the largest of peak_bytes_by_moment's moments,
    each a count of tensors alive at once that leaves out only small ones. Against the CPU allocator's peak through
    real steps (bench/memory_table.py, docs/speed.md "Memory": every recipe, fp32 and bf16, --recompute, --loss_impl
    chunked, up to d12) it was 0-0.31% below, never above by more than a few bytes; where a vocabulary of a few
    hundred makes the blocks most of the peak, --recompute is from 13% below to 0.3% above and --loss_impl chunked
    in bf16 up to 3% below."""
    return max(peak_bytes_by_moment(config, params, B, T, dtype, optimizer, recompute, loss_impl,
                                    device_type).values())


def run_estimated_bytes(config, params, args, batch_size, dtype, device_type, shards=1):
    """estimated_bytes of this run (its --seq_len, --optimizer, --recompute, --loss_impl) at a micro-batch: the one
    estimate of check_memory's refusal and of --batch_size auto's pick without a trial (a CPU's, --fsdp's). shards:
    --fsdp's ranks, each holding its share of the weights, their gradients and AdamW's state (16 bytes a parameter)
    and, gathered for its forward and backward, two Blocks' weights and gradients at once (one prefetched)."""
    estimate = estimated_bytes(config, params, batch_size, args.seq_len, dtype, args.optimizer, args.recompute,
                               args.loss_impl, device_type)
    if shards == 1:
        return estimate
    block = (params.total - config.vocab_size * config.n_embd) // config.n_layer  # at most a Block's parameters
    return estimate - 16 * params.total * (shards - 1) // shards + 2 * 8 * block


# What a CPU training process comes to hold beyond the tensors of the estimate once it trains: the parts of torch's
# libraries its first forward and backward page in, the blocks the allocator keeps after freeing them, the threads'
# buffers. Its resident peak was 82-253 MB above (its resident memory at the check + the estimate) on --model tiny's
# shapes (1 and 2 threads, 2 cores); this is 1.5x the most.
CPU_PROCESS_MARGIN = 384 * 2**20


def cpu_process_bytes(estimate):
    """The memory a CPU training process needs beyond what it holds at the check (which the memory available already
    leaves out), where its tensors peak at estimate bytes: check_memory's need, and --batch_size auto's on a CPU."""
    return estimate + CPU_PROCESS_MARGIN


GPU_CONTEXT_BYTES = 2**30  # the CUDA context, cuBLAS and cuDNN workspaces: outside the formula
GPU_FRAGMENTATION = 0.10  # the caching allocator's reserved memory over its allocated, as a share of the peak


def fits_on_gpu(peak_bytes, gpu_bytes):
    """Whether a training process whose tensors peak at peak_bytes fits a GPU of gpu_bytes (with the allocator's
    fragmentation and the CUDA context beside them): the rule of docs/speed.md's table of cards, and of --fsdp's
    micro-batch under --batch_size auto, against the GPU's free memory."""
    return peak_bytes * (1 + GPU_FRAGMENTATION) + GPU_CONTEXT_BYTES <= gpu_bytes


def available_memory_bytes(proc_root="/proc", cgroup_root="/sys/fs/cgroup"):
    """The memory this process may still take (Linux): the smaller of the machine's MemAvailable and its memory
    cgroup's room (a container's limit: docker --memory, Kubernetes, Slurm), whose kernel kills a process that
    passes it with no word; None where neither can be read. The roots are parameters for tests."""
    have = []
    try:
        with open(os.path.join(proc_root, "meminfo")) as f:
            have += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    room = cgroup_room(proc_root, cgroup_root)
    if room is not None:
        have.append(room)
    return min(have) if have else None


NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a huge number (9223372036854771712), v2 as "max"


def cgroup_room(proc_root="/proc", cgroup_root="/sys/fs/cgroup"):
    """The bytes this process's memory cgroups leave it, the least over its cgroup and those above it (each may
    have a limit): v2's memory.max - memory.current, v1's memory.limit_in_bytes - memory.usage_in_bytes; None where
    none has a limit or none can be read."""
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    places = []  # (folder of the hierarchy, limit file, usage file, the cgroup's path in it)
    for fields in lines:
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            places.append((cgroup_root, "memory.max", "memory.current", path))
        elif "memory" in controllers.split(","):
            places.append((os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes", path))
    rooms = []
    for mount, limit_file, usage_file, path in places:
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the cgroup, then each above it (a container sees its own as /)
            folder = os.path.join(mount, *parts[:depth])
            try:
                with open(os.path.join(folder, limit_file)) as f:
                    limit = f.read().strip()
                with open(os.path.join(folder, usage_file)) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit != "max" and limit.isdigit() and int(limit) < NO_LIMIT:
                rooms.append(max(0, int(limit) - usage))
    return min(rooms) if rooms else None


def widening_flags(args):
    """The flags given that widen the model beyond its preset's shape (--vocab_size: the embedding, the head and
    the logits; --mlp_hidden: every MLP), for an out-of-memory message to name."""
    return [f"--{name}" for name in ("vocab_size", "mlp_hidden") if name in args.explicit]


# the kinds of learning-rate schedule an optimizer's entry may ask for (MatrixOptimizer.schedules), and the flags that
# give each
SCHEDULE_KINDS = {"cosine": "--lr_schedule cosine", "wsd": "--lr_schedule wsd",
                  "held": "--lr_schedule wsd --warmdown_frac 0 (or --min_lr_frac 1)"}


def schedule_kinds(schedule):
    """The SCHEDULE_KINDS a run's learning-rate schedule (train_gpt2.LRSchedule) is: its shape, and "held" where the
    rate at the last step is still the peak its warm-up reached (or a resume moved it to)."""
    s = schedule.settings
    peak = s["max_lr"] if schedule.start_lr is None else schedule.start_lr
    return {s["lr_schedule"]} | ({"held"} if schedule(s["max_steps"] - 1) == peak else set())


def check_optimizer(args, dtype, schedule):
    """Refuse what --optimizer's entry of MATRIX_OPTIMIZERS says it cannot take: fp16 (its entry's fp16 off: the loss
    scaler is not wired to it), a learning-rate schedule (train_gpt2.LRSchedule) not of its schedules, and
    --fused_adamw where it takes the whole model and is not AdamW."""
    from nanogpt.optimizers import MATRIX_OPTIMIZERS

    entry = MATRIX_OPTIMIZERS[args.optimizer]
    if dtype == "fp16" and not entry.fp16:
        raise UserError(f"--optimizer {args.optimizer} trains in bf16 or fp32 (fp16's loss scaler is not wired to it); "
                        "use --dtype bf16 or fp32")
    if entry.schedules and not set(entry.schedules) & schedule_kinds(schedule):
        raise UserError(f"--optimizer {args.optimizer} trains with a {' or '.join(entry.schedules)} learning rate "
                        f"only, and this run's is {schedule.describe()}; give "
                        f"{' or '.join(SCHEDULE_KINDS[kind] for kind in entry.schedules)}")
    if "fused_adamw" in args.explicit and entry.make and entry.takes == "model":
        flag = "--fused_adamw" if args.fused_adamw else "--no_fused_adamw"
        raise UserError(f"{flag} does nothing with --optimizer {args.optimizer}, which takes every parameter (no AdamW "
                        "beside it); drop it")


def check_loss_impl(loss_impl, device_type):
    """--loss_impl fused where its kernel cannot run (no Liger-Kernel, or no CUDA GPU): one line naming the fix."""
    from nanogpt.loss_head import fused_head_problem

    problem = fused_head_problem(device_type) if loss_impl == "fused" else None
    if problem:
        raise UserError(f"--loss_impl fused {problem}")


def check_fp8(fp8, device):
    """--fp8 where it cannot run (no torchao, a GPU without FP8 tensor cores): one line naming the fix."""
    from nanogpt.float8 import fp8_problem

    problem = fp8_problem(device) if fp8 else None
    if problem:
        raise UserError(f"--fp8 {problem}")


def check_memory(config, params, args, dtype, device_type, local_world_size):
    """The kernel kills a process that runs out of memory without a word: say it before starting.
    Every model is built in main memory first; on a CPU it also trains there, and needs its tensors' estimate and
    CPU_PROCESS_MARGIN more than it holds now. (A GPU's out-of-memory is an error the loop turns into one line.)
    config is model_config's, --init_from's shape included; params its model's ParameterCounts."""
    have = available_memory_bytes()
    if have is None:
        return
    wide = " or ".join(widening_flags(args))
    smaller = (f"a smaller model than --init_from {args.init_from}" if args.init_from != "scratch"
               else f"a smaller {wide}, --model or --n_layer/--n_embd" if wide else "a smaller --model or --n_layer/--n_embd")
    weights = 4 * params.total
    if weights * local_world_size > have:
        raise UserError(f"the model's weights alone need {weights / 2**30:.1f} GiB per process "
                        f"but {have / 2**30:.1f} GiB of memory is available; pick {smaller}")
    need = cpu_process_bytes(run_estimated_bytes(config, params, args, args.batch_size, dtype, device_type)) * (
        local_world_size)
    if device_type == "cpu" and need > have:
        raise UserError(f"this run needs at least {need / 2**30:.1f} GiB of memory "
                        f"({local_world_size} process(es) of batch_size {args.batch_size} x seq_len {args.seq_len}) "
                        f"but {have / 2**30:.1f} GiB is available; lower --batch_size "
                        "(gradient accumulation keeps --total_batch_size) or --seq_len, or use "
                        + (f"a smaller {wide}" if wide else smaller if args.init_from != "scratch"
                           else "a smaller --n_layer/--n_embd" if args.model == "tiny" else "--model tiny"))


def check_scoring_context(block_size, what, fix):
    """A context of one token (a --seq_len 1 run's) predicts nothing, so every continuation would tie at a loss of
    0: scoring `what` is refused, saying `fix`."""
    if block_size < 2:
        raise UserError(f"a model with a context of {block_size} token cannot score {what}; {fix}")


def check_evaluations_context(args, config):
    """The loop's HellaSwag and CORE, refused before the log folder is made where the model cannot score them; a
    --sample_prompt given that is not UTF-8 or that the model's context cannot hold, likewise."""
    for flag, what in (("hellaswag_every", "HellaSwag endings"), ("core_every", "CORE's continuations")):
        if getattr(args, flag):
            check_scoring_context(config.block_size, what, f"give --seq_len 2 or more, or --{flag} 0")
    if args.sample_every and "sample_prompt" in args.explicit:
        try:
            args.sample_prompt.encode("utf-8")  # undecodable bytes of the command line arrive as lone surrogates
        except UnicodeEncodeError:
            raise UserError("--sample_prompt is not valid UTF-8 text; give the prompt in UTF-8") from None
        tokens = len(prompt_tokens(get_tokenizer(), args.sample_prompt))
        if tokens > config.block_size:
            raise UserError(f"--sample_prompt is {tokens} tokens, longer than the model's context of "
                            f"{config.block_size}; shorten it")


def check_log_dir(log_dir):
    """Refuse a --log_dir that cannot be written, before any work; it is made once the run has started."""
    parent = log_dir
    while not os.path.exists(parent) and os.path.dirname(os.path.abspath(parent)) != os.path.abspath(parent):
        parent = os.path.dirname(os.path.abspath(parent))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        what = "cannot be written" if os.path.isdir(parent) else "is not a folder"
        raise UserError(f"cannot create --log_dir {log_dir} ({parent} {what}); pick another folder")


def check_init_from_recipe(args, config):
    """--init_from brings its model: a --recipe whose architecture is another is refused (GPTConfig's flags are
    held to the weights' model by config_fields.refuse_another_model)."""
    if "recipe" in args.explicit and "arch" not in args.explicit and args.arch != config.arch:
        raise UserError(f"--recipe {args.recipe} trains --arch {args.arch}, but --init_from {args.init_from}'s weights "
                        f"are a {config.arch}; give --optimizer {args.optimizer} in its place, or drop --init_from")


def check_resume_args(args, saved_args, master, saved_config, model_presets, recipes, options):
    """Resuming continues the same run: args are the checkpoint's settings (saved_args, saved_arguments') with
    the command line's over them; what the command line changes is printed. The model (saved_config, the checkpoint's
    GPTConfig) and the flags declared resume="fixed" (options: the parser's {dest: RunOption}: the optimizer, the
    batch, the data order) cannot change. model_presets, recipes: train_gpt2's MODEL_PRESETS and RECIPES; a --model
    given is compared by its shape (with the shape flags given beside it), a --recipe by the settings it stands for
    (--recipe modern resumes a run started as --arch llama --optimizer muon)."""
    fixed = {name for name, option in options.items() if option.resume == "fixed"}
    local = {name for name, option in options.items() if option.resume == "local"}
    again = "drop the flag to resume, or use another --log_dir for a new run"
    refuse_another_model(saved_config, args, "the checkpoint's model", again)
    saved_args = {**saved_args, **asdict(saved_config)}  # the model as the checkpoint has it
    if "model" in args.explicit and saved_args.get("init_from", "scratch") == "scratch":
        shape = {k: saved_args[k] for k in ("n_layer", "n_head", "n_embd")}
        asked = {**model_presets[args.model], **{k: getattr(args, k) for k in shape if k in args.explicit}}
        if any(asked[k] != shape[k] for k in shape):
            raise UserError(f"--model {args.model} ({', '.join(f'{k} {asked[k]}' for k in shape)}) conflicts with "
                            f"the checkpoint's model ({', '.join(f'{k} {v}' for k, v in shape.items())}); {again}")
        saved_args = {**saved_args, "model": args.model}
    if "recipe" in args.explicit:  # judged by what of it a resume cannot change: the model and the optimizer
        implied = {k: v for k, v in recipes[args.recipe].items() if k in fixed or k in asdict(saved_config)}
        clash = {k: v for k, v in implied.items() if k not in args.explicit and saved_args.get(k, v) != v}
        if clash:
            raise UserError(f"--recipe {args.recipe} ({' '.join(f'--{k} {v}' for k, v in implied.items())}) conflicts "
                            f"with the checkpoint's {', '.join(f'{k} {saved_args[k]}' for k in clash)}; {again}")
        saved_args = {**saved_args, "recipe": args.recipe}
    for name in sorted(args.explicit - local):
        if name not in saved_args or getattr(args, name) == saved_args[name]:
            continue
        if name in fixed:
            raise UserError(f"--{name} {getattr(args, name)} conflicts with the checkpoint's "
                            f"{shown(saved_args[name])}; {again}")
        if master:
            print(f"--resume: --{name} changes from {shown(saved_args[name])} to {shown(getattr(args, name))}")
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
