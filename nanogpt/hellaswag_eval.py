"""
HellaSwag: the validation split downloaded once (or a local .jsonl), its examples read and checked, rendered as
build-nanogpt renders them (or as lm-evaluation-harness does, style "harness"), and scored many examples per
forward pass; evaluate() and the training loop's hellaswag_scorer() over it. hellaswag.py is its command line
(what the numbers mean is said there and in docs/evaluation.md):

    python hellaswag.py --checkpoint log/model_19072.pt
"""

import functools
import json
import os
import re
import sys

import torch

from nanogpt.cli import UserError
from nanogpt.evaluation import (download, from_rank0, in_loop_fix, out_of_memory_said, pad_multiple_of, round_up,
                                score_rows, scoring_context, text_lines)
from nanogpt.shards import ROOT
from nanogpt.tokenizer import get_tokenizer

DATA_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"
DEFAULT_CACHE_DIR = os.path.join(ROOT, "hellaswag")
STYLES = ("nanogpt", "harness")

# -----------------------------------------------------------------------------
# Data


def cached_split(split="val", cache_dir=None):
    """Path of the HellaSwag split's .jsonl, downloaded into cache_dir the first time."""
    cache_dir = cache_dir or DEFAULT_CACHE_DIR
    path = os.path.join(cache_dir, f"hellaswag_{split}.jsonl")
    if not os.path.isfile(path):
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the HellaSwag cache folder {cache_dir} ({e.strerror}); "
                            "pick another with --cache_dir") from None
        download(DATA_URL.format(split=split), path, "pass a local HellaSwag .jsonl "
                 "(hellaswag.py --data FILE, train_gpt2.py --hellaswag_data FILE)")
    return path


def parse_example(line, where):
    """One HellaSwag json line -> dict(ctx, endings, label, ...). `where` is 'file:line' for errors."""
    try:
        ex = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg}); each line must be one HellaSwag example") from None
    if not isinstance(ex, dict):
        raise UserError(f"{where}: expected a JSON object with ctx, endings and label")
    if not isinstance(ex.get("ctx"), str):
        raise UserError(f"{where}: missing field 'ctx' (the context, a string)")
    if not ex["ctx"].strip():  # nothing to condition the endings on: it would score them alone
        raise UserError(f"{where}: 'ctx' is empty; an example needs a context for its endings to follow")
    endings = ex.get("endings")
    if not isinstance(endings, list) or len(endings) != 4 or not all(isinstance(e, str) for e in endings):
        raise UserError(f"{where}: 'endings' must be a list of 4 strings")
    empty = [i + 1 for i, e in enumerate(endings) if not e.strip()]
    if empty:  # no text of its own: nothing to score it by, or to normalise by
        raise UserError(f"{where}: ending {empty[0]} is empty; each of the 4 endings needs text to be scored")
    label = ex.get("label")
    # the HF dataset stores labels as strings; isdecimal, not isdigit, which passes '²' that int() refuses
    if isinstance(label, str) and label.strip().isdecimal():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < 4:
        raise UserError(f"{where}: 'label' must be 0, 1, 2 or 3 (the index of the right ending), "
                        f"found {ex.get('label')!r}")
    out = {"ctx": ex["ctx"], "endings": endings, "label": label, "where": where}
    for key in ("activity_label", "ctx_a", "ctx_b"):  # what --style harness builds its prompt from
        if isinstance(ex.get(key), str):
            out[key] = ex[key]
    return out


def load_examples(path=None, cache_dir=None):
    """HellaSwag examples from a local .jsonl, or (path None) the cached val split, downloaded once."""
    if path is None:
        path = cached_split("val", cache_dir)
    if os.path.isdir(path):
        raise UserError(f"HellaSwag file {path} is a folder; "
                        "give a HellaSwag-format .jsonl (or no file, to download val)")
    if not os.path.exists(path):  # not isfile: a pipe, `--data <(zcat val.jsonl.gz)`, reads as well
        shell = (" (a <(...) of the shell does not reach the processes torchrun starts: save it to a file)"
                 if path.startswith("/dev/fd/") and "RANK" in os.environ else "")
        raise UserError(f"HellaSwag file {path} does not exist{shell}; "
                        "give a HellaSwag-format .jsonl (or no file, to download val)")
    try:
        with open(path, "rb") as f:  # bytes, decoded line by line: an error names the line it is on
            data = f.read()
    except OSError as e:
        raise UserError(f"cannot read HellaSwag file {path} ({e.strerror or e}); "
                        "give a readable HellaSwag-format .jsonl") from None
    examples = [parse_example(line, f"{path}:{lineno}")
                for lineno, line in text_lines(data, path, "give a HellaSwag-format .jsonl in UTF-8")]
    if not examples:
        raise UserError(f"{path} holds no HellaSwag examples")
    return examples


