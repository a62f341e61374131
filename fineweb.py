"""
FineWeb-Edu (or your own text files) -> GPT-2 token shards for train_gpt2.py.

    python fineweb.py                          # HF FineWeb-Edu sample-10BT -> edu_fineweb10B/ (~10B tokens, 100 shards)
    python fineweb.py --input data/austen.txt --output_dir data/tiny --shard_size 1e5  # the README's quick start
    python fineweb.py --input a.jsonl b.parquet c.txt --output_dir mydata --val_tokens 0.005  # val from all inputs
    python fineweb.py --download kjj0/fineweb10B-gpt2 --output_dir fineweb10B  # ready-made llm.c shards

Each document (a .txt file; a .jsonl line or .parquet row with a `text` field; a row of the streamed hub
dataset) becomes <|endoftext|> and its tiktoken `gpt2` tokens, in input order, cut into llm.c .bin shards of
exactly --shard_size tokens (the last shorter). Shard 0 is validation, or with --val_tokens, units drawn from
across the input go to val shards. manifest.json records each shard and the document it ends in, so the
same command again resumes after the last complete shard. docs/data.md tells the rest.
"""

import argparse
import codecs
import hashlib
import json
import math
import os
import re
import signal
import sys
import time
from collections import Counter, deque
from contextlib import closing, nullcontext
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from nanogpt.cli import CLIParser, UserError, brief, run_cli
from nanogpt.files import atomic_write, sha256_file, temporary_of
from nanogpt.shards import SHARD_HEADER_INTS, list_shards, read_shard, write_shard
from nanogpt.tokenizer import EOT_TOKEN, get_tokenizer

DEFAULT_DATASET, DEFAULT_NAME = "HuggingFaceFW/fineweb-edu", "sample-10BT"
KNOWN_TOKENS = {(DEFAULT_DATASET, DEFAULT_NAME): 9.9e9}  # for the progress bar's ETA and the rate of --val_tokens N
# of English text in GPT-2 tokens (data/austen.txt: 4.05): a local input's size in tokens, estimated
BYTES_PER_TOKEN = 4
UNIT_CHARS = 1 << 11  # with --val_tokens, a .txt is drawn from in units of at least this many characters (~500 tokens)
INPUT_TYPES = (".txt", ".jsonl", ".parquet")
REPEATED_INPUT = "its documents would be tokenized twice, and could be in both validation and train; drop one of them"
CHUNK_CHARS = 1 << 18  # a long document is cut into pieces of about this many characters to be tokenized
BATCH_CHARS = 1 << 18  # text per work item sent to a worker: pieces (or short documents) up to this many characters
HUB_CHECKPOINT_DOCS = 64  # remember the hub stream's position every N documents
HASH_BLOCK = 1 << 23  # an input is known by the sha256 of its 8 MiB blocks' sha256s
# batch_size x seq_len of train_gpt2.py at its defaults and with --model tiny (its RUN_PRESETS; a test holds these to
# the trainer's): one batch is that + 1 tokens (the last target), and the trainer reads no shard smaller than a batch
DEFAULT_BATCH, TINY_BATCH = (64, 1024), (8, 256)
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
EOT = np.array([EOT_TOKEN], np.uint16)  # put before a unit's tokens: made once, not per document
# Where GPT-2's pre-tokenizer cuts anyway, so no pre-token reaches across: after "\S\n" before "\S" or "\n\S"
# (that "\n" is a pre-token of its own), and in CRLF text before the last "\n" of "\S\r\n" or "\S\r\n\r\n" before
# "\S" (whitespace before "\S" is cut before its last character). Python's \s is at least as wide as the
# tokenizer's, so \S is no wider.
SAFE_SPLIT = re.compile(r"(?<=\S\n)(?=\n?\S)|(?<=\S\r)(?=\n\S)|(?<=\S\r\n\r)(?=\n\S)")
LOOKBEHIND = 4  # the most characters SAFE_SPLIT looks back on ("\S\r\n\r")


# -----------------------------------------------------------------------------
# Reading. Each reader yields documents (a str; for a .txt file, an iterator of its pieces) from number
# `skip` on, adds the input bytes it used to progress["bytes"], and returns the part of `skip` left.


def split_document(text, size=None):
    """Pieces of at least `size` (CHUNK_CHARS) characters (the last may be shorter) whose tokens,
    concatenated, are the text's."""
    start, size = 0, size or CHUNK_CHARS
    while len(text) - start > 2 * size and (m := SAFE_SPLIT.search(text, start + size, len(text) - size)):
        yield text[start : m.start()]
        start = m.start()
    yield text[start:]


