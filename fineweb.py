"""
FineWeb-Edu (or your own text files) -> GPT-2 token shards for train_gpt2.py.

    python fineweb.py                          # HF FineWeb-Edu sample-10BT -> edu_fineweb10B/ (~10B tokens, 100 shards)
    python fineweb.py --input data/austen.txt --output_dir data/tiny --shard_size 1e5  # the README's quick start
    python fineweb.py --input a.jsonl b.parquet --text_field content --output_dir mydata

Every document becomes <|endoftext|> followed by its tiktoken `gpt2` tokens (encode_ordinary: text
that looks like a special token stays text). The stream of all documents, in input order, is cut
into shards of exactly --shard_size tokens (the last one shorter); a document that crosses a
boundary fills the shard and its remainder starts the next one, as in build-nanogpt. Shard 0 is
validation, the rest train. Shards are llm.c .bin files written by train_gpt2.write_shard.

manifest.json beside the shards records the arguments, every shard's token count and sha256, and
the document each shard ends in, so running the same command again after a crash or Ctrl-C
resumes after the last complete shard (the documents before it are skipped, not re-tokenized).

Speed: --num_proc worker processes tokenize ~256 KB chunks of text in input order, while a reader
thread streams the input and a writer thread writes and hashes the finished shard, so tokenizing
only waits on the CPU (measured: 5.1M tokens/s on a 2-core box where build-nanogpt's one-process loop
makes 2.6M; 15.5M on 16 cores where that loop makes 1.4M). Memory stays flat: the hub dataset is streamed, local files are read
in chunks, a few chunks are in flight, and a document bigger than a chunk is cut at line breaks where
GPT-2's pre-tokenizer cuts anyway, so its tokens are unchanged.
"""

import argparse
import codecs
import json
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from common import CLIParser, UserError, atomic_write, brief, run_cli
from train_gpt2 import EOT_TOKEN, SHARD_HEADER_INTS, get_tokenizer, list_shards, write_shard

DEFAULT_DATASET = "HuggingFaceFW/fineweb-edu"
DEFAULT_NAME = "sample-10BT"
# tokens of known datasets, for the progress bar's ETA (build-nanogpt: 100 shards of 1e8, the last partial)
KNOWN_TOKENS = {(DEFAULT_DATASET, DEFAULT_NAME): 9.9e9}
INPUT_TYPES = (".txt", ".jsonl", ".json", ".parquet")

CHUNK_CHARS = 1 << 18  # text per work item sent to a worker; also the longest piece a big document is cut into
HUB_CHECKPOINT_DOCS = 64  # remember the hub stream's position every N documents (resume restarts from there)

# A place where GPT-2's pre-tokenizer splits anyway: one "\n" between two non-space characters (the
# newline is a piece of its own, and neither neighbour's piece can reach across it). Python's \s is at
# least as wide as the tokenizer's, so every match here is a real split point.
SAFE_SPLIT = re.compile(r"(?<=\S\n)(?=\S)")


# -----------------------------------------------------------------------------
# Reading documents. A source yields pieces (text, first, nbytes, checkpoint): `first` marks the
# start of a document, nbytes is the input consumed (the progress bar's measure for local files),
# checkpoint is {"doc": index, "state": hub stream state} or None.



def split_document(text):
    """Pieces of at least CHUNK_CHARS (the last may be shorter) whose tokens, concatenated, are the text's."""
    start = 0
    while len(text) - start > 2 * CHUNK_CHARS:
        m = SAFE_SPLIT.search(text, start + CHUNK_CHARS, len(text) - CHUNK_CHARS)
        if m is None:
            break
        yield text[start : m.start()]
        start = m.start()
    yield text[start:]


def document_pieces(text, nbytes, checkpoint=None):
    for i, piece in enumerate(split_document(text)):
        yield piece, i == 0, nbytes if i == 0 else 0, checkpoint if i == 0 else None


