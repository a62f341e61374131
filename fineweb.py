"""
FineWeb-Edu (or your own text files) -> GPT-2 token shards for train_gpt2.py.

    python fineweb.py                          # HF FineWeb-Edu sample-10BT -> edu_fineweb10B/ (~10B tokens, 100 shards)
    python fineweb.py --input data/austen.txt --output_dir data/tiny --shard_size 1e5  # the README's quick start
    python fineweb.py --input a.jsonl b.parquet --text_field content --output_dir mydata
    python fineweb.py --download kjj0/fineweb10B-gpt2 --output_dir fineweb10B  # ready-made llm.c shards

Each document (a .txt file; a .jsonl line or .parquet row with a `text` field; a row of the streamed hub
dataset) becomes <|endoftext|> and its tiktoken `gpt2` tokens (encode_ordinary). All documents, in input
order, are cut into llm.c .bin shards of exactly --shard_size tokens (the last shorter); shard 0 is
validation. Worker processes tokenize ~256 KB chunks, a few in flight (memory stays flat); a longer
document is cut where GPT-2's pre-tokenizer splits anyway, so its tokens are unchanged.

manifest.json: "source", "tokenizer", "prefix", "args" (what decides the content; for local files their
paths and content hashes), "shards": [{"name", "tokens", "sha256", "end_doc", "end_doc_tokens",
"checkpoint"}], "complete". Shard i ends in document end_doc, end_doc_tokens of whose tokens are in shards
<= i. The same command again resumes after the last complete shard and skips the documents before it (a
hub stream restarts at "checkpoint", its `datasets` state a few documents before end_doc).
"""

import argparse
import codecs
import hashlib
import json
import os
import re
import signal
import sys
import time
from collections import deque
from contextlib import closing, nullcontext
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from common import CLIParser, UserError, atomic_write, brief, run_cli, sha256_file
from train_gpt2 import EOT_TOKEN, SHARD_HEADER_INTS, get_tokenizer, list_shards, read_shard, write_shard

DEFAULT_DATASET, DEFAULT_NAME = "HuggingFaceFW/fineweb-edu", "sample-10BT"
KNOWN_TOKENS = {(DEFAULT_DATASET, DEFAULT_NAME): 9.9e9}  # for the progress bar's ETA
INPUT_TYPES = (".txt", ".jsonl", ".parquet")
CHUNK_CHARS = 1 << 18  # text per work item sent to a worker; also the longest piece a big document is cut into
HUB_CHECKPOINT_DOCS = 64  # remember the hub stream's position every N documents
HASH_BLOCK = 1 << 23  # an input is known by the sha256 of its 8 MiB blocks' sha256s
BATCH_TOKENS = 64 * 1024 + 1  # one batch of train_gpt2.py at its defaults: its loader refuses a smaller shard
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
# After "\S\n" before "\S" or "\n\S", GPT-2's pre-tokenizer cuts anyway: that "\n" is a pre-token of its own
# and none reaches across it (Python's \s is at least as wide as the tokenizer's, so \S is no wider)
SAFE_SPLIT = re.compile(r"(?<=\S\n)(?=\n?\S)")


# -----------------------------------------------------------------------------
# Reading. Each reader yields documents (a str; for a .txt file, an iterator of its pieces) from number
# `skip` on, adds the input bytes it used to progress["bytes"], and returns the part of `skip` left.


def split_document(text):
    """Pieces of at least CHUNK_CHARS (the last may be shorter) whose tokens, concatenated, are the text's."""
    start = 0
    while len(text) - start > 2 * CHUNK_CHARS and (m := SAFE_SPLIT.search(text, start + CHUNK_CHARS, len(text) - CHUNK_CHARS)):
        yield text[start : m.start()]
        start = m.start()
    yield text[start:]