def read_txt(path, progress):
    """The file as one document (UTF-8, kept exactly), read and handed on a piece at a time. The text not yet
    handed on is kept in blocks, and only what is new is searched for a split point: a file without one (a
    giant line) still reads in linear time."""
    decoder, blocks, size, scanned, offset = codecs.getincrementaldecoder("utf-8")(), [], 0, 0, 0
    start = 0  # the file offset of the bytes the decoder is given next (with those it holds back)
    try:
        with open(path, "rb") as f:
            while raw := f.read(CHUNK_CHARS):
                start = offset - len(decoder.getstate()[0])
                blocks.append(decoder.decode(raw))
                size, offset = size + len(blocks[-1]), offset + len(raw)
                progress["bytes"] += len(raw)
                while size > 2 * CHUNK_CHARS:  # a big file never sits in memory whole
                    search_from = max(CHUNK_CHARS, scanned)
                    begin = max(0, search_from - LOOKBEHIND)
                    if not (m := SAFE_SPLIT.search(last_chars(blocks, size - begin), search_from - begin)):
                        scanned = size  # no split point yet: not scanned again
                        break
                    text, cut = "".join(blocks), begin + m.start()
                    yield text[:cut]
                    blocks, size, scanned = [text[cut:]], size - cut, 0
        start = offset - len(decoder.getstate()[0])
        yield "".join(blocks) + decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {start + e.start:,}); convert it to UTF-8") from None
    except OSError as e:
        raise UserError(f"cannot read {path} ({brief(e)})") from None


def last_chars(blocks, n):
    """The last n characters of the blocks' text, joining only the blocks they lie in."""
    first, length = len(blocks), 0
    while length < n:
        first, length = first - 1, length + len(blocks[first - 1])
    return "".join(blocks[first:])[length - n :]


def text_of(value, where, field):
    if isinstance(value, str):
        return value
    kind = type(value).__name__
    what = "no" if value is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} in the"
    raise UserError(f'{where}: {what} "{field}" field (each document needs a string "{field}"; '
                    "use --text_field to read another)")


def read_jsonl(path, field, skip, progress):
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            progress["bytes"] += len(line)
            if line.strip() and (skip := skip - 1) < 0:  # a blank line is no document; skipped ones are not parsed
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python parses
                    raise UserError(f"{path}:{lineno}: not valid JSON ({brief(e)})") from None
                yield text_of(obj.get(field) if isinstance(obj, dict) else None, f"{path}:{lineno}", field)
    return max(skip, 0)


def open_parquet(path, field):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path}: not a readable parquet file ({brief(e)})") from None
    schema, names = pf.schema_arrow, pf.schema_arrow.names
    kind = schema.field(field).type if names.count(field) == 1 else pa.null()
    if pa.types.is_dictionary(kind):  # text stored once per distinct value (a pandas category, say)
        kind = kind.value_type
    if str(kind) not in ("string", "large_string", "string_view"):
        one = "single " if names.count(field) > 1 else ""
        raise UserError(f'{path}: no {one}"{field}" column of text (columns: {", ".join(names)}); use --text_field')
    return pf


def read_parquet(path, field, skip, progress):
    """One document per row; the row groups before `skip` are not even read."""
    pf, row, groups = open_parquet(path, field), 0, []
    for g in range(pf.metadata.num_row_groups):
        if groups or row + pf.metadata.row_group(g).num_rows > skip:
            groups.append(g)
        else:
            row += pf.metadata.row_group(g).num_rows
    per_row = os.path.getsize(path) / max(pf.metadata.num_rows, 1)
    progress["bytes"] += per_row * row
    for batch in pf.iter_batches(batch_size=1024, columns=[field], row_groups=groups):
        progress["bytes"] += per_row * batch.num_rows
        for text in batch.column(0).to_pylist():
            if (row := row + 1) > skip:
                yield text_of(text, f"{path}: row {row - 1}", field)
    return max(0, skip - pf.metadata.num_rows)


def read_local(paths, field, skip, progress):
    for path in paths:
        try:
            if not path.lower().endswith(".txt"):
                read = read_jsonl if path.lower().endswith(".jsonl") else read_parquet
                skip = yield from read(path, field, skip, progress)
            elif skip > 0:  # resuming: this document is in finished shards
                skip, progress["bytes"] = skip - 1, progress["bytes"] + os.path.getsize(path)
            else:
                yield read_txt(path, progress)
        except (OSError, ValueError) as e:  # pyarrow's errors on corrupt data are OSError or ValueError
            raise UserError(f"cannot read {path} ({brief(e)})") from None