def read_txt(path):
    """One document: the whole file as UTF-8 (kept exactly, \\r\\n included), read CHUNK_CHARS bytes at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, first, offset, consumed, scanned = "", True, 0, 0, 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(CHUNK_CHARS)
            held = len(decoder.getstate()[0])  # bytes of a character cut by the previous read
            try:
                buf += decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise UserError(f"{path}: not UTF-8 text (byte {offset - held + e.start}); convert it to UTF-8") from None
            offset, consumed = offset + len(raw), consumed + len(raw)
            # hand out pieces as soon as the buffer holds two, so a big file never sits in memory whole
            while len(buf) > 2 * CHUNK_CHARS:
                m = SAFE_SPLIT.search(buf, max(CHUNK_CHARS, scanned))
                if m is None:
                    scanned = len(buf)  # no split point so far: do not scan this part again
                    break
                yield buf[: m.start()], first, consumed, None
                buf, first, consumed, scanned = buf[m.start() :], False, 0, 0
            if not raw:
                break
    yield buf, first, consumed, None


def check_text(value, where, field):
    if not isinstance(value, str):
        what = "no" if value is None else f"a {type(value).__name__} in the"
        raise UserError(f'{where}: {what} "{field}" field (each document needs a string "{field}"; '
                        f"use --text_field to read another field)")
    return value


def read_jsonl(path, field, skip):
    """One document per non-empty line, a JSON object with a string `field`. Returns the part of
    `skip` this file did not cover (so do the other readers)."""
    pending = 0  # bytes not yet credited to the progress bar
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            pending += len(line)
            if not line.strip():
                continue
            if skip > 0:  # resuming: this document is in finished shards
                skip -= 1
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({brief(e)})") from None
            if not isinstance(obj, dict):
                raise UserError(f'{path}:{lineno}: not a JSON object with a "{field}" field')
            yield from document_pieces(check_text(obj.get(field), f"{path}:{lineno}", field), pending)
            pending = 0
    yield "", False, pending, None
    return skip


def read_json(path, field, skip):
    """A .json file is JSON Lines, or one JSON array of objects (read whole: prefer .jsonl for big data)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        return (yield from read_jsonl(path, field, skip))
    try:
        with open(path, "rb") as f:
            items = json.load(f)
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({brief(e)})") from None
    per_item = os.path.getsize(path) / max(len(items), 1)
    pending = per_item * min(skip, len(items))
    for i in range(skip, len(items)):
        obj = items[i]
        if not isinstance(obj, dict):
            raise UserError(f'{path}: item {i} of the array is not an object with a "{field}" field')
        yield from document_pieces(check_text(obj.get(field), f"{path}: item {i}", field), per_item + pending)
        pending = 0
    yield "", False, pending, None
    return max(0, skip - len(items))


def open_parquet(path, field):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path}: not a readable parquet file ({brief(e)})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise UserError(f'{path}: no "{field}" column (columns: {", ".join(schema.names)}); use --text_field')
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(f'{path}: column "{field}" holds {kind}, not text; use --text_field')
    return pf


def read_parquet(path, field, skip):
    """One document per row; row groups before `skip` are not even read."""
    pf = open_parquet(path, field)
    num_rows = pf.metadata.num_rows
    per_row = os.path.getsize(path) / max(num_rows, 1)
    groups, row = [], 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if groups or row + n > skip:
            groups.append(g)
        else:
            row += n
    pending = per_row * min(skip, num_rows)
    try:
        for batch in pf.iter_batches(batch_size=1024, columns=[field], row_groups=groups):
            for text in batch.column(0).to_pylist():
                if row >= skip:
                    yield from document_pieces(check_text(text, f"{path}: row {row}", field), per_row + pending)
                    pending = 0
                row += 1
    except OSError as e:  # pyarrow's errors on corrupt data are OSError subclasses
        raise UserError(f"{path}: cannot read row {row} ({brief(e)})") from None
    yield "", False, pending, None
    return max(0, skip - num_rows)