def read_txt(path, progress):
    """The file as one document (UTF-8, kept exactly), read and handed on a piece at a time."""
    decoder, buf, scanned, offset = codecs.getincrementaldecoder("utf-8")(), "", 0, 0
    try:
        with open(path, "rb") as f:
            while raw := f.read(CHUNK_CHARS):
                buf, offset = buf + decoder.decode(raw), offset + len(raw)
                progress["bytes"] += len(raw)
                while len(buf) > 2 * CHUNK_CHARS:  # a big file never sits in memory whole
                    if not (m := SAFE_SPLIT.search(buf, max(CHUNK_CHARS, scanned))):
                        scanned = len(buf)  # no split point yet: not scanned again
                        break
                    yield buf[: m.start()]
                    buf, scanned = buf[m.start() :], 0
        yield buf + decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text (near byte {offset:,}); convert it to UTF-8") from None
    except OSError as e:
        raise UserError(f"cannot read {path} ({brief(e)})") from None


def text_of(value, where, field):
    if isinstance(value, str):
        return value
    what = "no" if value is None else f"a {type(value).__name__} in the"
    raise UserError(f'{where}: {what} "{field}" field (each document needs a string "{field}"; use --text_field to read another)')


def read_jsonl(path, field, skip, progress):
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            progress["bytes"] += len(line)
            if line.strip() and (skip := skip - 1) < 0:  # a blank line is no document; skipped ones are not parsed
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise UserError(f"{path}:{lineno}: not valid JSON ({brief(e)})") from None
                yield text_of(obj.get(field) if isinstance(obj, dict) else None, f"{path}:{lineno}", field)
    return max(skip, 0)


def open_parquet(path, field):
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path}: not a readable parquet file ({brief(e)})") from None
    names = pf.schema_arrow.names
    if field not in names or str(pf.schema_arrow.field(field).type) not in ("string", "large_string", "string_view"):
        raise UserError(f'{path}: no "{field}" column of text (columns: {", ".join(names)}); use --text_field')
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
                skip = yield from (read_jsonl if path.lower().endswith(".jsonl") else read_parquet)(path, field, skip, progress)
            elif skip > 0:  # resuming: this document is in finished shards
                skip, progress["bytes"] = skip - 1, progress["bytes"] + os.path.getsize(path)
            else:
                yield read_txt(path, progress)
        except (OSError, ValueError) as e:  # pyarrow's errors on corrupt data are OSError or ValueError
            raise UserError(f"cannot read {path} ({brief(e)})") from None


def load_hub(args):
    import datasets
    import huggingface_hub

    datasets.logging.set_verbosity_error()  # the hub client logs every retry; our one line says it all
    huggingface_hub.utils.logging.set_verbosity_error()
    try:
        ds = datasets.load_dataset(args.dataset, name=args.name or None, split=args.split, streaming=True)
    except Exception as e:
        raise UserError(f"cannot load {hub_name(args)} from the Hugging Face hub ({brief(e)}); "
                        "check the network and the names, or tokenize local files with --input FILE...") from None
    if ds.column_names is not None and args.text_field not in ds.column_names:
        raise UserError(f'{args.dataset} has no "{args.text_field}" column (columns: {", ".join(ds.column_names)}); use --text_field')
    return ds if ds.column_names is None else ds.select_columns([args.text_field])


def read_hub(ds, args, skip, checkpoint, states):
    """The streamed dataset's documents from number `skip` on; every HUB_CHECKPOINT_DOCS documents its
    position {"doc", "state"} goes into `states`, for the shard that ends there."""
    doc = 0
    if checkpoint:
        try:
            ds.load_state_dict(checkpoint["state"])
            doc = checkpoint["doc"]
        except Exception as e:  # e.g. a state from another datasets version
            print(f"cannot restore the stream position ({brief(e)}); streaming from the start to skip {skip:,} documents")
            ds = load_hub(args)
    it = iter(ds)
    while True:
        if doc >= skip and doc % HUB_CHECKPOINT_DOCS == 0:
            states.append({"doc": doc, "state": ds.state_dict()})
        try:
            example = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise UserError(f"reading {args.dataset} failed at document {doc} ({brief(e)}); run the same command again to resume") from None
        if doc >= skip:
            yield text_of(example.get(args.text_field), f"{args.dataset}: document {doc}", args.text_field)
        doc += 1


