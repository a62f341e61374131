"""
CORE, as nanochat computes it: DCLM's eval bundle (a folder, a zip, or downloaded once) read and checked, each
task's prompts rendered as nanochat's templates render them, scored many per forward pass, centered on the
task's random baseline and averaged; scorer_for_training(), the training loop's --core_every. evaluate.py is
its command line (the protocol is said there and in docs/evaluation.md):

    python evaluate.py --checkpoint log/
"""

import csv
import io
import json
import math
import os
import random
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from nanogpt.cli import INT_MAX, UserError
from nanogpt.evaluation import (download, from_rank0, in_loop_fix, out_of_memory_said, pad_multiple_of, round_up,
                                score_rows, scoring_context, text_lines)
from nanogpt.shards import ROOT
from nanogpt.tokenizer import get_tokenizer

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
DEFAULT_BUNDLE = os.path.join(ROOT, "eval_bundle", "eval_bundle.zip")
GET_A_BUNDLE = "give a local copy of DCLM's eval bundle, a folder or .zip (evaluate.py --eval_bundle, " \
               "train_gpt2.py --core_bundle)"
TASKS_FILE, BASELINES_FILE, DATA_FOLDER = "core.yaml", "eval_meta_data.csv", "eval_data"
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
FIELDS = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
          "language_modeling": ("context", "continuation")}
SHUFFLE_SEED = 1337  # each task's examples, shuffled once: --max_per_task keeps the same first N everywhere
FEWSHOT_SEED = 1234  # example i's few-shot examples are drawn with random.Random(FEWSHOT_SEED + i)
RENDER_CHUNK = 256  # examples tokenized at a time: a 10-shot task's prompts, all at once, are gigabytes of ints
MAX_FILE_MB = 256  # a bundle's file is read whole: DCLM's largest is a few tens of MB; a zip bomb is refused unread


# -----------------------------------------------------------------------------
# The bundle: core.yaml, eval_meta_data.csv, eval_data/*.jsonl, in a folder or a zip


class Bundle:
    """DCLM's eval bundle, a folder or a .zip: the files named as core.yaml names them, read as bytes.
    The folder may hold the files or the zip's eval_bundle/ folder; the zip either."""

    def __init__(self, path):
        self.path = path
        if os.path.isdir(path):
            inner = os.path.join(path, "eval_bundle")
            self.root = inner if not os.path.isfile(os.path.join(path, TASKS_FILE)) and os.path.isdir(inner) else path
            if not os.path.isfile(os.path.join(self.root, TASKS_FILE)):
                raise UserError(f"eval bundle {path} holds no {TASKS_FILE} (nor eval_bundle/{TASKS_FILE}); {GET_A_BUNDLE}")
            self.members = None
            return
        if not os.path.exists(path):
            raise UserError(f"eval bundle {path} does not exist; {GET_A_BUNDLE}")
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            raise UserError(f"eval bundle {path} is neither a folder nor a readable .zip ({e}); {GET_A_BUNDLE}") from None
        tops = sorted((n for n in names if n == TASKS_FILE or n.endswith("/" + TASKS_FILE)), key=len)
        if not tops:
            raise UserError(f"eval bundle {path} holds no {TASKS_FILE}; {GET_A_BUNDLE}")
        self.root, self.members = tops[0][: -len(TASKS_FILE)], set(names)

    def where(self, name):
        """The name a file of the bundle goes by in messages."""
        if self.members is None:
            return os.path.join(self.root, name)
        return f"{self.path}/{self.root}{name}"

    def read(self, name, role):
        """The bytes of the bundle's file `name`; role says what it is, for the message when it is missing."""
        try:
            if self.members is None:
                with open(os.path.join(self.root, name), "rb") as f:
                    self.check_size(name, os.fstat(f.fileno()).st_size)
                    return f.read()
            if self.root + name not in self.members:
                raise FileNotFoundError
            with zipfile.ZipFile(self.path) as z:
                # the size the zip declares; zipfile stops reading there (a member that inflates further fails its CRC)
                self.check_size(name, z.getinfo(self.root + name).file_size)
                return z.read(self.root + name)
        except FileNotFoundError:
            raise UserError(f"{self.where(name)} does not exist ({role}); the eval bundle is incomplete: "
                            f"{GET_A_BUNDLE}") from None
        except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as e:  # a damaged member: its CRC, its deflate data
            raise UserError(f"cannot read {self.where(name)} ({e}); {GET_A_BUNDLE}") from None

    def check_size(self, name, size):
        if size > MAX_FILE_MB << 20:
            raise UserError(f"{self.where(name)} is {size:,} bytes (uncompressed); a file of the eval bundle may be at "
                            f"most {MAX_FILE_MB} MiB (DCLM's largest is a few tens of MB), so it is not read; {GET_A_BUNDLE}")

    def text(self, name, role):
        data = self.read(name, role)
        try:
            return data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise UserError(f"{self.where(name)}:{line}: not UTF-8 text; {GET_A_BUNDLE}") from None


