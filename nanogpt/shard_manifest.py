"""
fineweb.py's output folder and its manifest.json: what decides a folder's shards (the arguments and the
inputs' content), the checks a rerun passes to resume, an input that changed while it was read, clearing
what a run leaves behind, the shards' names, and the lock that keeps a second run out of the folder.
Imports no torch.
"""

import json
import os
import re
from collections import Counter
from contextlib import contextmanager

from nanogpt.cli import UserError, brief
from nanogpt.files import atomic_write, clearing_new_folders, content_hash, lock_folder, temporary_of, unlock_folder
from nanogpt.shards import SHARD_HEADER_INTS, list_shards
from nanogpt.text_inputs import DEFAULT_DATASET

# in --output_dir while a run writes it: no shard's name (those hold _val_ or _train_), never in manifest.json
OUTPUT_DIR_LOCK = "fineweb.lock"
REPEATED_INPUT = "its documents would be tokenized twice, and could be in both validation and train; drop one of them"


@contextmanager
def locked_output_dir(out):
    """The output folder, made if need be, held by this run alone while the block runs (files.lock_folder):
    two runs into one folder would each read the manifest, then interleave their shards and manifests. A
    second run is refused in one line before it reads or changes anything there. The folders this run made
    are removed again if it leaves them empty (a refusal)."""
    with clearing_new_folders(out):
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot write shards to {out} ({brief(e)}); pick another --output_dir") from None
        lock = lock_folder(out, OUTPUT_DIR_LOCK, "--output_dir", "another fineweb.py run")
        try:
            yield
        finally:
            unlock_folder(out, OUTPUT_DIR_LOCK, lock)


def says_fineweb_edu(data_dir):
    """Whether data_dir's manifest.json says its shards were tokenized from FineWeb-Edu (fineweb.py from the hub
    dataset HuggingFaceFW/fineweb-edu, any of its samples); False where it names another source (local files, another
    dataset, a --download repo, whose content it does not know), cannot be read, or is not there."""
    try:
        with open(os.path.join(data_dir, "manifest.json")) as f:
            return json.load(f)["args"]["dataset"] == DEFAULT_DATASET
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return False


def save_json(path, obj):
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=1)


def split_of(name):
    return "val" if "_val_" in name else "train"


def shard_name(prefix, split, before):
    """The shard of `split` after `before` of its shards: val shards count from 0, train from 1."""
    return f"{prefix}_{split}_{before + (split == 'train'):06d}.bin"


def output_args(args, txt_cuts):
    """What decides the shards' content: a rerun must match these to resume. txt_cuts: how a .txt is cut into
    units (text_inputs.txt_cuts)."""
    out = {"shard_size": args.shard_size, "prefix": args.prefix, "text_field": args.text_field}
    if args.val_tokens:
        out.update(val_tokens=args.val_tokens, seed=args.seed)
        if any(path.lower().endswith(".txt") for path in args.input or []):
            # how a .txt is cut into units decides which are drawn: a resume under other sizes or rule is refused
            out.update(txt_cuts=txt_cuts)
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


def read_manifest(out, overwrite):
    """The manifest of an earlier run, checked enough to resume from; None if there is none."""
    path = os.path.join(out, "manifest.json")
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
        if overwrite:  # replaced; but no shard there is known to be ours, so none is deleted
            return {"prefix": None, "shards": []}
        raise UserError(f"{path} is not a manifest of fineweb.py ({brief(e)}); choose another --output_dir, "
                        "or pass --overwrite to replace it") from None


def check_resume(out, old, want):
    """Nothing if the shards of manifest `old` were made with these arguments and are intact; else a UserError."""
    if "txt_cuts" not in want:  # older manifests record .txt unit sizes for every --val_tokens run: no .txt, no matter
        old = dict(old, args={k: v for k, v in old["args"].items() if k != "unit_chars"})
    olds, news = old["args"].get("inputs"), want.get("inputs")
    same_files = isinstance(olds, list) and all(isinstance(o, dict) and "sha256_of_8MiB_blocks" in o for o in olds) \
        and [o["path"] for o in olds] == [n["path"] for n in news or []]
    if old["args"] != want and news and olds != news and same_files:
        changed = next(n["path"] for o, n in zip(olds, news) if o != n)
        raise UserError(f"--input {changed} changed since the shards in {out} were made from it; pass "
                        "--overwrite to start over with its new content (or put the old file back to resume)")
    if old["args"] != want:
        key = next(k for k in {**old["args"], **want} if old["args"].get(k) != want.get(k))
        was, now = json.dumps(old["args"].get(key))[:100], json.dumps(want.get(key))[:100]
        raise UserError(f"{out} holds shards made with other arguments ({key} was {was}, now {now}); "
                        "rerun with the same arguments to resume, pass --overwrite to start over, "
                        "or choose another --output_dir")
    for shard in old["shards"]:
        path = os.path.join(out, shard["name"])
        if not os.path.isfile(path) or os.path.getsize(path) != 4 * SHARD_HEADER_INTS + 2 * shard["tokens"]:
            raise UserError(f"{path} is missing or has the wrong size; pass --overwrite to start over")


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
