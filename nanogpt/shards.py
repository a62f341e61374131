"""
The token shard format (llm.c's .bin: a header of 256 int32, then the tokens as uint16; build-nanogpt's
.npy read too), the data folder's shard lists, and the check of a folder against fineweb.py's
manifest.json. Imports no torch.
"""

import hashlib
import json
import os
import sys

import numpy as np

from nanogpt.cli import UserError, brief
from nanogpt.files import atomic_write, sha256_file
from nanogpt.tokenizer import EOT_TOKEN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
SHARD_MAGIC = 20240520

SHARD_VERSION = 1

SHARD_HEADER_INTS = 256  # header: 256 int32 = 1024 bytes, then the tokens as uint16

def check_not_shrunk(path, mapped):
    """A UserError if the shard at path is the file mapped (os.stat_result when it was read) truncated in place:
    reading a map past its file's new end kills the process with SIGBUS, without a word or a checkpoint. A file
    deleted or replaced by another is fine: the map keeps the old one."""
    try:
        now = os.stat(path)
    except OSError:
        return
    if (now.st_dev, now.st_ino) == (mapped.st_dev, mapped.st_ino) and now.st_size < mapped.st_size:
        raise UserError(f"{path} shrank while the run read it ({now.st_size:,} of its {mapped.st_size:,} bytes left); "
                        "put the whole shard back (fineweb.py makes it again), then --resume")