def bundle_path(path):
    """The bundle to read: path, or (None) eval_bundle/eval_bundle.zip in the repository, downloaded the
    first time."""
    if path is not None:
        return path
    if not os.path.isfile(DEFAULT_BUNDLE):
        folder = os.path.dirname(DEFAULT_BUNDLE)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create {folder} for the eval bundle ({e.strerror}); {GET_A_BUNDLE}") from None
        download(BUNDLE_URL, DEFAULT_BUNDLE, GET_A_BUNDLE)
    return DEFAULT_BUNDLE


@dataclass
class Task:
    """One of core.yaml's tasks with its examples (shuffled, and cut to --max_per_task)."""
    label: str
    kind: str  # icl_task_type: multiple_choice, schema or language_modeling
    shots: int  # few-shot examples before each example
    delimiter: str  # continuation_delimiter: between a context and its continuation
    source: str  # the examples' file, as messages name it
    baseline: float = 0.0  # the random baseline, in percent
    examples: list = field(default_factory=list)


def yaml_tasks(bundle):
    """core.yaml's icl_tasks as (entry, its line) pairs; anything but a list of mappings there is one line."""
    import yaml

    where = bundle.where(TASKS_FILE)
    loader = yaml.SafeLoader(bundle.text(TASKS_FILE, "the list of tasks"))
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{where}{line}: not valid YAML ({getattr(e, 'problem', None) or e}); {GET_A_BUNDLE}") from None
    finally:
        loader.dispose()
    entries = data.get("icl_tasks") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: expected a list 'icl_tasks' of tasks (label, icl_task_type, dataset_uri, "
                        f"num_fewshot); {GET_A_BUNDLE}")
    nodes = next(value for key, value in root.value if key.value == "icl_tasks").value
    return [(entry, node.start_mark.line + 1) for entry, node in zip(entries, nodes)]