def load_hub(args):
    import datasets
    from huggingface_hub.utils import logging as hub_logging  # the package loads .utils lazily: import it by name

    datasets.logging.set_verbosity_error()  # the hub client logs every retry; our one line says it all
    hub_logging.set_verbosity_error()
    try:
        ds = datasets.load_dataset(args.dataset, name=args.name or None, split=args.split, streaming=True)
    except Exception as e:
        raise UserError(f"cannot load {hub_name(args)} from the Hugging Face hub ({brief(e)}); "
                        "check the network and the names, or tokenize local files with --input FILE...") from None
    if ds.column_names is not None and args.text_field not in ds.column_names:
        raise UserError(f'{args.dataset} has no "{args.text_field}" column '
                        f'(columns: {", ".join(ds.column_names)}); use --text_field')
    return ds if ds.column_names is None else ds.select_columns([args.text_field])


def read_hub(ds, args, skip, checkpoint, states):
    """The streamed dataset's documents from number `skip` on; every HUB_CHECKPOINT_DOCS documents its
    position {"doc", "state"} goes into `states` (unless None), for the shard that ends there."""
    doc = 0
    if checkpoint:
        try:
            ds.load_state_dict(checkpoint["state"])
            doc = checkpoint["doc"]
        except Exception as e:  # e.g. a state from another datasets version
            print(f"cannot restore the stream position ({brief(e)}); "
                  f"streaming from the start to skip {skip:,} documents")
            ds = load_hub(args)
    it = iter(ds)
    while True:
        if states is not None and doc >= skip and doc % HUB_CHECKPOINT_DOCS == 0:
            states.append({"doc": doc, "state": ds.state_dict()})
        try:
            example = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise UserError(f"reading {args.dataset} failed at document {doc} ({brief(e)}); "
                            "run the same command again to resume") from None
        if doc >= skip:
            yield text_of(example.get(args.text_field), f"{args.dataset}: document {doc}", args.text_field)
        doc += 1


# -----------------------------------------------------------------------------
# Tokenizing and cutting shards. A unit is a document, or with --val_tokens a piece of a .txt of at least
# UNIT_CHARS characters; units are numbered over all inputs in order. A piece is text of at most about
# 2 x CHUNK_CHARS characters, tagged (unit, new_doc, first): first if it starts the unit, new_doc if that
# unit starts a document.


def pieces(docs, count, unit_chars, keep):
    """(tag, text) of each piece of each unit that keep(unit) allows. count: the documents and units read so far
    (units from count["units"] on are numbered here)."""
    for doc in docs:
        count["documents"] += 1
        if isinstance(doc, str) or not unit_chars:  # one unit: a str, or a .txt's pieces as read
            doc_units = [split_document(doc) if isinstance(doc, str) else doc]
        else:
            doc_units = ([unit] for piece in doc for unit in split_document(piece, unit_chars))
        for k, texts in enumerate(doc_units):
            count["units"] = (unit := count["units"]) + 1
            if keep(unit):
                yield from (((unit, k == 0, i == 0), text) for i, text in enumerate(texts))


def tokenize(texts):
    """The texts' tokens as one uint16 array, and where each text's tokens end. Special tokens stay text."""
    enc, parts = get_tokenizer(), []
    for text in texts:
        # encode_to_numpy (tiktoken >= 0.8) makes no Python int per token; encode_ordinary serves older
        # tiktoken and repairs lone surrogates (JSON escapes)
        try:
            parts.append(enc.encode_to_numpy(text, disallowed_special=()).astype(np.uint16))
        except (AttributeError, UnicodeEncodeError):
            parts.append(np.array(enc.encode_ordinary(text), dtype=np.uint16))
    return np.concatenate(parts), np.cumsum([len(p) for p in parts])


def batches(tagged):
    """The (tag, text) pairs in lists of about BATCH_CHARS characters: one work item for a worker."""
    batch, size = [], 0
    for item in tagged:
        batch.append(item)
        if (size := size + len(item[1]) + 1) >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenized(tagged, pool, window):
    """(tag, tokens) for each (tag, text), in order, tokenized by `pool` (None: here) with at most `window`
    batches in flight."""
    pending = deque()

    def oldest():
        batch, result = pending.popleft()
        tokens, ends = result.result() if pool else result
        return zip([tag for tag, _ in batch], np.split(tokens, ends[:-1]))

    for batch in batches(tagged):
        texts = [text for _, text in batch]
        # a killed worker breaks the pool: BrokenProcessPool
        pending.append((batch, pool.submit(tokenize, texts) if pool else tokenize(texts)))
        if len(pending) >= window:
            yield from oldest()
    while pending:
        yield from oldest()


def init_worker():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    if sys.platform == "linux":  # PR_SET_PDEATHSIG: if the main process is killed, do not linger as orphans
        __import__("ctypes").CDLL(None).prctl(1, signal.SIGTERM)


def save_json(path, obj):
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=1)


def split_of(name):
    return "val" if "_val_" in name else "train"


def shard_name(prefix, split, before):
    """The shard of `split` after `before` of its shards: val shards count from 0, train from 1."""
    return f"{prefix}_{split}_{before + (split == 'train'):06d}.bin"


