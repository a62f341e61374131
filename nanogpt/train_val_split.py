"""
How fineweb.py's tokens split into validation and train: the rate and quota at which --val_tokens draws
units, and what a finished run's split means for train_gpt2.py (whether its shards hold a batch). Imports no torch.
"""

import math

from nanogpt.cli import UserError
from nanogpt.shard_manifest import split_of
from nanogpt.text_inputs import KNOWN_TOKENS, hub_name, text_bytes

# of English text in GPT-2 tokens (data/austen.txt: 4.05): a local input's size in tokens, estimated
BYTES_PER_TOKEN = 4
# batch_size x seq_len of train_gpt2.py at its defaults and with --model tiny (its RUN_PRESETS; a test holds these to
# the trainer's): one batch is that + 1 tokens (the last target), and the trainer reads no shard smaller than a batch
DEFAULT_BATCH, TINY_BATCH = (64, 1024), (8, 256)


def val_split(args):
    """(rate, quota) of --val_tokens: a fraction is the rate, with no quota; a count X is the quota, and
    the rate is X over the input's estimated size in tokens."""
    if args.val_tokens < 1:
        return args.val_tokens, math.inf
    if args.input:
        total = sum(text_bytes(path, args.text_field) for path in args.input) / BYTES_PER_TOKEN
    elif (total := KNOWN_TOKENS.get((args.dataset, args.name))) is None:
        raise UserError(f"--val_tokens {args.val_tokens}: the size of {hub_name(args)} is unknown, so a count of "
                        "tokens cannot be spread over it; give a fraction of it instead (e.g. --val_tokens 0.001)")
    if args.val_tokens >= total:
        raise UserError(f"--val_tokens {args.val_tokens:,}: the input holds only about {total:,.0f} tokens; "
                        "ask for fewer, or give a fraction")
    return args.val_tokens / total, args.val_tokens


def report_split(shards, shard_size, seed, val):
    """What a finished run's split means for train_gpt2.py. val: (tokens asked for, tokens drawn) with --val_tokens."""
    if val:
        (asked, got), total = val, sum(s["tokens"] for s in shards)
        short = got < asked < math.inf
        print(f"validation: {got:,} tokens ({got / total:.2%}) drawn from across the input (seed {seed})" + (
              f"; fewer than the {asked:,} asked for: units are drawn at random, at the rate the input's estimated "
              f"size (~{BYTES_PER_TOKEN} bytes per token) gives; ask for more, or give a fraction" if short else ""))
    if full := batch_fit(shard_size):
        print(f"{full[0]}: shards of {shard_size:,} tokens hold {full[1]}")
    ends = {split_of(s["name"]): s for s in shards}  # each split's last shard
    if "train" not in ends:
        print("note: that is only validation; train_gpt2.py needs train shards too: use a smaller "
              + ("--val_tokens" if val else f"--shard_size (now {shard_size:,})"))
    for split, s in ends.items():  # (without --val_tokens, the val shard is shard 0: full unless it is the only one)
        if (last := batch_fit(s["tokens"])) and last != full and (val or split == "train"):
            print(f"{last[0]}: the last {split} shard {s['name']} holds only {s['tokens']:,} tokens, {last[1]}")


def batch_fit(tokens):
    """None if a shard of `tokens` tokens holds one batch of train_gpt2.py at its defaults, else (level, words): the
    batches it is too small for, and what fits (--model tiny, the quick start's, or only a smaller batch)."""
    (b, t), (tiny_b, tiny_t) = DEFAULT_BATCH, TINY_BATCH
    if tokens > b * t:
        return None
    default, tiny = f"at its defaults ({b * t + 1:,} = {b}x{t}+1)", f"({tiny_b * tiny_t + 1:,} = {tiny_b}x{tiny_t}+1)"
    if tokens > tiny_b * tiny_t:
        return "note", (f"less than one batch of train_gpt2.py {default}, which reads no shard smaller than its "
                        f"batch; --model tiny's batch {tiny} fits")
    return "warning", (f"less than one batch of train_gpt2.py {default} or with --model tiny {tiny}, which reads no "
                       "shard smaller than its batch; a smaller --batch_size x --seq_len fits")
