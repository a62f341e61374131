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

import os
import signal
import sys
import time
from collections import deque
from contextlib import closing, nullcontext
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from nanogpt.arguments import check_fineweb_args, count_arg, val_tokens_arg
from nanogpt.cli import CLIParser, UserError, brief, run_cli
from nanogpt.files import CPUS
from nanogpt.hub_shards import download
from nanogpt.shard_manifest import (check_resume, check_unchanged, clear_folder, locked_output_dir, output_args,
                                    read_manifest, save_json, shard_name, split_of)
from nanogpt.shards import write_shard
from nanogpt.text_inputs import (DEFAULT_DATASET, DEFAULT_NAME, KNOWN_TOKENS, hub_name, load_hub, read_hub, read_local,
                                 split_document, txt_cuts)
from nanogpt.tokenizer import get_tokenizer
from nanogpt.train_val_split import Router, report_split, val_split

UNIT_CHARS = 1 << 11  # with --val_tokens, a .txt is drawn from in units of at least this many characters (~500 tokens)
BATCH_CHARS = 1 << 18  # text per work item sent to a worker: pieces (or short documents) up to this many characters


# -----------------------------------------------------------------------------
# Tokenizing and cutting shards. A unit is a document, or with --val_tokens a piece of a .txt of at least
# UNIT_CHARS characters; units are numbered over all inputs in order. A piece is text of at most about
# 2 x CHUNK_CHARS characters (text_inputs), tagged (unit, new_doc, first): first if it starts the unit, new_doc
# if that unit starts a document.


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


# -----------------------------------------------------------------------------
# Arguments (nanogpt.arguments checks them)


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


# -----------------------------------------------------------------------------
# The run: inputs -> tokenizer pool -> shard cutter -> manifest


def main(argv=None):
    if hasattr(sys.stdout, "reconfigure"):  # each progress line reaches a log file or a pipe when printed
        sys.stdout.reconfigure(line_buffering=True)
    args = build_parser().parse_marked(argv)
    check_fineweb_args(args)
    with locked_output_dir(args.output_dir):  # before the manifest is read: one run at a time writes the folder
        if args.download is not None:
            return download(args.download, args.output_dir, args.max_shards)
        return tokenize_into_folder(args)


def tokenize_into_folder(args):
    """The input tokenized into shards in --output_dir, after the shards already there (a resume)."""
    out, old = args.output_dir, read_manifest(args.output_dir, args.overwrite)
    want = output_args(args, txt_cuts(UNIT_CHARS))
    val = val_split(args) if args.val_tokens else None
    resume = bool(old and old["shards"] and not args.overwrite)
    if resume:
        check_resume(out, old, want)
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
    report_split(shards, args.shard_size, args.seed, val and (val[1], cutters["val"].written))


if __name__ == "__main__":
    run_cli(main)