class ShardWriter:
    """Writes, hashes and records shards in a thread, one at a time and in the order given."""

    def __init__(self, args, manifest, log, pool):
        self.args, self.manifest, self.log, self.pool, self.saved = args, manifest, log, pool, None
        self.count = len(manifest["shards"])  # written or being written, for --max_shards
        self.stopped = 0 < args.max_shards <= self.count

    def submit(self, split, entry, tokens):
        self.wait()  # the shard before is on disk and recorded; or its error comes out here
        shards = self.manifest["shards"]
        split = split or ("train" if shards else "val")  # the single stream: its first shard is val
        before = sum(split_of(s["name"]) == split for s in shards)
        entry = {"name": shard_name(self.manifest["prefix"], split, before), **entry}
        self.saved = self.pool.submit(self.save, entry, tokens)
        self.count += 1
        self.stopped = 0 < self.args.max_shards <= self.count

    def wait(self):
        if self.saved is not None:
            self.saved.result()

    def save(self, entry, tokens):
        entry["sha256"] = write_shard(os.path.join(self.args.output_dir, entry["name"]), tokens)
        self.manifest["shards"].append(entry)
        save_json(os.path.join(self.args.output_dir, "manifest.json"), self.manifest)
        self.log(f"wrote {entry['name']} ({entry['tokens']:,} tokens)")


class ShardCutter:
    """Cuts one stream of units' tokens into shards: split None, all units (the first shard val, the rest
    train); else that split's. Each shard records the unit it ends in (end_doc) and how many of that unit's
    tokens the stream holds up to there (end_doc_tokens), and with `states` (see read_hub) a hub position
    at or before that unit. A resumed stream starts again at the unit its last shard ended in: the tokens
    already in shards are dropped."""

    def __init__(self, split, out, states=None):
        self.split, self.out, self.states = split, out, states
        mine = [s for s in out.manifest["shards"] if split in (None, split_of(s["name"]))]
        last = mine[-1] if mine else {"end_doc": 0, "end_doc_tokens": 0}
        self.written = sum(s["tokens"] for s in mine)  # tokens in shards and the buffer
        # the stream position of the next token to come, and of the last unit's first token
        self.pos = self.unit_start = self.written - last["end_doc_tokens"]
        self.unit, self.checkpoint = last["end_doc"], last.get("checkpoint")  # the last unit added; a hub position
        self.buf, self.fill = np.empty(out.args.shard_size, np.uint16), 0

    def add(self, unit, tokens):
        if unit != self.unit:
            self.unit, self.unit_start = unit, self.pos
        i, self.pos = max(0, self.written - self.pos), self.pos + len(tokens)
        while i < len(tokens) and not self.out.stopped:
            take = min(len(tokens) - i, len(self.buf) - self.fill)
            self.buf[self.fill : self.fill + take] = tokens[i : i + take]
            self.fill, self.written, i = self.fill + take, self.written + take, i + take
            if self.fill == len(self.buf):
                self.flush()

    def flush(self):
        while self.states and self.states[0]["doc"] <= self.unit:  # the latest hub position at or before the unit
            self.checkpoint = self.states.popleft()
        entry = {"tokens": self.fill, "end_doc": self.unit, "end_doc_tokens": self.written - self.unit_start}
        if self.checkpoint:
            entry["checkpoint"] = self.checkpoint
        self.out.submit(self.split, entry, self.buf[: self.fill])
        self.buf, self.fill = np.empty(len(self.buf), np.uint16), 0

    def finish(self):
        """At the end of the input: the shorter last shard too, unless --max_shards stopped the writer."""
        if self.fill and not self.out.stopped:
            self.flush()


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


# -----------------------------------------------------------------------------
# Arguments, the output folder, the run


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


def hub_name(args):
    return f"{args.dataset} {args.name} ({args.split})" if args.name else f"{args.dataset} ({args.split})"