def parse_task(entry, where):
    """A Task (without its examples) from one entry of core.yaml's icl_tasks; where is 'core.yaml:line'."""
    if not isinstance(entry, dict):
        raise UserError(f"{where}: each task of icl_tasks must be a mapping (label, icl_task_type, dataset_uri, "
                        "num_fewshot)")
    label = entry.get("label")
    if not isinstance(label, str) or not label:
        raise UserError(f"{where}: a task without a 'label' (its name)")
    kind = entry.get("icl_task_type")
    if kind not in TASK_TYPES:
        raise UserError(f"{where}: task '{label}' has icl_task_type {kind!r}; CORE scores {', '.join(TASK_TYPES)}")
    uri = entry.get("dataset_uri")
    if not isinstance(uri, str) or not uri:
        raise UserError(f"{where}: task '{label}' has no 'dataset_uri' (its file in {DATA_FOLDER}/)")
    if os.path.isabs(uri) or ".." in uri.replace("\\", "/").split("/"):  # a bundle names only its own files
        raise UserError(f"{where}: task '{label}' has dataset_uri {uri!r}, which points outside the bundle's "
                        f"{DATA_FOLDER}/ (an absolute path or ..); give a path inside {DATA_FOLDER}/")
    shots = entry.get("num_fewshot", 0)
    if isinstance(shots, list) and shots:  # DCLM's yaml lists them, [10]; the first is the one scored, as in nanochat
        shots = shots[0]
    if isinstance(shots, bool) or not isinstance(shots, int) or not 0 <= shots <= INT_MAX:
        raise UserError(f"{where}: task '{label}' has num_fewshot {entry.get('num_fewshot')!r}; "
                        "give a whole number >= 0, or a list of one")
    delimiter = entry.get("continuation_delimiter", " ")
    if not isinstance(delimiter, str):
        raise UserError(f"{where}: task '{label}' has continuation_delimiter {delimiter!r}; give a string")
    return Task(label, kind, shots, delimiter, f"{DATA_FOLDER}/{uri}")


def text_of(value, where, name):
    """A text field of an example; numbers count as the text they print as (as nanochat's templates print them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise UserError(f"{where}: '{name}' must be a string, found {value!r}")


def parse_example(kind, line, where):
    """One line of a task's .jsonl -> the fields of its task type; where is 'file:line'."""
    try:
        ex = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg}); each line must be one example") from None
    names = FIELDS[kind]
    if not isinstance(ex, dict) or not all(name in ex for name in names):
        raise UserError(f"{where}: a {kind} example is a JSON object with {', '.join(names)}")
    out = {}
    for name in names:
        if name in ("choices", "context_options"):
            if not isinstance(ex[name], list) or not ex[name]:
                raise UserError(f"{where}: '{name}' must be a list of strings")
            out[name] = [text_of(v, where, name) for v in ex[name]]
            if len(out[name]) < 2:  # one option is always the pick
                raise UserError(f"{where}: '{name}' holds one option; an example offers two or more to choose from")
            empty = [i for i, v in enumerate(out[name]) if not v.strip()]
            if empty:  # no text of its own to score (or, all empty, nothing that tells them apart)
                raise UserError(f"{where}: {name}[{empty[0]}] is empty; each option needs text to be scored")
        elif name == "gold":
            options = out["choices" if kind == "multiple_choice" else "context_options"]
            gold = ex["gold"]
            if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(options):
                raise UserError(f"{where}: 'gold' {gold!r} is not an index of the {len(options)} "
                                f"{'choices' if kind == 'multiple_choice' else 'context_options'} (0 to {len(options) - 1}); "
                                "it says which one is right")
            out["gold"] = gold
        else:
            out[name] = text_of(ex[name], where, name)
    if "continuation" in out and not out["continuation"].strip():
        raise UserError(f"{where}: 'continuation' is empty; there is nothing to predict")
    for name in ("query", "context"):  # what the answer is predicted from
        if name in out and not out[name].strip():
            raise UserError(f"{where}: '{name}' is empty; an example needs one for its answer to follow")
    return out


def random_baselines(bundle, labels):
    """{label: random baseline in percent} from eval_meta_data.csv, for these labels."""
    where = bundle.where(BASELINES_FILE)
    reader = csv.DictReader(io.StringIO(bundle.text(BASELINES_FILE, "the tasks' random baselines"), newline=""))
    if not {"Eval Task", "Random baseline"} <= set(reader.fieldnames or ()):
        raise UserError(f"{where}:1: needs the columns 'Eval Task' and 'Random baseline'; {GET_A_BUNDLE}")
    found = {}
    for row in reader:
        label = row["Eval Task"]
        if label in labels:
            try:
                found[label] = float(row["Random baseline"])
            except (TypeError, ValueError):
                found[label] = math.nan
            if not 0 <= found[label] < 100:
                raise UserError(f"{where}:{reader.line_num}: task '{label}' has random baseline "
                                f"{row['Random baseline']!r}; give a percentage from 0 to below 100")
    missing = [label for label in labels if label not in found]
    if missing:
        raise UserError(f"{where} has no row for task '{missing[0]}' (its random baseline); {GET_A_BUNDLE}")
    return found