def write_shard(path, tokens):
    """Write tokens (ints < 65536) as a .bin shard: to a temporary name, fsync, then rename,
    so a crash never leaves a partial shard under the final name. Returns the file's sha256."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError("shard tokens must fit in uint16")
    header = np.zeros(SHARD_HEADER_INTS, dtype=np.int32)
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    digest = hashlib.sha256()
    with atomic_write(path) as f:
        for part in (header.tobytes(), tokens.astype(np.uint16, copy=False).tobytes()):
            f.write(part)
            digest.update(part)
    return digest.hexdigest()

def read_shard(path):
    """The tokens of a .bin (llm.c) or .npy (build-nanogpt) shard as a read-only uint16 memmap.
    A short, foreign or corrupt file raises UserError naming it."""
    if path.endswith(".npy"):
        try:
            tokens = np.load(path, mmap_mode="r")
        except Exception as e:
            raise UserError(f"{path}: not a readable .npy shard ({type(e).__name__}); re-run fineweb.py") from None
        if tokens.ndim != 1 or tokens.dtype != np.uint16:
            raise UserError(f"{path}: a .npy shard must hold a 1-D uint16 array, found {tokens.dtype} {tokens.shape}; "
                            "re-run fineweb.py")
        return tokens
    if not os.path.lexists(path):
        raise UserError(f"{path}: the shard is gone (deleted or moved since the run found it); put it back, or "
                        "make it again with fineweb.py, then --resume")
    if not os.path.isfile(path):
        raise UserError(f"{path}: not a file (a folder, or a link to nothing); remove it from the data folder")
    size = os.path.getsize(path)
    header_bytes = SHARD_HEADER_INTS * 4
    if size < header_bytes:
        raise UserError(f"{path}: {size} bytes is shorter than a shard header; "
                        "the file is truncated, re-run fineweb.py")
    try:
        header = np.fromfile(path, dtype=np.int32, count=SHARD_HEADER_INTS)
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e}); check its permissions") from None
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise UserError(f"{path}: not a token shard (magic {header[0]}, version {header[1]}; "
                        f"expected {SHARD_MAGIC}, {SHARD_VERSION}); remove it from the data folder, "
                        "or re-run fineweb.py")
    ntok = int(header[2])
    if size != header_bytes + 2 * ntok:
        raise UserError(f"{path}: header says {ntok} tokens but the file holds {(size - header_bytes) // 2}; "
                        "the shard is truncated or corrupt, re-run fineweb.py")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=header_bytes, shape=(ntok,))

def list_shards(data_dir, split):
    """Shard files of a split ('train' or 'val') in data_dir, in order: names like *_<split>_000001.bin."""
    if not os.path.isdir(data_dir):
        return []
    names = sorted(n for n in os.listdir(data_dir) if f"_{split}_" in n and n.endswith((".bin", ".npy")))
    return [os.path.join(data_dir, n) for n in names]

def verify_shards(data_dir):
    """Compare each shard named in data_dir/manifest.json with its recorded sha256."""
    path = os.path.join(data_dir, "manifest.json")
    if not os.path.isfile(path):
        raise UserError(f"--verify_data: no manifest.json in {data_dir}; shards written by fineweb.py have one")
    try:
        with open(path) as f:
            shards = json.load(f)["shards"]
        entries = [(os.path.join(data_dir, os.path.basename(s["name"])), s["sha256"]) for s in shards]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--verify_data: {path} is not a manifest of fineweb.py ({brief(e)})") from None
    listed = {os.path.abspath(p) for p, _ in entries}
    for shard_path in list_shards(data_dir, "val") + list_shards(data_dir, "train"):
        if os.path.abspath(shard_path) not in listed:  # the loader would read it, unchecked
            raise UserError(f"--verify_data: {shard_path} is not listed in manifest.json; "
                            "remove it from the data folder, or re-run fineweb.py")
    for shard_path, sha256 in entries:
        if not os.path.isfile(shard_path):
            raise UserError(f"--verify_data: {shard_path} is listed in manifest.json but missing")
        if sha256_file(shard_path) != sha256:
            raise UserError(f"--verify_data: {shard_path} does not match its sha256 in manifest.json; "
                            "re-run fineweb.py")


SHIPPED_TEXT = os.path.join(ROOT, "data", "austen.txt")  # public-domain English text that comes with the repository
SHIPPED_TEXT_SHARDS = os.path.join(ROOT, "data", "tiny")  # its shards: README's quick start makes the same


def laptop_data_dir(args, say):
    """Where a fresh `--model tiny` run with no --data_dir finds its data when the default folder does not
    exist: the shards of the text the repository ships (made on first use)."""
    if args.model != "tiny" or "data_dir" in args.explicit or os.path.exists(args.data_dir):
        return args.data_dir
    say(f"note: no {args.data_dir}/ here: --model tiny trains on {os.path.relpath(SHIPPED_TEXT)}'s shards in "
        f"{os.path.relpath(SHIPPED_TEXT_SHARDS)}/ (give --data_dir for your own, made by fineweb.py)")
    return SHIPPED_TEXT_SHARDS


def shard_shipped_text(data_dir, say):
    """Make the shipped text's shards with fineweb.py, as the README's quick start does (a few seconds)."""
    import subprocess

    say(f"making {data_dir}/ from {SHIPPED_TEXT} with fineweb.py")
    command = [sys.executable, os.path.join(ROOT, "fineweb.py"), "--input", SHIPPED_TEXT, "--output_dir", data_dir,
               "--shard_size", "1e5"]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"cannot make {data_dir} from {SHIPPED_TEXT} ({last}); run `python fineweb.py --input "
                        f"{SHIPPED_TEXT} --output_dir {data_dir} --shard_size 1e5` to see why")


# The shuffled loader's order (train_gpt2.ShuffledDataLoader)


def document_starts(tokens, chunk=1 << 24):
    """Where a shard's documents start: at each <|endoftext|>, and at 0 (tokens before the first
    <|endoftext|> are a document too; a shard without one is one document). Read in chunks, so a
    100M-token shard never becomes one big temporary array."""
    found = [np.flatnonzero(np.asarray(tokens[i : i + chunk]) == EOT_TOKEN) + i for i in range(0, len(tokens), chunk)]
    starts = np.unique(np.concatenate([np.zeros(1, dtype=np.int64), *[f.astype(np.int64) for f in found]]))
    return starts.astype(np.uint32) if len(tokens) < 2**32 else starts  # kept per shard: 4 bytes a document


def shuffle_rng(seed, epoch, *keys):
    """The generator of one epoch's order. keys tell the shard order ((0,)) from a shard's document
    order ((1, shard)); seeds of different lengths never collide, as trailing zeros would."""
    return np.random.default_rng([seed, epoch, *keys])