def read_local(paths, field, skip):
    """Documents of the --input files in order, from document number `skip` on."""
    for path in paths:
        ext = os.path.splitext(path)[1].lower()
        if ext != ".txt":
            reader = {".jsonl": read_jsonl, ".json": read_json, ".parquet": read_parquet}[ext]
            skip = yield from reader(path, field, skip)
        elif skip > 0:
            skip -= 1
            yield "", False, os.path.getsize(path), None
        else:
            yield from read_txt(path)


def load_hub(args):
    import datasets
    import huggingface_hub

    # the hub client logs every retry; the one line we print on failure says it all
    datasets.logging.set_verbosity_error()
    huggingface_hub.utils.logging.set_verbosity_error()
    try:
        ds = datasets.load_dataset(args.dataset, name=args.name or None, split=args.split, streaming=True)
    except Exception as e:
        raise UserError(f"cannot load {hub_name(args)} from the Hugging Face hub "
                        f"({brief(e)}); check the network and the names, or tokenize local files with --input FILE...") from None
    if ds.column_names is not None:
        if args.text_field not in ds.column_names:
            raise UserError(f'{args.dataset} has no "{args.text_field}" column (columns: {", ".join(ds.column_names)}); use --text_field')
        ds = ds.select_columns([args.text_field])
    return ds


def read_hub(ds, args, skip, checkpoint):
    """Documents of a streamed hub dataset (no disk cache, flat memory) from number `skip` on. Every
    HUB_CHECKPOINT_DOCS documents the stream's position comes along as {"doc", "state"}, so a resume
    restarts near its shard boundary instead of streaming everything before it again."""
    doc = 0
    if checkpoint is not None:
        try:
            ds.load_state_dict(checkpoint["state"])
            doc = checkpoint["doc"]
        except Exception as e:  # e.g. a state from another datasets version
            print(f"cannot restore the stream position ({brief(e)}); streaming from the start to skip {skip:,} documents")
            ds = load_hub(args)
    it = iter(ds)
    try:
        while True:
            state = ds.state_dict() if doc >= skip and doc % HUB_CHECKPOINT_DOCS == 0 else None
            try:
                example = next(it)
            except StopIteration:
                return
            except Exception as e:
                raise UserError(f"reading {args.dataset} failed at document {doc} ({brief(e)}); "
                                "run the same command again to resume") from None
            if doc >= skip:
                text = check_text(example.get(args.text_field), f"{args.dataset}: document {doc}", args.text_field)
                yield from document_pieces(text, 0, None if state is None else {"doc": doc, "state": state})
            doc += 1
    finally:
        it.close()


# -----------------------------------------------------------------------------
# Tokenizing


@dataclass
class Chunk:
    texts: list  # document pieces in input order
    first: list  # first[i]: texts[i] starts a document, so <|endoftext|> goes before it
    nbytes: float  # input consumed by these pieces (progress)
    checkpoints: list  # {"doc", "state"} positions of the hub stream among these pieces


def make_chunks(pieces):
    """Group pieces into chunks of about CHUNK_CHARS characters."""
    chunk, size = Chunk([], [], 0.0, []), 0
    for text, first, nbytes, checkpoint in pieces:
        if text or first:
            chunk.texts.append(text)
            chunk.first.append(first)
        chunk.nbytes += nbytes
        if checkpoint is not None:
            chunk.checkpoints.append(checkpoint)
        size += len(text) + 1
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = Chunk([], [], 0.0, []), 0
    if chunk.texts or chunk.nbytes:
        yield chunk


EOT = np.array([EOT_TOKEN], dtype=np.uint32)


def tokenize(texts, first):
    """(tokens, starts): the chunk's tokens as one uint16 array, <|endoftext|> before each document,
    and the offsets of those <|endoftext|> tokens. Exactly encode_ordinary, without a Python int per
    token where tiktoken has encode_to_numpy (>= 0.8)."""
    enc = get_tokenizer()
    to_numpy = getattr(enc, "encode_to_numpy", None)
    parts, starts, n = [], [], 0
    for text, is_first in zip(texts, first):
        if is_first:
            starts.append(n)
            parts.append(EOT)
            n += 1
        try:
            ids = to_numpy(text, disallowed_special=()) if to_numpy else enc.encode_ordinary(text)
        except UnicodeEncodeError:  # lone surrogates (from JSON escapes): encode_ordinary repairs them
            ids = enc.encode_ordinary(text)
        parts.append(np.asarray(ids, dtype=np.uint32))
        n += len(ids)
    tokens = np.concatenate(parts).astype(np.uint16) if parts else np.zeros(0, dtype=np.uint16)
    return tokens, np.array(starts, dtype=np.int64)