def load_tasks(path=None, labels=None, max_per_task=None):
    """The tasks of the bundle at path (None: the downloaded one), each with its examples shuffled and cut to
    max_per_task; labels: only these, in core.yaml's order. Anything malformed is one line naming file and line."""
    bundle = Bundle(bundle_path(path))
    tasks, lines = [], {}
    for entry, line in yaml_tasks(bundle):
        task = parse_task(entry, f"{bundle.where(TASKS_FILE)}:{line}")
        if task.label in lines:
            raise UserError(f"{bundle.where(TASKS_FILE)}:{line}: task '{task.label}' is listed twice (first on line "
                            f"{lines[task.label]})")
        lines[task.label] = line
        tasks.append(task)
    if labels is not None:
        unknown = [label for label in labels if label not in lines]
        if unknown:
            raise UserError(f"--tasks: no task '{unknown[0]}' in {bundle.where(TASKS_FILE)}; its tasks are "
                            f"{', '.join(lines)}")
        tasks = [task for task in tasks if task.label in labels]
    baselines = random_baselines(bundle, [task.label for task in tasks])
    for task in tasks:
        task.baseline = baselines[task.label]
        data = bundle.read(task.source, f"the examples of task '{task.label}', {TASKS_FILE} line {lines[task.label]}")
        task.source = bundle.where(task.source)
        task.examples = [parse_example(task.kind, text, f"{task.source}:{lineno}")
                         for lineno, text in text_lines(data, task.source, GET_A_BUNDLE)]
        if not task.examples:
            raise UserError(f"{task.source} has no examples (task '{task.label}'): it is empty or blank; "
                            f"{GET_A_BUNDLE}")
        random.Random(SHUFFLE_SEED).shuffle(task.examples)
        kept = task.examples[:max_per_task]
        if len(kept) <= task.shots:
            cut = f"--max_per_task {max_per_task} keeps {len(kept)}" if len(kept) < len(task.examples) else \
                f"{task.source} holds {len(kept)}"
            raise UserError(f"task '{task.label}' is {task.shots}-shot, and {cut} example(s): too few to draw "
                            f"{task.shots} others for each; " + (f"give --max_per_task {task.shots + 1} or more"
                                                                 if len(kept) < len(task.examples) else GET_A_BUNDLE))
        task.examples = kept
        warn_same_options(task)
    return tasks


def warn_same_options(task):
    """One line on stderr when some of a task's examples offer one text to choose from: nanochat scores them
    (the first option is the pick, right when gold is 0), so they are scored, and said."""
    name = {"multiple_choice": "choices", "schema": "context_options"}.get(task.kind)
    n = sum(len(set(ex[name])) == 1 for ex in task.examples) if name else 0
    if n:
        print(f"warning: task '{task.label}': {n} of its {len(task.examples)} examples have {name} all the same text "
              f"({task.source}); nothing tells them apart, and they are scored as nanochat scores them (the first is "
              "the pick)", file=sys.stderr)


# -----------------------------------------------------------------------------
# Rendering: an example -> its prompts' tokens, and how many of each one's last tokens are scored


def fewshot_indices(i, n, shots):
    """The indices of example i's few-shot examples among n: random.Random(FEWSHOT_SEED + i).sample of the
    other n - 1, drawn as nanochat draws them. sample() picks positions in what it is given, so drawing
    positions in range(n - 1) and stepping over i gives the same examples without a list of n."""
    if not shots:
        return []
    return [j + (j >= i) for j in random.Random(FEWSHOT_SEED + i).sample(range(n - 1), shots)]