def build_parser():
    p = CLIParser(description="Tokenize FineWeb-Edu (or local .txt/.jsonl/.parquet files) into GPT-2 token shards.")
    p.add_argument("--dataset", default=DEFAULT_DATASET, help="Hugging Face dataset with a text column (streamed)")
    p.add_argument("--name", default=DEFAULT_NAME, help="its configuration ('' for none)")
    p.add_argument("--split", default="train", help="its split")
    p.add_argument("--input", nargs="+", action="extend", metavar="FILE", help="local files instead of the hub: a .txt "
                   "is one document, a .jsonl line or .parquet row is one document; documents keep this order (that of "
                   "all --input flags); a file given twice is refused")
    p.add_argument("--text_field", default="text", help="the field or column holding the text")
    p.add_argument("--download", metavar="REPO_ID",
                   help="instead of tokenizing: fetch the llm.c .bin shards of this hub dataset repo")
    p.add_argument("--output_dir", default="edu_fineweb10B", help="shards and manifest.json go here")
    p.add_argument("--prefix", default=None, help="shard names <prefix>_val_000000.bin, <prefix>_train_000001.bin, "
                   "...; None: edufineweb for the hub, the first --input file's name (letters and digits) for "
                   "local files")
    p.add_argument("--shard_size", type=count_arg, default=10**8, help="tokens per shard (1e8 style accepted); "
                   "without --val_tokens, shard 0 is validation")
    p.add_argument("--val_tokens", type=val_tokens_arg, help="validation drawn from across all inputs: a fraction "
                   "(0.001) of all tokens or a token count (1e6); it goes to val shards, the rest to train shards. "
                   "The unit drawn is a document; in a .txt, a piece of at least 2 KiB cut at a line break. "
                   "Without it, shard 0 (the first tokens) is validation")
    p.add_argument("--seed", type=int, default=1337, help="which units --val_tokens draws")
    p.add_argument("--num_proc", type=int, default=CPUS, help=f"tokenizer processes (1 to {4 * CPUS})")
    p.add_argument("--max_shards", type=int, default=0,
                   help="stop after this many shards in the folder (0: all); run again to go on")
    p.add_argument("--overwrite", action="store_true", help="delete shards made with other arguments and start over")
    return p


def check_args(args):
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


