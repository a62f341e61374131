"""
How fineweb.py's tokens split into validation and train: the rate and quota at which --val_tokens draws
units, the Router that sends each unit to its split, and what a finished run's split means for
train_gpt2.py (whether its shards hold a batch). Imports no torch.
"""

import math

import numpy as np

from nanogpt.cli import UserError
from nanogpt.shard_manifest import split_of
from nanogpt.text_inputs import KNOWN_TOKENS, hub_name, text_bytes
from nanogpt.tokenizer import EOT_TOKEN

# of English text in GPT-2 tokens (data/austen.txt: 4.05): a local input's size in tokens, estimated
BYTES_PER_TOKEN = 4
# batch_size x seq_len of train_gpt2.py at its defaults and with --model tiny (its RUN_PRESETS; a test holds these to
# the trainer's): one batch is that + 1 tokens (the last target), and the trainer reads no shard smaller than a batch
DEFAULT_BATCH, TINY_BATCH = (64, 1024), (8, 256)
EOT = np.array([EOT_TOKEN], np.uint16)  # put before a unit's tokens: made once, not per document


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


def draw(seed, unit):
    """A number in [0, 1) fixed by (seed, unit): splitmix64's output for the unit-th step from the seed."""
    z = (unit * 0x9E3779B97F4A7C15 + seed) % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return ((z ^ (z >> 31)) >> 11) / 2**53


class Router:
    """Sends each unit's tokens to its split's cutter. Without --val_tokens (val None) there is one, split None.
    With it (val: rate, quota), a unit is val if draw(seed, unit) < rate and the val units before it hold
    fewer than `quota` tokens, else train. Each unit's tokens start with <|endoftext|>, but a .txt unit that
    follows its text's previous unit in the same split goes on without one. A resumed run with --val_tokens
    reads the input from the start: the units before each cutter's first are in shards already (and so not
    tokenized: keep)."""

    def __init__(self, cutters, seed, val):
        self.cutters, self.seed, (self.rate, self.quota) = cutters, seed, val or (None, None)
        self.first = {split: c.unit for split, c in cutters.items()}
        self.val_tokens = cutters["val"].pos if val else 0  # tokens of the val units before the next one
        self.split, self.unit = None, -1  # the last unit's split and number

    def drawn_split(self, unit):
        """The unit's split while the val quota is not met."""
        return None if self.rate is None else "val" if draw(self.seed, unit) < self.rate else "train"

    def keep(self, unit):
        """Whether the unit may still be needed (else it is in shards, and its split is the one drawn)."""
        return unit >= self.first[self.drawn_split(unit)]

    def add(self, tag, tokens):
        """The tokens of a piece tagged (unit, new_doc, first)."""
        unit, new_doc, first = tag
        if first:
            before = self.split if self.unit == unit - 1 else self.drawn_split(unit - 1)
            drawn = self.drawn_split(unit)
            self.split = "train" if drawn == "val" and self.val_tokens >= self.quota else drawn
            if new_doc or self.split != before:
                tokens = np.concatenate([EOT, tokens])
            self.unit = unit
        self.val_tokens += len(tokens) * (self.split == "val")
        if unit >= self.first[self.split]:
            self.cutters[self.split].add(unit, tokens)