def examples_from_rank0(path, limit, ddp, rank, device, cache_dir=None):
    """load_examples(path)[:limit] on rank 0, shared with the other ranks under torchrun: a pipe can be read
    once, by one process (each rank opening it hung). Rank 0's error ends every rank alike."""
    return from_rank0(lambda: load_examples(path, cache_dir)[:limit], ddp, rank, device)


def examples_for_training(path, limit, rank, world_size, device, asked=True):
    """The examples the training loop scores, or None to leave HellaSwag off. A file the user gave
    must load (an error otherwise). The val split: rank 0 downloads it into the cache first, then
    the others read it; if that fails (offline), HellaSwag is off on every rank alike, or the next
    collective would hang. Said on stderr when the user asked for HellaSwag, in a note otherwise."""
    import torch.distributed as dist

    ddp = world_size > 1 and dist.is_initialized()
    if path:
        return examples_from_rank0(path, limit, ddp, rank, device)
    examples, error = None, None
    loaded = torch.zeros((), dtype=torch.long, device=device)
    for turn in ((0,), tuple(range(1, world_size))):
        if rank in turn:
            try:
                examples = load_examples(None)[:limit]
                loaded += 1
            except (UserError, OSError) as e:
                error = e
        if ddp:
            dist.barrier()
    if ddp:
        dist.all_reduce(loaded, op=dist.ReduceOp.MIN)
    if loaded.item():
        return examples
    if rank == 0:
        if asked:
            print(f"HellaSwag is off for this run: {error}", file=sys.stderr)
        else:
            print("note: HellaSwag is off (its val split is not cached and cannot be downloaded; "
                  "--hellaswag_data FILE gives one)")
    return None


# -----------------------------------------------------------------------------
# Rendering: text -> context tokens and the 4 endings' tokens


def harness_preprocess(text):
    """lm-evaluation-harness's cleanup of HellaSwag text (the brackets come from WikiHow)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def render(example, enc, style="nanogpt"):
    """(context tokens, [ending tokens] * 4, [normaliser] * 4). acc_norm divides an ending's summed
    loss by its normaliser: the token count (nanogpt) or the ending's length in characters (harness)."""
    if style == "nanogpt":  # build-nanogpt: ctx, then " " + ending
        ctx = enc.encode_ordinary(example["ctx"])
        endings = [enc.encode_ordinary(" " + e) for e in example["endings"]]
        norms = [len(e) for e in endings]
    elif style == "harness":
        if not all(k in example for k in ("activity_label", "ctx_a", "ctx_b")):
            raise UserError(f"{example.get('where', 'example')}: "
                            "--style harness needs the fields activity_label, ctx_a and ctx_b")
        query = harness_preprocess(example["activity_label"] + ": " + example["ctx_a"] + " "
                                   + example["ctx_b"].capitalize())
        choices = [harness_preprocess(e) for e in example["endings"]]
        if not all(choices):  # no characters to score or to normalise by: it would win with a loss of 0
            raise UserError(f"{example.get('where', 'example')}: ending {choices.index('') + 1} is empty after "
                            "lm-evaluation-harness's cleanup, so --style harness cannot score it; use --style nanogpt "
                            "or leave the example out")
        # the harness moves trailing spaces of the context onto the continuation, encodes context +
        # continuation as one string and keeps the tokens after the context's; its (transformers') tokenizer reads a
        # literal <|endoftext|> in the text as the special token, and so does this style
        stripped = query.rstrip()
        query, spaces = stripped, query[len(stripped):]
        encode = functools.partial(enc.encode, allowed_special={"<|endoftext|>"})
        ctx = encode(query)
        endings = [encode(query + spaces + " " + c)[len(ctx):] for c in choices]
        norms = [len(c) for c in choices]
    else:
        raise UserError(f"--style {style!r}: expected one of {', '.join(STYLES)}")
    return ctx, endings, norms