# -----------------------------------------------------------------------------
# Tokenizing and cutting shards


def make_chunks(docs):
    """(texts, first) of about CHUNK_CHARS characters; first[i]: texts[i] starts a document."""
    texts, first, size = [], [], 0
    for doc in docs:
        for i, piece in enumerate(split_document(doc) if isinstance(doc, str) else doc):
            texts.append(piece)
            first.append(i == 0)
            if (size := size + len(piece) + 1) >= CHUNK_CHARS:
                yield texts, first
                texts, first, size = [], [], 0
    if texts:
        yield texts, first


def tokenize(texts, first):
    """(tokens, starts): the chunk's tokens as uint16 with <|endoftext|> before each document, and where those are."""
    enc, parts, starts, n = get_tokenizer(), [], [], 0
    for text, is_first in zip(texts, first):
        try:  # encode_to_numpy (tiktoken >= 0.8) makes no Python int per token; special tokens stay text, as in encode_ordinary
            ids = enc.encode_to_numpy(text, disallowed_special=())
        except (AttributeError, UnicodeEncodeError):  # older tiktoken; lone surrogates (JSON escapes), which this repairs
            ids = enc.encode_ordinary(text)
        starts += [n] * is_first
        parts += [np.array([EOT_TOKEN] * is_first, dtype=np.uint32), np.asarray(ids, dtype=np.uint32)]
        n += is_first + len(ids)
    return np.concatenate(parts).astype(np.uint16), np.array(starts, dtype=np.int64)


def init_worker():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    if sys.platform == "linux":  # PR_SET_PDEATHSIG: if the main process is killed, do not linger as orphans
        __import__("ctypes").CDLL(None).prctl(1, signal.SIGTERM)


def tokenized(chunks, pool, window):
    """(tokens, starts) of each chunk in input order, at most `window` chunks in flight."""
    pending = deque()
    for chunk in chunks:
        pending.append(pool.submit(tokenize, *chunk))  # a killed worker breaks the pool: BrokenProcessPool
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def save_json(path, obj):
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=1)


def shard_name(prefix, index):
    return f"{prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


