"""
fineweb.py's inputs as documents: local .txt, .jsonl and .parquet files, and a Hugging Face dataset streamed
from the hub; a long text cut into pieces whose tokens are the whole text's, and an input's size. Imports no torch.
"""

import codecs
import json
import os
import re

from nanogpt.cli import UserError, brief

DEFAULT_DATASET, DEFAULT_NAME = "HuggingFaceFW/fineweb-edu", "sample-10BT"
KNOWN_TOKENS = {(DEFAULT_DATASET, DEFAULT_NAME): 9.9e9}  # for the progress bar's ETA and the rate of --val_tokens N
INPUT_TYPES = (".txt", ".jsonl", ".parquet")
CHUNK_CHARS = 1 << 18  # a long document is cut into pieces of about this many characters to be tokenized
HUB_CHECKPOINT_DOCS = 64  # remember the hub stream's position every N documents
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


def txt_cuts(unit_chars):
    """How a .txt is cut into units of at least unit_chars characters (with --val_tokens): the sizes and rule
    that decide which units are drawn, for the manifest to record."""
    return [unit_chars, CHUNK_CHARS, SAFE_SPLIT.pattern]


def text_bytes(path, field):
    """The file's size; for a .parquet, the uncompressed size of its text column."""
    if not path.lower().endswith(".parquet"):
        return os.path.getsize(path)
    meta = open_parquet(path, field).metadata
    columns = (meta.row_group(g).column(c) for g in range(meta.num_row_groups) for c in range(meta.num_columns))
    return sum(c.total_uncompressed_size for c in columns if c.path_in_schema == field)


# -----------------------------------------------------------------------------
# The hub: a dataset streamed, its position saved for a resume


def hub_name(args):
    return f"{args.dataset} {args.name} ({args.split})" if args.name else f"{args.dataset} ({args.split})"


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