def init_worker():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    if sys.platform == "linux":  # PR_SET_PDEATHSIG: if the main process is killed, do not linger as orphans
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    get_tokenizer()


def tokenized(chunks, pool, window):
    """(chunk, tokens, starts) in input order. Pool.imap would pull the whole input into its task
    queue ahead of the workers; keeping `window` chunks in flight keeps memory flat."""
    if pool is None:
        for chunk in chunks:
            yield chunk, *tokenize(chunk.texts, chunk.first)
        return
    pending = deque()
    for chunk in chunks:
        pending.append((chunk, pool.apply_async(tokenize, (chunk.texts, chunk.first))))
        chunk.texts = chunk.first = None  # only the task holds the text now, until it is sent
        if len(pending) >= window:
            chunk, result = pending.popleft()
            yield chunk, *result.get()
    while pending:
        chunk, result = pending.popleft()
        yield chunk, *result.get()


def in_background(iterable, size):
    """Run a generator in a thread, up to `size` items ahead, so reading (disk, network, JSON
    parsing) overlaps tokenizing. Its exceptions come out here."""
    q, stop, done, failed = queue.Queue(size), threading.Event(), object(), []

    def put(item):
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def run():
        try:
            for item in iterable:
                if not put(item):
                    return
        except BaseException as e:
            failed.append(e)
        finally:
            iterable.close()
        put(done)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                if failed:
                    raise failed[0]
                return
            yield item
    finally:
        stop.set()
        thread.join(timeout=30)


# -----------------------------------------------------------------------------
# Shards and the manifest


def save_json(path, obj):
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=1)


def shard_name(prefix, index):
    return f"{prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