# -----------------------------------------------------------------------------
# Scoring


def score(model, rendered, device, batch_size=16, pad_multiple=None, progress=False, n_vocab=None):
    """(summed loss, number of tokens scored) of every ending: two (len(rendered), 4) tensors, in the
    order given.

    rendered: (ctx, endings, norms) tuples from render(). The examples are sorted by length and run
    batch_size at a time (4 rows each), right-padded to a multiple of pad_multiple (nanogpt.evaluation's
    score_rows). A row longer than the model's context keeps its last block_size tokens. n_vocab: score over
    the tokenizer's tokens only (a padded vocabulary's extra logits are left out)."""
    pad_multiple = pad_multiple_of(model, pad_multiple)
    block_size = scoring_context(model, "HellaSwag endings")
    rows = []  # (tokens, number of scored tokens at the end)
    for ctx, endings, _ in rendered:
        for end in endings:
            tokens = (ctx + end)[-block_size:]
            rows.append((tokens, min(len(end), len(tokens) - 1)))
    n = len(rendered)
    length = [max(len(rows[4 * i + j][0]) for j in range(4)) for i in range(n)]
    order = sorted(range(n), key=lambda i: -length[i])  # longest first: an out-of-memory shows at once
    batch_size = max(1, min(batch_size, n))
    sums = torch.zeros(n, 4)
    counts = torch.tensor([k for _, k in rows], dtype=torch.float32).view(n, 4)
    batches = [order[b : b + batch_size] for b in range(0, n, batch_size)]
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="HellaSwag", unit="batch")
    for batch in batches:
        T = min(round_up(length[batch[0]], pad_multiple), block_size)
        # a short last batch is padded with empty rows: one shape for the compiler
        row_sums, _ = score_rows(model, [rows[4 * i + j] for i in batch for j in range(4)], 4 * batch_size, T, device,
                                 n_vocab)
        sums[batch] = row_sums.view(len(batch), 4)
    return sums, counts


def evaluate(model, examples, enc, device, rank=0, world_size=1, batch_size=None, style="nanogpt", progress=False,
             pad_multiple=None):
    """HellaSwag accuracy of model on examples: dict(acc, acc_norm, correct, correct_norm, total).
    Under DDP every rank scores examples[rank::world_size] and gets the summed counts. Call it under
    the autocast you want; the model is put in eval mode and left there."""
    import torch.distributed as dist

    if batch_size is None:
        batch_size = 32 if str(device).startswith("cuda") else 8
    mine = examples[rank::world_size]
    model.eval()
    correct = correct_norm = 0
    if mine:
        rendered = [render(ex, enc, style) for ex in mine]
        sums, counts = score(model, rendered, device, batch_size, pad_multiple, progress, enc.n_vocab)
        # nanogpt: the mean over the tokens scored (fewer than rendered only if a row was cropped)
        norms = counts if style == "nanogpt" else torch.tensor([r[2] for r in rendered], dtype=torch.float32)
        labels = torch.tensor([ex["label"] for ex in mine])
        correct = int((sums.argmin(1) == labels).sum())
        correct_norm = int(((sums / norms).argmin(1) == labels).sum())
    counts = torch.tensor([correct, correct_norm, len(mine)], dtype=torch.long, device=device)
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)  # gloo has no AVG; sums are exact anyway
    correct, correct_norm, total = counts.tolist()
    return {"acc": correct / max(total, 1), "acc_norm": correct_norm / max(total, 1), "correct": correct,
            "correct_norm": correct_norm, "total": total}


def hellaswag_scorer(args, rank, world_size, device, fsdp):
    """The in-loop HellaSwag: a function scoring a model on this rank's share of the examples (under
    --fsdp every rank scores every example: each forward needs all ranks); None when there are none."""
    examples = examples_for_training(args.hellaswag_data, args.hellaswag_limit, rank, world_size, device,
                                     asked="hellaswag_every" in args.explicit)
    if not examples:
        return None
    tokenizer, share_rank, shares = get_tokenizer(), (0 if fsdp else rank), (1 if fsdp else world_size)

    def score(model):
        fix = in_loop_fix("hellaswag_every", "hellaswag.py")
        with out_of_memory_said(device, "HellaSwag in the training loop", fix):
            return evaluate(model, examples, tokenizer, device, rank=share_rank, world_size=shares)
    return score