def prompts(task, i):
    """The texts of example i's rows, as nanochat's templates render them: the few-shot blocks, each ending in
    a blank line, then the example; a prompt per choice (multiple choice) or per context option (schema); for
    language modelling two, the context alone (stripped) and with its continuation."""
    d, ex = task.delimiter, task.examples[i]
    shots = [task.examples[j] for j in fewshot_indices(i, len(task.examples), task.shots)]
    if task.kind == "multiple_choice":
        head = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{ex['query']}{d}{choice}" for choice in ex["choices"]]
    if task.kind == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{d}{s['continuation']}\n\n" for s in shots)
        return [f"{head}{option}{d}{ex['continuation']}" for option in ex["context_options"]]
    head = "".join(f"{s['context'].strip()}{d}{s['continuation']}\n\n" for s in shots)
    context = f"{head}{ex['context'].strip()}{d}"
    return [context.strip(), context + ex["continuation"]]


def shared_length(sequences):
    """How many leading items all the sequences share."""
    n = min(len(s) for s in sequences)
    return next((i for i in range(n) if any(s[i] != sequences[0][i] for s in sequences)), n)


def scored_rows(kind, token_lists):
    """(tokens, k) for each row of an example: its tokens and how many of the last ones are its answer's.
    Multiple choice: the tokens after the prefix all choices share; schema: the tokens all context options
    share at the end (the continuation); language modelling: one row, the whole prompt, scored after the
    tokens it shares with the context alone (all of them, unless tokenizing the continuation merged its first
    characters into the context's last token)."""
    if kind == "multiple_choice":
        start = shared_length(token_lists)
        return [(t, len(t) - start) for t in token_lists]
    if kind == "schema":
        k = shared_length([t[::-1] for t in token_lists])
        return [(t, k) for t in token_lists]
    context, whole = token_lists
    return [(whole, len(whole) - shared_length([context, whole]))]


def render_examples(task, enc, indices):
    """[(rows, gold)] of task's examples at indices: rows as scored_rows gives them, each tokens an int32 array
    (a quarter of a list's memory) starting with <|endoftext|>. Text is tokenized as text, as fineweb.py does."""
    texts = [prompts(task, i) for i in indices]
    tokens = iter(enc.encode_ordinary_batch([p for ps in texts for p in ps]))
    out = []
    for i, ps in zip(indices, texts):
        rows = scored_rows(task.kind, [[enc.eot_token, *next(tokens)] for _ in ps])
        out.append(([(np.asarray(t, dtype=np.int32), k) for t, k in rows], task.examples[i].get("gold")))
    return out


# -----------------------------------------------------------------------------
# Scoring


def score_examples(model, kind, rendered, device, batch_size, pad_multiple, block_size, n_vocab):
    """Whether each rendered example is answered right. Its rows, cut from the left to the context, are
    scored longest first, batch_size per forward pass (nanogpt.evaluation's score_rows)."""
    rows, first = [], []  # every row, cropped; each example's first row
    for example_rows, _ in rendered:
        first.append(len(rows))
        for tokens, k in example_rows:
            tokens = tokens[-block_size:]
            rows.append((tokens, min(k, len(tokens) - 1)))
    order = sorted(range(len(rows)), key=lambda r: -len(rows[r][0]))  # longest first: an out-of-memory shows at once
    sums, greedy = [0.0] * len(rows), [False] * len(rows)
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        T = min(round_up(len(rows[batch[0]][0]), pad_multiple), block_size)
        R = batch_size if pad_multiple > 1 else len(batch)  # compiled: a short batch padded, one shape
        batch_sums, batch_greedy = score_rows(model, [rows[r] for r in batch], R, T, device, n_vocab)
        for r, s, g in zip(batch, batch_sums.tolist(), batch_greedy.tolist()):
            sums[r], greedy[r] = s, g
    right = []
    for (example_rows, gold), start in zip(rendered, first):
        if kind == "language_modeling":
            right.append(greedy[start])
            continue
        if all(np.array_equal(tokens, example_rows[0][0]) for tokens, _ in example_rows):
            right.append(gold == 0)  # one text: nanochat's means tie exactly, batched rows' may differ in the last bit
            continue
        # nanochat's pick: the first lowest mean (a choice with no tokens of its own has none: nan)
        means = [sums[start + j] / rows[start + j][1] if rows[start + j][1] else math.nan
                 for j in range(len(example_rows))]
        right.append(min(range(len(means)), key=means.__getitem__) == gold)
    return right