class ShardCutter:
    """Cuts the token stream into shards and keeps the manifest. Positions index the stream of all
    documents' tokens; a resumed stream starts at the document the last shard ended in, and its tokens
    already in shards are dropped. A thread writes, hashes and records each shard in order."""

    def __init__(self, args, manifest, states, log, writer):
        self.args, self.manifest, self.states, self.log, self.writer, self.saved = args, manifest, states, log, writer, None
        last = manifest["shards"][-1] if manifest["shards"] else {"end_doc": 0, "end_doc_tokens": 0}
        self.written = sum(s["tokens"] for s in manifest["shards"])  # tokens in shards and the buffer
        self.pos = self.doc_start = self.written - last["end_doc_tokens"]  # of the next token to come; of the last document
        self.ndocs, self.checkpoint = last["end_doc"], last.get("checkpoint")  # the next document to start; a hub position
        self.index, self.buf, self.fill, self.stopped = len(manifest["shards"]), np.empty(args.shard_size, np.uint16), 0, False

    def add(self, tokens, starts):
        starts, i = self.pos + starts, max(0, self.written - self.pos)
        self.pos += len(tokens)
        while i < len(tokens) and not self.stopped:
            take = min(len(tokens) - i, len(self.buf) - self.fill)
            self.buf[self.fill : self.fill + take] = tokens[i : i + take]
            self.fill, self.written, i = self.fill + take, self.written + take, i + take
            if self.fill == len(self.buf):  # the document of the shard's last token, and where it started
                j = int(np.searchsorted(starts, self.written - 1, side="right")) - 1
                self.flush(*((self.ndocs + j, int(starts[j])) if j >= 0 else (self.ndocs - 1, self.doc_start)))
        self.ndocs, self.doc_start = self.ndocs + len(starts), int(starts[-1]) if len(starts) else self.doc_start

    def flush(self, end_doc, start):
        while self.states and self.states[0]["doc"] <= end_doc:  # the latest hub position at or before end_doc
            self.checkpoint = self.states.popleft()
        entry = {"name": shard_name(self.manifest["prefix"], self.index), "tokens": self.fill, "end_doc": end_doc,
                 "end_doc_tokens": self.written - start, **({"checkpoint": self.checkpoint} if self.checkpoint else {})}
        if self.saved is not None:
            self.saved.result()  # the shard before is on disk and recorded; or its error comes out here
        self.saved = self.writer.submit(self.save, entry, self.buf[: self.fill])
        self.buf, self.fill, self.index = np.empty(len(self.buf), np.uint16), 0, self.index + 1
        self.stopped = 0 < self.args.max_shards <= self.index

    def save(self, entry, tokens):
        entry["sha256"] = write_shard(os.path.join(self.args.output_dir, entry["name"]), tokens)
        self.manifest["shards"].append(entry)
        save_json(os.path.join(self.args.output_dir, "manifest.json"), self.manifest)
        self.log(f"wrote {entry['name']} ({entry['tokens']:,} tokens)")

    def finish(self, complete):
        """The last shard on disk and recorded (or its error out); at the end of the input, the shorter last
        shard too, and the manifest marked complete."""
        if complete and self.fill:
            self.flush(self.ndocs - 1, self.doc_start)
        if self.saved is not None:
            self.saved.result()
        if complete:
            self.manifest.update(complete=True, documents=self.ndocs, tokens=self.written)
            save_json(os.path.join(self.args.output_dir, "manifest.json"), self.manifest)


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


def hub_name(args):
    return f"{args.dataset} {args.name} ({args.split})" if args.name else f"{args.dataset} ({args.split})"


def build_parser():
    p = CLIParser(description="Tokenize FineWeb-Edu (or local .txt/.jsonl/.parquet files) into GPT-2 token shards.")
    p.add_argument("--dataset", default=DEFAULT_DATASET, help="Hugging Face dataset with a text column (streamed)")
    p.add_argument("--name", default=DEFAULT_NAME, help="its configuration ('' for none)")
    p.add_argument("--split", default="train", help="its split")
    p.add_argument("--input", nargs="+", metavar="FILE", help="local files instead of the hub: a .txt is one document, "
                   "a .jsonl line or .parquet row is one document; documents keep this order")
    p.add_argument("--text_field", default="text", help="the field or column holding the text")
    p.add_argument("--download", metavar="REPO_ID", help="instead of tokenizing: fetch the llm.c .bin shards of this hub dataset repo")
    p.add_argument("--output_dir", default="edu_fineweb10B", help="shards and manifest.json go here")
    p.add_argument("--prefix", default=None, help="shard names <prefix>_val_000000.bin, <prefix>_train_000001.bin, ...; "
                   "None: edufineweb for the hub, the first --input file's name (letters and digits) for local files")
    p.add_argument("--shard_size", type=count_arg, default=10**8, help="tokens per shard (1e8 style accepted); shard 0 is validation")
    p.add_argument("--num_proc", type=int, default=CPUS, help=f"tokenizer processes (1 to {4 * CPUS})")
    p.add_argument("--max_shards", type=int, default=0, help="stop after this many shards in the folder (0: all); run again to go on")
    p.add_argument("--overwrite", action="store_true", help="delete shards made with other arguments and start over")
    return p