class ShardCutter:
    """Cuts the token stream into shards of exactly shard_size tokens and keeps the manifest.
    Positions are indices into the stream of all documents' tokens; after a resume the stream is
    regenerated from the document the last shard ended in, and tokens already in shards are dropped."""

    def __init__(self, out_dir, manifest, max_shards, log):
        self.out_dir, self.manifest, self.max_shards, self.log = out_dir, manifest, max_shards, log
        self.shard_size = manifest["shard_size"]
        shards = manifest["shards"]
        self.written = sum(s["tokens"] for s in shards)  # tokens in finished shards, then in the buffer too
        last = shards[-1] if shards else {"end_doc": 0, "end_doc_tokens": 0, "checkpoint": None}
        self.pos = self.written - last["end_doc_tokens"]  # stream position of the next token to arrive
        self.ndocs = last["end_doc"]  # index of the next document to start
        self.doc_start = self.pos
        self.prev_checkpoint = last.get("checkpoint")
        self.buf, self.fill = np.empty(self.shard_size, dtype=np.uint16), 0
        self.writer = ThreadPoolExecutor(1)  # writing + hashing a shard overlaps tokenizing the next
        self.pending = None
        self.stopped = False

    def add(self, tokens, starts, checkpoints):
        g0 = self.pos
        self.pos += len(tokens)
        gstarts = g0 + starts
        i = max(0, self.written - g0)
        while i < len(tokens) and not self.stopped:
            take = min(len(tokens) - i, self.shard_size - self.fill)
            self.buf[self.fill : self.fill + take] = tokens[i : i + take]
            self.fill, self.written, i = self.fill + take, self.written + take, i + take
            if self.fill == self.shard_size:
                last = self.written - 1  # the shard's last token: which document is it in?
                j = int(np.searchsorted(gstarts, last, side="right")) - 1
                doc, start = (self.ndocs + j, int(gstarts[j])) if j >= 0 else (self.ndocs - 1, self.doc_start)
                # the latest hub position at or before that document: a resume restarts there
                ck = next((c for c in reversed(checkpoints) if c["doc"] <= doc), self.prev_checkpoint)
                self.flush(doc, self.written - start, ck)
        self.ndocs += len(starts)
        if len(starts):
            self.doc_start = int(gstarts[-1])
        if checkpoints:
            self.prev_checkpoint = checkpoints[-1]

    def flush(self, end_doc, end_doc_tokens, checkpoint):
        index = len(self.manifest["shards"]) + (self.pending is not None)
        self.wait()
        name = shard_name(self.manifest["prefix"], index)
        entry = {"name": name, "tokens": self.fill, "end_doc": end_doc, "end_doc_tokens": end_doc_tokens}
        if checkpoint is not None:
            entry["checkpoint"] = checkpoint
        future = self.writer.submit(write_shard, os.path.join(self.out_dir, name), self.buf[: self.fill])
        self.pending = (entry, future)
        self.buf, self.fill = np.empty(self.shard_size, dtype=np.uint16), 0
        if self.max_shards and index + 1 >= self.max_shards:
            self.stopped = True

    def wait(self):
        """Record the shard being written, once it is on disk."""
        if self.pending is None:
            return
        entry, future = self.pending
        self.pending = None
        entry["sha256"] = future.result()
        self.manifest["shards"].append(entry)
        save_json(os.path.join(self.out_dir, "manifest.json"), self.manifest)
        self.log(f"wrote {entry['name']} ({entry['tokens']:,} tokens)")

    def finish(self):
        """The end of the input: the last, shorter shard, and the manifest marked complete."""
        if self.fill:
            self.flush(self.ndocs - 1, self.written - self.doc_start, None)
        self.wait()
        self.manifest["complete"] = True
        self.manifest["documents"] = self.ndocs
        self.manifest["tokens"] = self.written
        save_json(os.path.join(self.out_dir, "manifest.json"), self.manifest)

    def close(self):
        """On any exit: a shard already being written is finished and recorded (not on writer errors)."""
        try:
            if self.pending is not None and self.pending[1].exception() is None:
                self.wait()
        finally:
            self.writer.shutdown()


# -----------------------------------------------------------------------------
# Arguments, the output folder, the run


def count_arg(text):
    """1e8, 100000000 or 100_000_000."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value.is_integer() or not 1 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to 2**31-1")
    return int(value)


def hub_name(args):
    return f"{args.dataset} {args.name} ({args.split})" if args.name else f"{args.dataset} ({args.split})"


def build_parser():
    p = CLIParser(description="Tokenize FineWeb-Edu (or local .txt/.jsonl/.json/.parquet files) into GPT-2 token shards.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default=DEFAULT_DATASET, help="Hugging Face dataset with a text column (streamed)")
    p.add_argument("--name", default=DEFAULT_NAME, help="its configuration ('' for none)")
    p.add_argument("--split", default="train", help="its split")
    p.add_argument("--input", nargs="+", metavar="FILE", help="local files instead of the hub: a .txt is one document, "
                   "a .jsonl line / .json array item / .parquet row is one document; documents keep this order")
    p.add_argument("--text_field", default="text", help="the field or column holding the text")
    p.add_argument("--output_dir", default="edu_fineweb10B", help="shards and manifest.json go here")
    p.add_argument("--prefix", default=None, help="shard names <prefix>_val_000000.bin, <prefix>_train_000001.bin, ...; "
                   "None: edufineweb for the hub, the first --input file's name (letters and digits) for local files")
    p.add_argument("--shard_size", type=count_arg, default=10**8, help="tokens per shard (1e8 style accepted); shard 0 is validation")
    p.add_argument("--num_proc", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                   help="tokenizer processes")
    p.add_argument("--max_shards", type=int, default=0, help="stop after this many shards in the folder (0: all); run again to go on")
    p.add_argument("--overwrite", action="store_true", help="delete shards made with other arguments and start over")
    return p


def output_args(args):
    """What decides the shards' content: a rerun must match these to resume."""
    out = {"shard_size": args.shard_size, "prefix": args.prefix, "text_field": args.text_field}
    if args.input:
        out["inputs"] = [{"path": os.path.abspath(p), "bytes": os.path.getsize(p)} for p in args.input]
    else:
        out.update(dataset=args.dataset, name=args.name, split=args.split)
    return out