def evaluate(model, tasks, enc, device, rank=0, world_size=1, batch_size=None, progress=False, pad_multiple=None,
             rendered=None):
    """CORE of model on tasks: {"core": the mean centered accuracy, "tasks": {label: {accuracy, centered, shots,
    correct, total, seconds}}}. Under DDP every rank scores examples[rank::world_size] of each task and gets
    the summed counts (seconds: rank 0's). rendered: this rank's examples of each task, rendered once
    (render_examples), or None to render them here a chunk at a time. Call it under the autocast you want;
    the model is put in eval mode and left there."""
    import torch.distributed as dist
    from tqdm import tqdm

    if batch_size is None:
        batch_size = 32 if str(device).startswith("cuda") else 8
    block_size = scoring_context(model, "CORE's continuations")
    pad_multiple = pad_multiple_of(model, pad_multiple)
    model.eval()
    counts = torch.zeros(len(tasks), 2, dtype=torch.long, device=device)
    seconds = []
    bar = tqdm(total=sum(len(range(rank, len(t.examples), world_size)) for t in tasks), desc="CORE", unit="example",
               disable=not progress)
    for n, task in enumerate(tasks):
        t0 = time.time()
        bar.set_postfix_str(task.label)
        mine = range(rank, len(task.examples), world_size)
        chunks = [rendered[n]] if rendered is not None else (
            render_examples(task, enc, mine[c : c + RENDER_CHUNK]) for c in range(0, len(mine), RENDER_CHUNK))
        for chunk in chunks:
            right = score_examples(model, task.kind, chunk, device, batch_size, pad_multiple, block_size, enc.n_vocab)
            counts[n, 0] += sum(right)
            counts[n, 1] += len(right)
            bar.update(len(right))
        seconds.append(time.time() - t0)
    bar.close()
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)  # gloo has no AVG; sums are exact anyway
    results = {}
    for task, (correct, total), took in zip(tasks, counts.tolist(), seconds):
        accuracy, chance = correct / max(total, 1), task.baseline / 100
        results[task.label] = {"accuracy": accuracy, "centered": (accuracy - chance) / (1 - chance), "shots": task.shots,
                               "correct": correct, "total": total, "seconds": took}
    core = sum(r["centered"] for r in results.values()) / max(len(results), 1)
    return {"core": core, "tasks": results}


def scorer_for_training(bundle, max_per_task, ddp, rank, world_size, device, fsdp):
    """The training loop's CORE: a function scoring a model on this rank's share of the tasks (under --fsdp
    every rank scores every example: each forward needs all ranks). The bundle is read (and downloaded, the
    first time) by rank 0 and handed to the others, so a malformed one is refused before the run starts;
    the prompts are tokenized once, here."""
    tasks = from_rank0(lambda: load_tasks(bundle, None, max_per_task), ddp, rank, device)
    enc = get_tokenizer()
    share_rank, shares = (0, 1) if fsdp else (rank, world_size)
    rendered = [render_examples(task, enc, range(share_rank, len(task.examples), shares)) for task in tasks]

    def score(model):
        with out_of_memory_said(device, "CORE in the training loop", in_loop_fix("core_every", "evaluate.py")):
            return evaluate(model, tasks, enc, device, share_rank, shares, rendered=rendered)
    return score