def content_hash(path):
    """The sha256 of the sha256s of the file's blocks, hashed side by side (hashlib releases the GIL):
    ~1% of the time tokenizing the file takes, however many cores do that."""
    def block(i):
        with open(path, "rb") as f:
            f.seek(i * HASH_BLOCK)
            return hashlib.sha256(f.read(HASH_BLOCK)).digest()

    blocks = max(1, -(-os.path.getsize(path) // HASH_BLOCK))
    with ThreadPoolExecutor(CPUS) as pool:
        return hashlib.sha256(b"".join(pool.map(block, range(blocks)))).hexdigest()


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


def text_bytes(path, field):
    """The file's size; for a .parquet, the uncompressed size of its text column."""
    if not path.lower().endswith(".parquet"):
        return os.path.getsize(path)
    meta = open_parquet(path, field).metadata
    columns = (meta.row_group(g).column(c) for g in range(meta.num_row_groups) for c in range(meta.num_columns))
    return sum(c.total_uncompressed_size for c in columns if c.path_in_schema == field)


def output_args(args):
    """What decides the shards' content: a rerun must match these to resume."""
    out = {"shard_size": args.shard_size, "prefix": args.prefix, "text_field": args.text_field}
    if args.val_tokens:
        out.update(val_tokens=args.val_tokens, seed=args.seed)
        if any(path.lower().endswith(".txt") for path in args.input or []):
            # how a .txt is cut into units decides which are drawn: a resume under other sizes or rule is refused
            out.update(txt_cuts=[UNIT_CHARS, CHUNK_CHARS, SAFE_SPLIT.pattern])
    if not args.input:
        return dict(out, dataset=args.dataset, name=args.name, split=args.split)
    try:
        args.input_stats = list(map(stat_of, args.input))  # taken before hashing: what changes later is seen
        inputs = [{"path": os.path.abspath(p), "bytes": os.path.getsize(p), "sha256_of_8MiB_blocks": content_hash(p)}
                  for p in args.input]
        first = {}  # content hash of each non-empty --input: the index of the first with it (an empty one adds nothing)
        for i, (path, entry) in enumerate(zip(args.input, inputs)):
            if entry["bytes"] and (was := first.setdefault(entry["sha256_of_8MiB_blocks"], i)) != i:
                raise UserError(f"--input {args.input[was]} and {path} hold the same content: {REPEATED_INPUT}")
        return dict(out, inputs=inputs)
    except OSError as e:
        raise UserError(f"cannot read --input {e.filename} ({brief(e)})") from None


def stat_of(path):
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def check_unchanged(args, inputs):
    """At the end of the input: a UserError if an --input changed since it was hashed (before it was read),
    as its shards may then mix its old and new content."""
    for path, stat, entry in zip(args.input, args.input_stats, inputs):
        try:
            same = stat_of(path) == stat or content_hash(path) == entry["sha256_of_8MiB_blocks"]
        except OSError:  # gone
            same = False
        if not same:
            raise UserError(f"--input {path} changed while it was read: the shards may mix its old and new content; "
                            "once it is final, run the same command with --overwrite")


def read_manifest(args):
    """The manifest of an earlier run, checked enough to resume from; None if there is none."""
    path = os.path.join(args.output_dir, "manifest.json")
    if not os.path.lexists(path):
        return None
    try:
        with open(path) as f:
            m = json.load(f)
        # the prefix is the args' (which a resume checks against a plain name): shard names stay in the folder
        if not (isinstance(m["args"], dict) and isinstance(m["shards"], list) and isinstance(m["complete"], bool)
                and isinstance(m["prefix"], str) and m["prefix"] == m["args"].get("prefix")):
            raise ValueError('"args", "shards", "complete" or "prefix" is not what fineweb.py writes')
        # shards per split; tokens per stream
        counts, totals, by_split = Counter(), Counter(), bool(m["args"].get("val_tokens"))
        for i, s in enumerate(m["shards"]):
            split = split_of(s["name"]) if by_split else "train" if i else "val"
            totals[split if by_split else None] += s["tokens"]
            if not (s["name"] == shard_name(m["prefix"], split, counts[split]) and isinstance(s["sha256"], str)
                    and type(s.get("checkpoint", {"doc": 0})["doc"]) is int
                    and all(type(s[k]) is int and s[k] >= 0 for k in ("tokens", "end_doc", "end_doc_tokens"))
                    and s["end_doc_tokens"] <= totals[split if by_split else None]):
                raise ValueError(f"shard entry {i} is not one fineweb.py writes")
            counts[split] += 1
        return m
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        if args.overwrite:  # replaced; but no shard there is known to be ours, so none is deleted
            return {"prefix": None, "shards": []}
        raise UserError(f"{path} is not a manifest of fineweb.py ({brief(e)}); choose another --output_dir, "
                        "or pass --overwrite to replace it") from None


def check_resume(args, old, want):
    """Nothing if the shards of manifest `old` were made with these arguments and are intact; else a UserError."""
    if "txt_cuts" not in want:  # older manifests record .txt unit sizes for every --val_tokens run: no .txt, no matter
        old = dict(old, args={k: v for k, v in old["args"].items() if k != "unit_chars"})
    olds, news = old["args"].get("inputs"), want.get("inputs")
    same_files = isinstance(olds, list) and all(isinstance(o, dict) and "sha256_of_8MiB_blocks" in o for o in olds) \
        and [o["path"] for o in olds] == [n["path"] for n in news or []]
    if old["args"] != want and news and olds != news and same_files:
        changed = next(n["path"] for o, n in zip(olds, news) if o != n)
        raise UserError(f"--input {changed} changed since the shards in {args.output_dir} were made from it; pass "
                        "--overwrite to start over with its new content (or put the old file back to resume)")
    if old["args"] != want:
        key = next(k for k in {**old["args"], **want} if old["args"].get(k) != want.get(k))
        was, now = json.dumps(old["args"].get(key))[:100], json.dumps(want.get(key))[:100]
        raise UserError(f"{args.output_dir} holds shards made with other arguments ({key} was {was}, now {now}); "
                        "rerun with the same arguments to resume, pass --overwrite to start over, "
                        "or choose another --output_dir")
    for shard in old["shards"]:
        path = os.path.join(args.output_dir, shard["name"])
        if not os.path.isfile(path) or os.path.getsize(path) != 4 * SHARD_HEADER_INTS + 2 * shard["tokens"]:
            raise UserError(f"{path} is missing or has the wrong size; pass --overwrite to start over")


def main(argv=None):
    if hasattr(sys.stdout, "reconfigure"):  # each progress line reaches a log file or a pipe when printed
        sys.stdout.reconfigure(line_buffering=True)
    args = build_parser().parse_marked(argv)
    check_args(args)
    if args.download is not None:
        return download(args)
    out, old = args.output_dir, read_manifest(args)
    want = output_args(args)
    val = val_split(args) if args.val_tokens else None
    resume = bool(old and old["shards"] and not args.overwrite)
    if resume:
        check_resume(args, old, want)
        if old["complete"] or 0 < args.max_shards <= len(old["shards"]):
            why = "" if old["complete"] else " (--max_shards)"
            return print(f"{out} already has {len(old['shards'])} shards{why}; nothing to do")
    source = "local files: " + ", ".join(args.input) if args.input else hub_name(args)
    manifest = old if resume else {"source": source, "tokenizer": "gpt2", "shard_size": args.shard_size,
                                   "prefix": args.prefix, "args": want, "shards": [], "complete": False}
    get_tokenizer()  # fail early; forked workers inherit it
    workers = ProcessPoolExecutor(args.num_proc, initializer=init_worker) if args.num_proc > 1 else nullcontext()
    try:  # leaving the with-block ends the workers
        with workers as pool:
            if pool is not None:  # fork the workers now, before this process has threads (the hub client's, ours)
                pool.submit(int).result()
            ds = None if args.input else load_hub(args)  # before anything in the folder changes
            os.makedirs(out, exist_ok=True)
            clear_folder(out, old and old["prefix"], manifest["shards"])
            save_json(os.path.join(out, "manifest.json"), manifest)  # before any shard: all of ours are in a manifest
            make_shards(args, manifest, ds, pool, val)
    except OSError as e:  # a full disk, a folder we may not write: the shards so far are intact
        raise UserError(f"cannot write shards to {out} ({brief(e)}); free space or pick another --output_dir "
                        "(rerunning the same command resumes after the last complete shard)") from None
    except BrokenProcessPool:
        raise UserError(f"a tokenizer process died (killed, e.g. by the out-of-memory killer); the "
                        f"{len(manifest['shards'])} shards written are kept: run the same command again to resume "
                        "(with a smaller --num_proc if memory is short)") from None


def clear_folder(out, prefix, shards):
    """Before any shard is written: refuse shards in `out` that are not ours (train_gpt2.py would read them
    too), then remove those of ours that the manifest does not list (from before --overwrite, or from a
    crash) and a killed run's temporaries. Ours: named with the `prefix` of the manifest found in `out`."""
    listed = {s["name"] for s in shards}
    shard = re.compile(rf"{re.escape(prefix or '')}_(val|train)_\d{{6}}\.bin")

    def is_stale(name):
        final = temporary_of(name)
        return final == "manifest.json" or bool(prefix and shard.fullmatch(final or name))

    stale = set(filter(is_stale, set(os.listdir(out)) - listed))
    others = sorted(set(map(os.path.basename, list_shards(out, "val") + list_shards(out, "train"))) - listed - stale)
    if others:
        raise UserError(f"{out} already holds shards without a manifest.json of fineweb.py ({others[0]}, ...); "
                        "train_gpt2.py would read them too: choose another --output_dir or remove them")
    for name in stale:
        os.remove(os.path.join(out, name))


def make_shards(args, manifest, ds, pool, val):
    from tqdm import tqdm

    shards, progress, states = manifest["shards"], {"bytes": 0}, None if val else deque()
    last = shards[-1] if shards and not val else None  # with --val_tokens, a resumed run reads the input from the start
    # units and documents read so far: those before `last` ends are skipped
    count = dict.fromkeys(("units", "documents"), last["end_doc"] if last else 0)
    if shards:
        todo = f"skipping {last['end_doc']:,} documents already done" if last else \
            "reading the input from the start (--val_tokens), tokenizing only what is not in shards yet"
        print(f"resuming after {len(shards)} shards in {args.output_dir}: {todo}")
    if args.input:
        docs = read_local(args.input, args.text_field, count["units"], progress)
        total, unit = sum(map(os.path.getsize, args.input)), "B"
    else:
        print(f"streaming {hub_name(args)} from the Hugging Face hub")
        docs = read_hub(ds, args, count["units"], last and last.get("checkpoint"), states)
        total, unit = KNOWN_TOKENS.get((args.dataset, args.name)), "tok"
    # disable=None: no bar when stderr is not a terminal (the per-shard lines still show progress). Leaving
    # the with-block: reading stops, and a shard being written is finished and recorded.
    with tqdm(total=total, unit=unit, unit_scale=True, unit_divisor=1000, desc="tokenizing", dynamic_ncols=True,
              disable=None) as bar, ThreadPoolExecutor(1) as writer:
        out = ShardWriter(args, manifest, print if bar.disable else bar.write, writer)
        cutters = {split: ShardCutter(split, out, states) for split in (("val", "train") if val else (None,))}
        router = Router(cutters, args.seed, val)
        t0, shards_before, done = time.time(), len(shards), False
        tagged = pieces(docs, count, UNIT_CHARS if val else 0, router.keep)
        with closing(tokenized(tagged, pool, 2 * args.num_proc if pool else 1)) as results:
            for tag, tokens in results:
                router.add(tag, tokens)
                bar.update((progress["bytes"] if unit == "B" else sum(c.written for c in cutters.values())) - bar.n)
                if out.stopped:
                    break
            else:  # the whole input is read: the last, shorter shards too, as far as --max_shards allows
                for c in cutters.values():
                    c.finish()
                done = not any(c.fill for c in cutters.values())
        if not any(c.written for c in cutters.values()):
            raise UserError("the input holds no documents")
        out.wait()
        if val and done and not cutters["val"].written:  # train_gpt2.py could not use the shards
            raise UserError(f"--val_tokens {args.val_tokens:,}: no unit of the input was drawn for validation (at a "
                            f"rate of {val[0]:.2g}, units being whole documents or pieces of a .txt of at least "
                            f"{UNIT_CHARS:,} characters); ask for more or try another --seed, with --overwrite")
        if done:
            if args.input:
                check_unchanged(args, manifest["args"]["inputs"])
            tokens = sum(c.written for c in cutters.values())
            manifest.update(complete=True, documents=count["documents"], tokens=tokens)
            if val:
                manifest.update(units=count["units"], val={"tokens": cutters["val"].written, "rate": val[0]})
            save_json(os.path.join(args.output_dir, "manifest.json"), manifest)
    rate = sum(s["tokens"] for s in shards[shards_before:]) / max(time.time() - t0, 1e-9) / 1e6  # as written
    speed = f"{rate:.2f}M tokens/s, {args.num_proc} process{'es' if args.num_proc > 1 else ''}"
    if not manifest["complete"]:
        return print(f"stopped after {len(shards)} shards (--max_shards {args.max_shards}; {speed}); "
                     "run again without it to go on")
    print(f"done: {len(shards)} shards, {manifest['tokens']:,} tokens of {manifest['documents']:,} documents "
          f"in {args.output_dir} ({speed})")
    report_split(args, shards, val and (val[1], cutters["val"].written))


def report_split(args, shards, val):
    """What a finished run's split means for train_gpt2.py. val: (tokens asked for, tokens drawn) with --val_tokens."""
    if val:
        (asked, got), total = val, sum(s["tokens"] for s in shards)
        short = got < asked < math.inf
        print(f"validation: {got:,} tokens ({got / total:.2%}) drawn from across the input (seed {args.seed})" + (
              f"; fewer than the {asked:,} asked for: units are drawn at random, at the rate the input's estimated "
              f"size (~{BYTES_PER_TOKEN} bytes per token) gives; ask for more, or give a fraction" if short else ""))
    if full := batch_fit(args.shard_size):
        print(f"{full[0]}: shards of {args.shard_size:,} tokens hold {full[1]}")
    ends = {split_of(s["name"]): s for s in shards}  # each split's last shard
    if "train" not in ends:
        print("note: that is only validation; train_gpt2.py needs train shards too: use a smaller "
              + ("--val_tokens" if val else f"--shard_size (now {args.shard_size:,})"))
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


def download(args):
    """The *.bin shards at the top of a hub dataset repo (val first, --max_shards of them) into --output_dir,
    sizes checked against the hub's, and a manifest.json for --verify_data. A rerun resumes: huggingface_hub
    skips the files already complete."""
    import huggingface_hub as hub
    from huggingface_hub.utils import logging as hub_logging  # the package loads .utils lazily: import it by name

    hub_logging.set_verbosity_error()  # not a line per retry
    out, source = args.output_dir, f"hub: {args.download}"
    try:  # never over the shards of another manifest.json (tokenized, another repo's, not fineweb.py's)
        with open(os.path.join(out, "manifest.json")) as f:
            was = json.load(f)["source"]
    except FileNotFoundError:
        was = source
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise UserError(f"{out}/manifest.json is not one of fineweb.py ({brief(e)}); --download would replace it: "
                        "choose another --output_dir") from None
    if was != source:
        raise UserError(f"{out} holds shards of {str(was)[:100]}; --download would replace them: "
                        "choose another --output_dir")
    try:
        files = hub.HfApi().list_repo_tree(args.download, repo_type="dataset")
        sizes = {f.path: f.size for f in files if f.path.endswith(".bin")}
        names = sorted(sizes, key=lambda n: ("_val_" not in n, n))[: args.max_shards or None]
        if not names:
            raise UserError(f"{args.download} holds no .bin token shards at its top level; name a repo of llm.c shards")
        if others := {os.path.basename(p) for p in list_shards(out, "val") + list_shards(out, "train")} - set(sizes):
            raise UserError(f"{out} holds other shards ({min(others)}, ...) that train_gpt2.py would read too; "
                            "choose another --output_dir")
        hub.snapshot_download(args.download, repo_type="dataset", local_dir=out, allow_patterns=names)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot download {args.download} from the Hugging Face hub ({brief(e)}); check the network "
                        "and the repo name (rerunning resumes)") from None
    shards = []
    try:
        for path, size in ((os.path.join(out, n), sizes[n]) for n in names):
            if (got := os.path.getsize(path) if os.path.isfile(path) else 0) != size:
                raise UserError(f"{path}: {got} bytes where the hub has {size}; "
                                "delete it and run the same command again")
            name = os.path.basename(path)
            shards.append({"name": name, "tokens": len(read_shard(path)), "sha256": sha256_file(path)})
        manifest = {"source": source, "tokenizer": "gpt2 (as published)", "shards": shards,
                    "complete": True, "tokens": sum(s["tokens"] for s in shards)}
        save_json(os.path.join(out, "manifest.json"), manifest)
    except OSError as e:
        raise UserError(f"cannot write {out}/manifest.json ({brief(e)}); "
                        "free space and run the same command again") from None
    print(f"done: {len(shards)} shards, {sum(s['tokens'] for s in shards):,} tokens of {args.download} in {out}")


if __name__ == "__main__":
    run_cli(main)