def check_args(args):
    if args.num_proc < 1:
        raise UserError("--num_proc must be at least 1")
    if args.max_shards < 0:
        raise UserError("--max_shards must be 0 (all) or more")
    for path in args.input or []:
        if not os.path.isfile(path):
            what = "is a directory; pass its files (e.g. DIR/*.txt)" if os.path.isdir(path) else "does not exist"
            raise UserError(f"--input {path} {what}")
        if os.path.splitext(path)[1].lower() not in INPUT_TYPES:
            raise UserError(f"--input {path}: unknown file type; use {', '.join(INPUT_TYPES)}")
        if path.lower().endswith(".parquet"):
            open_parquet(path, args.text_field)
    if args.prefix is None:
        if args.input:
            args.prefix = re.sub(r"[^a-z0-9]", "", os.path.splitext(os.path.basename(args.input[0]))[0].lower()) or "local"
        else:
            args.prefix = "edufineweb"
    # list_shards finds a split by "_val_" / "_train_" in the name: the prefix must not fake one
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.prefix) or "_val_" in args.prefix + "_" or "_train_" in args.prefix + "_":
        raise UserError(f"--prefix {args.prefix!r}: use letters, digits, '.', '-', '_' and no '_val'/'_train' part")


def prepare_output(args):
    """The manifest to continue: the existing one when the arguments match, else a fresh one. Starting
    over (--overwrite, or a manifest with no shard yet) deletes the shards we made before, never
    files we did not make."""
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "manifest.json")
    old = None
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
            old["args"], old["shards"], old["complete"], old["prefix"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            if not args.overwrite:
                raise UserError(f"{path} is unreadable ({brief(e)}); pass --overwrite to start over") from None
            old = {"shards": [], "prefix": args.prefix}
    want = output_args(args)
    if old is not None and old["shards"] and not args.overwrite:
        if old["args"] != want:
            key = next(k for k in sorted(set(old["args"]) | set(want)) if old["args"].get(k) != want.get(k))
            raise UserError(f"{args.output_dir} holds shards made with other arguments ({key} was {json.dumps(old['args'].get(key))[:100]}, "
                            f"now {json.dumps(want.get(key))[:100]}); rerun with the same arguments to resume, "
                            "pass --overwrite to start over, or choose another --output_dir")
        for shard in old["shards"]:
            shard_path = os.path.join(args.output_dir, shard["name"])
            if not os.path.isfile(shard_path) or os.path.getsize(shard_path) != 4 * SHARD_HEADER_INTS + 2 * shard["tokens"]:
                raise UserError(f"{shard_path} is missing or has the wrong size; pass --overwrite to start over")
        if not old["complete"]:  # shards of ours after the last listed one are from a crash: they are redone
            delete_ours(args.output_dir, old["prefix"], keep={s["name"] for s in old["shards"]})
        return old
    if old is not None:
        delete_ours(args.output_dir, old["prefix"], keep=set())
        delete_ours(args.output_dir, args.prefix, keep=set())
    others = list_shards(args.output_dir, "val") + list_shards(args.output_dir, "train")
    if others:
        raise UserError(f"{args.output_dir} already holds shards without a manifest.json of fineweb.py ({os.path.basename(others[0])}, ...); "
                        "train_gpt2.py would read them too: choose another --output_dir or remove them")
    source = hub_name(args) if not args.input else "local files: " + ", ".join(args.input)
    manifest = {"source": source, "tokenizer": "gpt2", "shard_size": args.shard_size, "prefix": args.prefix,
                "args": want, "shards": [], "complete": False}
    save_json(path, manifest)  # before any shard: every shard of ours is then covered by a manifest
    return manifest


def delete_ours(out_dir, prefix, keep):
    ours = re.compile(rf"{re.escape(str(prefix))}_(val|train)_\d{{6}}\.bin(\.tmp)?")
    for name in os.listdir(out_dir):
        if ours.fullmatch(name) and name not in keep:
            os.remove(os.path.join(out_dir, name))


def main(argv=None):
    args = build_parser().parse_args(argv)
    check_args(args)
    try:
        make_shards(args)
    except OSError as e:  # a full disk, an output path that cannot be made: the shards so far are intact
        raise UserError(f"cannot write shards to {args.output_dir} ({brief(e)}); free space or pick another --output_dir "
                        "(rerunning the same command resumes after the last complete shard)") from None


def make_shards(args):
    manifest = prepare_output(args)
    out, shards = args.output_dir, manifest["shards"]
    if manifest["complete"]:
        print(f"{out} is complete: {len(shards)} shards, {manifest['tokens']:,} tokens (manifest.json); nothing to do")
        return
    if args.max_shards and len(shards) >= args.max_shards:
        print(f"{out} already has {len(shards)} shards (--max_shards {args.max_shards}); nothing to do")
        return
    skip, checkpoint = (shards[-1]["end_doc"], shards[-1].get("checkpoint")) if shards else (0, None)
    if shards:
        print(f"resuming after {len(shards)} shards in {out}: skipping {skip:,} documents already done")
    get_tokenizer()  # fail early; forked workers inherit it

    from tqdm import tqdm

    # workers first: fork before this process starts its reader, writer and tqdm threads
    pool = mp.Pool(args.num_proc, initializer=init_worker) if args.num_proc > 1 else None
    cutter = bar = chunks = None
    try:
        if args.input:
            pieces = read_local(args.input, args.text_field, skip)
            total, unit = sum(os.path.getsize(p) for p in args.input), "B"
        else:
            print(f"streaming {hub_name(args)} from the Hugging Face hub")
            pieces = read_hub(load_hub(args), args, skip, checkpoint)
            total, unit = KNOWN_TOKENS.get((args.dataset, args.name)), "tok"
        # disable=None: no bar when stderr is not a terminal (the per-shard lines still show progress)
        bar = tqdm(total=total, unit=unit, unit_scale=True, unit_divisor=1000, desc="tokenizing", dynamic_ncols=True, disable=None)
        cutter = ShardCutter(out, manifest, args.max_shards, log=print if bar.disable else bar.write)
        if unit == "tok":
            bar.update(cutter.written)
        t0, new_tokens = time.time(), 0
        chunks = in_background(make_chunks(pieces), size=2 * args.num_proc)
        for chunk, tokens, starts in tokenized(chunks, pool, window=2 * args.num_proc):
            cutter.add(tokens, starts, chunk.checkpoints)
            new_tokens += len(tokens)
            bar.update(chunk.nbytes if unit == "B" else len(tokens))
            bar.set_postfix_str(f"{cutter.written / 1e6:,.1f}M tokens, shards: {len(shards) + (cutter.pending is not None)}", refresh=False)
            if cutter.stopped:
                break
        else:
            if cutter.written == 0:
                raise UserError("the input holds no documents")
            cutter.finish()
        dt = time.time() - t0
    finally:
        if chunks is not None:
            chunks.close()
        if cutter is not None:
            cutter.close()
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.terminate()
    speed = f"{new_tokens / max(dt, 1e-9) / 1e6:.2f}M tokens/s, {args.num_proc} process{'es' if args.num_proc > 1 else ''}"
    if not manifest["complete"]:
        print(f"stopped after {len(shards)} shards (--max_shards {args.max_shards}; {speed}); run again without it to go on")
        return
    print(f"done: {len(shards)} shards, {manifest['tokens']:,} tokens of {manifest['documents']:,} documents in {out} ({speed})")
    if len(shards) < 2:
        print(f"note: that is only a validation shard; train_gpt2.py needs train shards too: use a smaller --shard_size (now {args.shard_size:,})")


if __name__ == "__main__":
    run_cli(main)