def check_args(args):
    if not 1 <= args.num_proc <= 4 * CPUS:
        raise UserError(f"--num_proc {args.num_proc}: use 1 to {4 * CPUS} (4x the {CPUS} cores)")
    if args.max_shards < 0:
        raise UserError("--max_shards must be 0 (all) or more")
    if not args.output_dir or (os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir)):
        raise UserError(f"--output_dir {args.output_dir!r} is {'a file' if args.output_dir else 'empty'}; name a folder")
    if args.download == "" or (args.download is None and not args.input and not args.dataset):
        raise UserError(f"--{'dataset' if args.download is None else 'download'} is empty; name a Hugging Face dataset repo")
    if not args.text_field:
        raise UserError("--text_field must not be empty")
    for path in [] if args.download else args.input or []:
        if not os.path.isfile(path):
            raise UserError(f"--input {path!r} {'is a directory; pass its files (DIR/*.txt)' if os.path.isdir(path) else 'does not exist'}")
        if not path.lower().endswith(INPUT_TYPES):
            raise UserError(f"--input {path}: unknown file type; use {', '.join(INPUT_TYPES)}")
        if path.lower().endswith(".parquet"):
            open_parquet(path, args.text_field)
    if args.prefix is None:
        args.prefix = re.sub(r"[^a-z0-9]", "", os.path.splitext(os.path.basename(args.input[0]))[0].lower()) or "local" if args.input else "edufineweb"
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

    with ThreadPoolExecutor(CPUS) as pool:
        return hashlib.sha256(b"".join(pool.map(block, range(max(1, -(-os.path.getsize(path) // HASH_BLOCK)))))).hexdigest()


def output_args(args):
    """What decides the shards' content: a rerun must match these to resume."""
    out = {"shard_size": args.shard_size, "prefix": args.prefix, "text_field": args.text_field}
    if not args.input:
        return dict(out, dataset=args.dataset, name=args.name, split=args.split)
    try:
        return dict(out, inputs=[{"path": os.path.abspath(p), "bytes": os.path.getsize(p), "sha256_of_8MiB_blocks": content_hash(p)} for p in args.input])
    except OSError as e:
        raise UserError(f"cannot read --input {e.filename} ({brief(e)})") from None


def read_manifest(args):
    """The manifest of an earlier run, checked enough to resume from; None if there is none."""
    path = os.path.join(args.output_dir, "manifest.json")
    if not os.path.lexists(path):
        return None
    try:
        with open(path) as f:
            m = json.load(f)
        if not (isinstance(m["args"], dict) and isinstance(m["shards"], list) and isinstance(m["complete"], bool) and isinstance(m["prefix"], str)):
            raise ValueError('"args", "shards", "complete" or "prefix" of the wrong type')
        total = 0
        for i, s in enumerate(m["shards"]):
            if not (s["name"] == shard_name(m["prefix"], i) and isinstance(s["sha256"], str) and type(s.get("checkpoint", {"doc": 0})["doc"]) is int
                    and all(type(s[k]) is int and s[k] >= 0 for k in ("tokens", "end_doc", "end_doc_tokens"))
                    and s["end_doc_tokens"] <= (total := total + s["tokens"])):
                raise ValueError(f"shard entry {i} is not one fineweb.py writes")
        return m
    except (OSError, ValueError, KeyError, TypeError) as e:
        if args.overwrite:
            return {"prefix": args.prefix, "shards": []}
        raise UserError(f"{path} is not a manifest of fineweb.py ({brief(e)}); pass --overwrite to start over, or choose another --output_dir") from None


def check_resume(args, old, want):
    """Nothing if the shards of manifest `old` were made with these arguments and are intact; else a UserError."""
    olds, news = old["args"].get("inputs"), want.get("inputs")
    if old["args"] != want and news and olds != news and isinstance(olds, list) \
            and all(isinstance(o, dict) and "sha256_of_8MiB_blocks" in o for o in olds) and [o["path"] for o in olds] == [n["path"] for n in news]:
        raise UserError(f"--input {next(n['path'] for o, n in zip(olds, news) if o != n)} changed since the shards in {args.output_dir} "
                        "were made from it; pass --overwrite to start over with its new content (or put the old file back to resume)")
    if old["args"] != want:
        key = next(k for k in sorted(set(old["args"]) | set(want)) if old["args"].get(k) != want.get(k))
        raise UserError(f"{args.output_dir} holds shards made with other arguments ({key} was {json.dumps(old['args'].get(key))[:100]}, "
                        f"now {json.dumps(want.get(key))[:100]}); rerun with the same arguments to resume, "
                        "pass --overwrite to start over, or choose another --output_dir")
    for shard in old["shards"]:
        path = os.path.join(args.output_dir, shard["name"])
        if not os.path.isfile(path) or os.path.getsize(path) != 4 * SHARD_HEADER_INTS + 2 * shard["tokens"]:
            raise UserError(f"{path} is missing or has the wrong size; pass --overwrite to start over")


def main(argv=None):
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.download is not None:
        return download(args)
    out, old = args.output_dir, read_manifest(args)
    want = output_args(args)
    resume = bool(old and old["shards"] and not args.overwrite)
    if resume:
        check_resume(args, old, want)
        if old["complete"] or 0 < args.max_shards <= len(old["shards"]):
            return print(f"{out} already has {len(old['shards'])} shards{'' if old['complete'] else ' (--max_shards)'}; nothing to do")
    manifest = old if resume else {"source": "local files: " + ", ".join(args.input) if args.input else hub_name(args), "tokenizer": "gpt2",
                                   "shard_size": args.shard_size, "prefix": args.prefix, "args": want, "shards": [], "complete": False}
    get_tokenizer()  # fail early; forked workers inherit it
    try:  # leaving the with-block ends the workers
        with ProcessPoolExecutor(args.num_proc, initializer=init_worker) if args.num_proc > 1 else nullcontext() as pool:
            if pool is not None:
                pool.submit(int).result()  # fork the workers now, before this process has threads (the hub client's, ours)
            ds = None if args.input else load_hub(args)  # before anything in the folder changes
            os.makedirs(out, exist_ok=True)
            for name in os.listdir(out) if old is not None else ():  # ours from before, or unrecorded ones from a crash
                if re.fullmatch(rf"({re.escape(old['prefix'])}|{re.escape(args.prefix)})_(val|train)_\d{{6}}\.bin(\.tmp)?", name) \
                        and name not in {s["name"] for s in manifest["shards"]}:
                    os.remove(os.path.join(out, name))
            if not resume and (others := list_shards(out, "val") + list_shards(out, "train")):
                raise UserError(f"{out} already holds shards without a manifest.json of fineweb.py ({os.path.basename(others[0])}, ...); "
                                "train_gpt2.py would read them too: choose another --output_dir or remove them")
            save_json(os.path.join(out, "manifest.json"), manifest)  # before any shard: all of ours are in a manifest
            make_shards(args, manifest, ds, pool)
    except OSError as e:  # a full disk, a folder we may not write: the shards so far are intact
        raise UserError(f"cannot write shards to {out} ({brief(e)}); free space or pick another --output_dir "
                        "(rerunning the same command resumes after the last complete shard)") from None
    except BrokenProcessPool:
        raise UserError(f"a tokenizer process died (killed, e.g. by the out-of-memory killer); the {len(manifest['shards'])} shards "
                        "written are kept: run the same command again to resume (with a smaller --num_proc if memory is short)") from None


def make_shards(args, manifest, ds, pool):
    from tqdm import tqdm

    shards, progress, states = manifest["shards"], {"bytes": 0}, deque()
    skip = shards[-1]["end_doc"] if shards else 0
    if shards:
        print(f"resuming after {len(shards)} shards in {args.output_dir}: skipping {skip:,} documents already done")
    if args.input:
        docs, total, unit = read_local(args.input, args.text_field, skip, progress), sum(map(os.path.getsize, args.input)), "B"
    else:
        print(f"streaming {hub_name(args)} from the Hugging Face hub")
        docs = read_hub(ds, args, skip, shards[-1].get("checkpoint") if shards else None, states)
        total, unit = KNOWN_TOKENS.get((args.dataset, args.name)), "tok"
    # disable=None: no bar when stderr is not a terminal (the per-shard lines still show progress). Leaving
    # the with-block: reading stops, and a shard being written is finished and recorded.
    with tqdm(total=total, unit=unit, unit_scale=True, unit_divisor=1000, desc="tokenizing", dynamic_ncols=True, disable=None) as bar, \
            ThreadPoolExecutor(1) as writer, closing(make_chunks(docs)) as chunks:
        cutter = ShardCutter(args, manifest, states, print if bar.disable else bar.write, writer)
        t0, new_tokens = time.time(), 0
        bar.update(cutter.written if unit == "tok" else 0)
        for tokens, starts in tokenized(chunks, pool, 2 * args.num_proc) if pool else (tokenize(*c) for c in chunks):
            cutter.add(tokens, starts)
            new_tokens += len(tokens)
            bar.update(progress["bytes"] - bar.n if unit == "B" else len(tokens))
            if cutter.stopped:
                break
        if cutter.written == 0:
            raise UserError("the input holds no documents")
        cutter.finish(complete=not cutter.stopped)
    speed = f"{new_tokens / max(time.time() - t0, 1e-9) / 1e6:.2f}M tokens/s, {args.num_proc} process{'es' if args.num_proc > 1 else ''}"
    if not manifest["complete"]:
        return print(f"stopped after {len(shards)} shards (--max_shards {args.max_shards}; {speed}); run again without it to go on")
    print(f"done: {len(shards)} shards, {manifest['tokens']:,} tokens of {manifest['documents']:,} documents in {args.output_dir} ({speed})")
    if len(shards) < 2:
        print(f"note: that is only a validation shard; train_gpt2.py needs train shards too: use a smaller --shard_size (now {args.shard_size:,})")
    elif shards[-1]["tokens"] < BATCH_TOKENS < args.shard_size:
        print(f"warning: the last shard {shards[-1]['name']} holds only {shards[-1]['tokens']:,} tokens, fewer than one batch of "
              f"train_gpt2.py at its defaults ({BATCH_TOKENS:,} = 64x1024+1), so a run at those cannot train on it; "
              "a smaller --batch_size x --seq_len can")


def download(args):
    """The *.bin shards at the top of a hub dataset repo (val first, --max_shards of them) into --output_dir,
    sizes checked against the hub's, and a manifest.json for --verify_data. A rerun resumes: huggingface_hub
    skips the files already complete."""
    import huggingface_hub as hub

    hub.utils.logging.set_verbosity_error()  # not a line per retry
    out = args.output_dir
    try:
        sizes = {f.path: f.size for f in hub.HfApi().list_repo_tree(args.download, repo_type="dataset") if f.path.endswith(".bin")}
        names = sorted(sizes, key=lambda n: ("_val_" not in n, n))[: args.max_shards or None]
        if not names:
            raise UserError(f"{args.download} holds no .bin token shards at its top level; name a repo of llm.c shards")
        if others := {os.path.basename(p) for p in list_shards(out, "val") + list_shards(out, "train")} - set(sizes):
            raise UserError(f"{out} holds other shards ({min(others)}, ...) that train_gpt2.py would read too; choose another --output_dir")
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
                raise UserError(f"{path}: {got} bytes where the hub has {size}; delete it and run the same command again")
            shards.append({"name": os.path.basename(path), "tokens": len(read_shard(path)), "sha256": sha256_file(path)})
        manifest = {"source": f"hub: {args.download}", "tokenizer": "gpt2 (as published)", "shards": shards, "complete": True}
        save_json(os.path.join(out, "manifest.json"), dict(manifest, tokens=sum(s["tokens"] for s in shards)))
    except OSError as e:
        raise UserError(f"cannot write {out}/manifest.json ({brief(e)}); free space and run the same command again") from None
    print(f"done: {len(shards)} shards, {sum(s['tokens'] for s in shards):,} tokens of {args.download} in {out}")


if __name__ == "__main__":
    run_cli(main)
