"""evaluate.py: CORE per task equals an independent reference written here (nanochat's protocol with Jinja
templates and transformers' logits), on a small bundle of DCLM's layout made here; the bundle read from a
folder, a zip and a download; a malformed bundle is one line naming file and line; --core_every in the
training loop, resumed, and under torchrun."""

import csv
import json
import os
import random
import re
import shutil
import stat
import zipfile

import jinja2
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import evaluate
import train_gpt2
from nanogpt import core_eval
from nanogpt.tokenizer import EOT_TOKEN, get_tokenizer
from conftest import (TINY_FLAGS, assert_cli_error, assert_one_line_error, assert_refused_before_any_work,
                      descriptor_link, fifo_with_reader, make_shards, numbers_logged, read_log, run_script,
                      safe_char_device, save_random_hf_gpt2, script_cli)

# one worker under -n 2 (conftest.py): the module's fixtures are made once
pytestmark = pytest.mark.xdist_group("test_core_eval")

WORDS = ("the a man woman dog child people is are was then he she they it with on in into over of to and "
         "slowly quickly holds puts takes runs walks jumps throws water ball rope bike table kitchen field "
         "camera paint wall floor knife bowl red blue green 42 7 , . ?").split()

# label, icl_task_type, num_fewshot as core.yaml gives it, continuation_delimiter (None: left out, " "),
# random baseline (%), examples, file under eval_data/
TASKS = [
    ("copa_like", "multiple_choice", 0, None, 50, 16, "commonsense/copa_like.jsonl"),
    ("arc_like", "multiple_choice", [3], "\nAnswer: ", 25, 14, "world_knowledge/arc_like.jsonl"),
    ("winograd_like", "schema", [2], " ", 50, 12, "language_understanding/winograd_like.jsonl"),
    ("lambada_like", "language_modeling", [0], " ", 0, 15, "language_understanding/lambada_like.jsonl"),
    ("squad_like", "language_modeling", [2], "\nAnswer: ", 0, 15, "reading/squad_like.jsonl"),
]
MARGIN = 1e-4  # every decision of the reference (float64) clears this: float32 rounding (~1e-6 here) cannot flip it

# -----------------------------------------------------------------------------
# The reference: nanochat's protocol written out again, with Jinja templates and transformers' forward

MC = ("{% for s in shots %}{{ s.query }}{{ d }}{{ s.choices[s.gold] }}\n\n{% endfor %}"
      "{{ ex.query }}{{ d }}{{ option }}")
SCHEMA = ("{% for s in shots %}{{ s.context_options[s.gold] }}{{ d }}{{ s.continuation }}\n\n{% endfor %}"
          "{{ option }}{{ d }}{{ ex.continuation }}")
LM = ("{% for s in shots %}{{ s.context | trim }}{{ d }}{{ s.continuation }}\n\n{% endfor %}"
      "{{ ex.context | trim }}{{ d }}{% if whole %}{{ ex.continuation }}{% endif %}")


def ref_shuffled(examples, max_per_task=None):
    data = list(examples)
    random.Random(1337).shuffle(data)
    return data[:max_per_task] if max_per_task else data


def ref_prompts(kind, d, data, i, shots):
    """The prompts of data[i], its few-shot examples drawn as nanochat draws them."""
    chosen = []
    if shots:
        chosen = [data[j] for j in random.Random(1234 + i).sample([j for j in range(len(data)) if j != i], shots)]
    env = jinja2.Environment()
    ex = data[i]
    if kind == "multiple_choice":
        return [env.from_string(MC).render(shots=chosen, d=d, ex=ex, option=c) for c in ex["choices"]]
    if kind == "schema":
        return [env.from_string(SCHEMA).render(shots=chosen, d=d, ex=ex, option=o) for o in ex["context_options"]]
    t = env.from_string(LM)
    return [t.render(shots=chosen, d=d, ex=ex, whole=False).strip(), t.render(shots=chosen, d=d, ex=ex, whole=True)]


def common_prefix(seqs):
    n = 0
    while n < min(map(len, seqs)) and len({s[n] for s in seqs}) == 1:
        n += 1
    return n


def ref_rows(kind, prompts):
    """[(tokens, start, end)]: the tokens from start to end are the ones scored, as nanochat sets them."""
    enc = get_tokenizer()
    toks = [[EOT_TOKEN] + enc.encode_ordinary(p) for p in prompts]
    if kind == "multiple_choice":
        start = common_prefix(toks)
        return [(t, start, len(t)) for t in toks]
    if kind == "schema":
        k = common_prefix([t[::-1] for t in toks])
        return [(t, len(t) - k, len(t)) for t in toks]
    without, whole = toks
    assert whole[: len(without)] == without  # the test's data keeps to where nanochat runs
    return [(whole, len(without), len(whole))]


def head_logits(model, tokens, positions):
    """transformers' logits (float64) at these positions of tokens."""
    with torch.no_grad():
        hidden = model.transformer(torch.tensor([tokens])).last_hidden_state[0]
        return model.lm_head(hidden[positions])


def ref_task(model, kind, d, shots, data, block_size=None):
    """[(right, margin, cropped)] per example of data (already shuffled and cut)."""
    out = []
    for i in range(len(data)):
        means, greedy, margin, cropped = [], [], float("inf"), False
        for tokens, s, e in ref_rows(kind, ref_prompts(kind, d, data, i, shots)):
            if block_size and len(tokens) > block_size:
                c = len(tokens) - block_size
                tokens, s, e, cropped = tokens[c:], s - c, e - c, True
                assert s >= 1
            logits = head_logits(model, tokens, slice(s - 1, e - 1))
            target = torch.tensor(tokens[s:e])
            means.append(F.cross_entropy(logits, target).item())
            top2 = logits.topk(2, dim=-1).values
            margin = min(margin, (top2[:, 0] - top2[:, 1]).min().item())
            greedy.append(bool((logits.argmax(-1) == target).all()))
        if kind == "language_modeling":
            out.append((greedy[0], margin, cropped))
        else:
            ranked = sorted(means)
            out.append((means.index(ranked[0]) == data[i]["gold"], ranked[1] - ranked[0], cropped))
    return out


def ref_results(model, examples, max_per_task=None, block_size=None, labels=None):
    """{label: [(right, margin, cropped)]} of the reference, asserting every decision clears MARGIN."""
    out = {}
    for label, kind, shots, d, _, _, _ in TASKS:
        if labels and label not in labels:
            continue
        shots = shots[0] if isinstance(shots, list) else shots
        out[label] = ref_task(model, kind, " " if d is None else d, shots, ref_shuffled(examples[label], max_per_task),
                              block_size)
        assert all(m > MARGIN for _, m, _ in out[label]), (label, min(m for _, m, _ in out[label]))
    return out


def ref_counts(model, examples, **kw):
    """{label: (correct, total)} of the reference."""
    return {label: (sum(r for r, _, _ in rows), len(rows)) for label, rows in ref_results(model, examples, **kw).items()}


# -----------------------------------------------------------------------------
# The bundle the tests read


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_random_hf_gpt2(str(tmp_path_factory.mktemp("hf") / "tiny-gpt2"))


@pytest.fixture(scope="module")
def hf64(hf_dir):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(hf_dir).double().eval()


def words(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def greedy_words(model, prompt, n):
    """The model's n greedy next tokens after prompt, as text, if each is a space and letters; else None."""
    enc = get_tokenizer()
    tokens = [EOT_TOKEN] + enc.encode_ordinary(prompt)
    out = []
    for _ in range(n):
        nxt = head_logits(model, tokens, slice(-1, None))[0].argmax().item()
        text = enc.decode([nxt])
        if not re.fullmatch(r" [A-Za-z]+", text):
            return None
        out.append(text)
        tokens.append(nxt)
    return out


def lm_examples(model, rng, n, shots, d):
    """Language-modelling examples, a third of them continued as the model continues them greedily (right),
    a third with the first word the model's and the second not (wrong at the second token: every token
    counts), a third random. Made in the order they are shuffled to, the few-shot examples of each drawn as
    the protocol draws them; a later one can change an earlier one's prompt, and the reference decides."""
    examples = [{"context": words(rng, 3, 12) + rng.choice(["", " ", "  "]), "continuation": words(rng, 1, 2)}
                for _ in range(n)]
    order = list(range(n))
    random.Random(1337).shuffle(order)  # position p of the shuffled task holds examples[order[p]]
    for p in range(n):
        ex = examples[order[p]]
        if p % 3 == 2:
            continue
        for _ in range(200):  # a context the model continues with two words
            shuffled = [examples[q] for q in order]
            prompt = ref_prompts("language_modeling", d, shuffled, p, shots)[0]
            found = greedy_words(model, prompt, 2)
            if found:
                break
            ex["context"] = words(rng, 3, 12)
        assert found
        second = found[1] if p % 3 == 0 else next(w for w in (" " + w for w in WORDS) if w != found[1] and w.strip().isalpha())
        ex["continuation"] = found[0][1:] + second
    return examples


def make_examples(model, seed=0):
    """{label: examples} of TASKS, in file order."""
    rng = random.Random(seed)
    out = {}
    for label, kind, shots, d, _, n, _ in TASKS:
        shots, d = (shots[0] if isinstance(shots, list) else shots), " " if d is None else d
        if kind == "multiple_choice":  # some choices share their first word: the shared tokens are not scored
            out[label] = []
            for i in range(n):
                first = words(rng, 1, 1)
                choices = [(first + " " if i % 2 else "") + words(rng, 1, 3) for _ in range(2 + i % 3)]
                out[label].append({"query": words(rng, 3, 8) + "?", "choices": choices, "gold": rng.randrange(len(choices))})
        elif kind == "schema":  # the options share their last word too: it is scored with the continuation
            out[label] = [{"context_options": [f"{words(rng, 2, 5)} said" for _ in range(2)],
                           "continuation": words(rng, 2, 6) + ".", "gold": rng.randrange(2)} for _ in range(n)]
        else:
            out[label] = lm_examples(model, rng, n, shots, d)
    return out


def write_bundle(folder, examples):
    """DCLM's layout: core.yaml, eval_meta_data.csv (a quoted description with commas, a task CORE does not
    score), eval_data/<dataset_uri>. Returns folder."""
    lines = ["icl_tasks:"]
    for label, kind, shots, d, _, _, uri in TASKS:
        lines += [f"- label: {label}", f"  dataset_uri: {uri}", f"  num_fewshot: {json.dumps(shots)}",
                  f"  icl_task_type: {kind}"]
        if d is not None:
            lines.append(f"  continuation_delimiter: {json.dumps(d)}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "core.yaml"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(folder, "eval_meta_data.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Eval Task", "Task Category", "Random baseline", "Description"])
        w.writerow(["unscored", "x", "", "not in core.yaml"])
        for label, _, _, _, baseline, _, _ in TASKS:
            w.writerow([label, "reasoning", baseline, f"{label}: a test task, made of random words, for CORE"])
    for label, _, _, _, _, _, uri in TASKS:
        path = os.path.join(folder, "eval_data", uri)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.writelines(json.dumps(ex) + "\n" for ex in examples[label])
    return folder


@pytest.fixture(scope="module")
def examples(hf64):
    return make_examples(hf64)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, examples):
    return write_bundle(str(tmp_path_factory.mktemp("core") / "eval_bundle"), examples)


@pytest.fixture(scope="module")
def ref(hf64, examples):
    return ref_counts(hf64, examples)


def centered(counts):
    baselines = {label: b for label, _, _, _, b, _, _ in TASKS}
    return {label: (c / n - baselines[label] / 100) / (1 - baselines[label] / 100) for label, (c, n) in counts.items()}


def counts_of(result):
    return {label: (r["correct"], r["total"]) for label, r in result["tasks"].items()}


# -----------------------------------------------------------------------------
# Against the reference


def test_the_data_can_tell_right_from_wrong(ref):
    """Every task type, few-shot counts above 0, and in every task answers right and wrong: a rule flipped
    or broken changes some count."""
    assert {kind for _, kind, _, _, _, _, _ in TASKS} == set(core_eval.TASK_TYPES)
    assert any(shots not in (0, [0]) for _, kind, shots, _, _, _, _ in TASKS if kind == "multiple_choice")
    assert any(shots not in (0, [0]) for _, kind, shots, _, _, _, _ in TASKS if kind == "language_modeling")
    for label, (correct, total) in ref.items():
        assert 0 < correct < total, (label, correct, total)


def test_accuracies_match_the_reference(hf_dir, bundle, ref, tmp_path, capsys):
    out = tmp_path / "core.json"
    code, stdout, err = script_cli(capsys, evaluate.main, "--init_from", hf_dir, "--eval_bundle", bundle, "--device", "cpu",
                                   "--json", out)
    assert code == 0, err
    written = json.loads(out.read_text())
    assert os.listdir(tmp_path) == ["core.json"]  # written through a temporary twin, nothing left beside it
    want = centered(ref)
    assert set(written) == {"core", "tasks"} and list(written["tasks"]) == [t[0] for t in TASKS]
    for label, _, shots, _, _, _, _ in TASKS:
        c, n = ref[label]
        assert written["tasks"][label] == {"accuracy": c / n, "centered": pytest.approx(want[label], abs=1e-12),
                                           "shots": shots[0] if isinstance(shots, list) else shots}
        row = re.search(rf"^{label} +(\d+) +([\d.]+) +(-?[\d.]+) +[\d.]+$", stdout, re.M)
        assert row and float(row.group(2)) == round(c / n, 4), stdout
    core = sum(want.values()) / len(want)
    assert written["core"] == pytest.approx(core, abs=1e-12)
    assert re.search(rf"^CORE +{re.escape(f'{core:.4f}')}$", stdout, re.M), stdout


def test_batched_one_at_a_time_and_padded_vocab_agree(hf_dir, bundle, ref):
    """Any batch size and padding gives the reference's counts; a 50304-row vocabulary (ours) scores over the
    50257 real tokens, its padded rows' huge logits never counted nor predicted."""
    tasks, enc = core_eval.load_tasks(bundle), get_tokenizer()
    model = train_gpt2.load_model(init_from=hf_dir)
    for batch_size, pad in ((1, 1), (5, 32), (64, 1)):
        assert counts_of(core_eval.evaluate(model, tasks, enc, "cpu", batch_size=batch_size, pad_multiple=pad)) == ref
    cfg = model.config
    padded = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=cfg.block_size, vocab_size=50304, n_layer=cfg.n_layer,
                                                 n_head=cfg.n_head, n_embd=cfg.n_embd))
    state = model.state_dict()
    for k in ("transformer.wte.weight", "lm_head.weight"):
        state[k] = torch.cat([state[k], 5.0 * torch.randn(50304 - 50257, cfg.n_embd)])
    padded.load_state_dict(state)
    assert counts_of(core_eval.evaluate(padded.eval(), tasks, enc, "cpu")) == ref


def test_rows_longer_than_the_context_are_cut_from_the_left(hf_dir, hf64, bundle, examples):
    model = train_gpt2.load_model(init_from=hf_dir)
    model.config.block_size = 24  # wpe has 128 rows; the first 24 are the same model's
    results = ref_results(hf64, examples, block_size=24)
    assert all(any(cropped for _, _, cropped in results[label]) for label in ("arc_like", "winograd_like", "squad_like"))
    want = {label: (sum(r for r, _, _ in rows), len(rows)) for label, rows in results.items()}
    assert want != ref_counts(hf64, examples)  # the cut changes answers: cutting elsewhere would show
    assert counts_of(core_eval.evaluate(model, core_eval.load_tasks(bundle), get_tokenizer(), "cpu")) == want


def test_max_per_task_keeps_the_first_of_the_shuffled_examples(hf_dir, hf64, bundle, examples, capsys):
    labels = ["arc_like", "squad_like"]
    tasks = core_eval.load_tasks(bundle, labels, 7)
    assert [t.examples for t in tasks] == [ref_shuffled(examples[label], 7) for label in labels]
    result = evaluate.main(["--init_from", hf_dir, "--eval_bundle", bundle, "--device", "cpu", "--tasks", ",".join(labels),
                            "--max_per_task", "7"])
    assert list(result["tasks"]) == labels  # core.yaml's order
    assert counts_of(result) == ref_counts(hf64, examples, max_per_task=7, labels=labels)
    # a 3-shot task cut to 3 examples cannot draw 3 others for each
    assert_cli_error(script_cli(capsys, evaluate.main, "--init_from", hf_dir, "--eval_bundle", bundle, "--device", "cpu",
                                "--max_per_task", "3"), "task 'arc_like' is 3-shot", "--max_per_task 4")


def test_a_zip_and_the_download_read_as_the_folder(bundle, tmp_path, monkeypatch):
    """The published zip holds an eval_bundle/ folder; one of the files at its root reads too. The default
    bundle is downloaded once (a file:// URL here) and kept; offline, one line and no file left behind."""
    want = core_eval.load_tasks(bundle)
    published = str(tmp_path / "eval_bundle.zip")
    shutil.make_archive(published[:-4], "zip", os.path.dirname(bundle), "eval_bundle")
    flat = str(tmp_path / "flat.zip")
    shutil.make_archive(flat[:-4], "zip", bundle)
    assert "eval_bundle/core.yaml" in zipfile.ZipFile(published).namelist()
    for path in (published, flat, os.path.dirname(bundle)):  # a folder holding the unzipped eval_bundle/ too
        assert [(t.label, t.examples, t.baseline) for t in core_eval.load_tasks(path)] == \
               [(t.label, t.examples, t.baseline) for t in want]
    damaged = tmp_path / "damaged.zip"  # a byte changed inside a task's compressed examples: its CRC fails
    data = bytearray(open(published, "rb").read())
    at = data.index(b"squad_like.jsonl") + 200
    data[at] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(core_eval.UserError, match=re.escape(f"cannot read {damaged}/eval_bundle/eval_data/")):
        core_eval.load_tasks(str(damaged))
    cache = tmp_path / "cache" / "eval_bundle.zip"
    monkeypatch.setattr(core_eval, "DEFAULT_BUNDLE", str(cache))
    monkeypatch.setattr(core_eval, "BUNDLE_URL", "http://127.0.0.1:9/eval_bundle.zip")
    with pytest.raises(core_eval.UserError, match="cannot download http://127.0.0.1:9/eval_bundle.zip .*--eval_bundle"):
        core_eval.load_tasks()
    assert os.listdir(cache.parent) == []
    monkeypatch.setattr(core_eval, "BUNDLE_URL", (tmp_path / "eval_bundle.zip").as_uri())
    assert [t.examples for t in core_eval.load_tasks()] == [t.examples for t in want]
    assert cache.read_bytes() == open(published, "rb").read()
    os.remove(published)  # read from the cache from now on
    assert [t.examples for t in core_eval.load_tasks()] == [t.examples for t in want]


# -----------------------------------------------------------------------------
# A malformed bundle: one line, naming the file and the line


def file_line(path, lineno):
    return re.escape(f"{path}:{lineno}: ")


def task_file(bundle, label):
    return os.path.join(bundle, "eval_data", next(t[6] for t in TASKS if t[0] == label))


def replace_line(path, lineno, text):
    with open(path) as f:
        lines = f.read().splitlines()
    lines[lineno - 1] = text
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def break_bundle(how, bundle):
    """Break a copy of the bundle one way: (the error's pattern)."""
    yaml, csv_file = os.path.join(bundle, "core.yaml"), os.path.join(bundle, "eval_meta_data.csv")
    if how == "no core.yaml":
        os.remove(yaml)
        return re.escape(f"eval bundle {bundle} holds no core.yaml")
    if how == "task file missing":
        os.remove(task_file(bundle, "winograd_like"))
        return re.escape(f"{task_file(bundle, 'winograd_like')} does not exist (the examples of task 'winograd_like', "
                         "core.yaml line 11)")
    if how == "bad JSON":
        replace_line(task_file(bundle, "arc_like"), 3, '{"query": "x", "choices": ["a", "b"], "gold": 0')
        return file_line(task_file(bundle, "arc_like"), 3) + "not valid JSON"
    if how == "gold out of range":
        replace_line(task_file(bundle, "copa_like"), 2, json.dumps({"query": "x", "choices": ["a", "b"], "gold": 2}))
        return file_line(task_file(bundle, "copa_like"), 2) + re.escape("'gold' 2 is not an index of the 2 choices (0 to 1)")
    if how == "gold not a number":
        replace_line(task_file(bundle, "winograd_like"), 5,
                     json.dumps({"context_options": ["a", "b"], "continuation": "c", "gold": "1"}))
        return file_line(task_file(bundle, "winograd_like"), 5) + re.escape("'gold' '1' is not an index of the 2 context_options")
    if how == "field missing":
        replace_line(task_file(bundle, "lambada_like"), 4, json.dumps({"context": "x"}))
        return file_line(task_file(bundle, "lambada_like"), 4) + "a language_modeling example is a JSON object with"
    if how == "empty continuation":
        replace_line(task_file(bundle, "lambada_like"), 1, json.dumps({"context": "x", "continuation": ""}))
        return file_line(task_file(bundle, "lambada_like"), 1) + "'continuation' is empty"
    unscorable = {  # what cannot be scored: (task, line, the line, the error)
        "one choice": ("arc_like", 2, {"query": "x", "choices": ["a"], "gold": 0}, "'choices' holds one option"),
        "an empty choice": ("arc_like", 3, {"query": "x", "choices": ["a", ""], "gold": 0}, "choices[1] is empty"),
        "every choice empty": ("copa_like", 1, {"query": "x", "choices": ["", " "], "gold": 1}, "choices[0] is empty"),
        "an empty query": ("copa_like", 2, {"query": " ", "choices": ["a", "b"], "gold": 1}, "'query' is empty"),
        "one context option": ("winograd_like", 1, {"context_options": ["a"], "continuation": "c", "gold": 0},
                               "'context_options' holds one option"),
        "an empty context option": ("winograd_like", 2, {"context_options": ["", "b"], "continuation": "c", "gold": 0},
                                    "context_options[0] is empty"),
        "an empty schema continuation": ("winograd_like", 3, {"context_options": ["a", "b"], "continuation": "",
                                                              "gold": 0}, "'continuation' is empty"),
        "an empty context": ("squad_like", 1, {"context": "", "continuation": "c"}, "'context' is empty"),
    }
    if how in unscorable:
        task, line, example, error = unscorable[how]
        replace_line(task_file(bundle, task), line, json.dumps(example))
        return file_line(task_file(bundle, task), line) + re.escape(error)
    if how == "unknown task type":
        replace_line(yaml, 9, "  icl_task_type: generation_task_with_answers")
        return file_line(yaml, 6) + "task 'arc_like' has icl_task_type 'generation_task_with_answers'"
    if how == "not YAML":
        replace_line(yaml, 3, "  dataset_uri: [unclosed")
        return file_line(yaml, 4) + "not valid YAML"
    if how == "no baseline row":
        with open(csv_file) as f:
            rows = [r for r in f if not r.startswith("squad_like,")]
        with open(csv_file, "w") as f:
            f.writelines(rows)
        return re.escape(f"{csv_file} has no row for task 'squad_like'")
    if how == "baseline not a number":
        replace_line(csv_file, 4, "arc_like,x,lots,desc")
        return file_line(csv_file, 4) + "task 'arc_like' has random baseline 'lots'"
    raise AssertionError(how)


BREAKS = ["no core.yaml", "task file missing", "bad JSON", "gold out of range", "gold not a number", "field missing",
          "empty continuation", "unknown task type", "not YAML", "no baseline row", "baseline not a number",
          "one choice", "an empty choice", "every choice empty", "an empty query", "one context option",
          "an empty context option", "an empty schema continuation", "an empty context"]


@pytest.mark.parametrize("how", BREAKS)
def test_a_malformed_bundle_is_one_line_naming_file_and_line(bundle, tmp_path, how):
    broken = shutil.copytree(bundle, tmp_path / "eval_bundle")
    pattern = break_bundle(how, str(broken))
    with pytest.raises(core_eval.UserError, match=pattern) as e:
        core_eval.load_tasks(str(broken))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_bad_input_through_the_command_line(hf_dir, bundle, tmp_path, capsys):
    broken = str(shutil.copytree(bundle, tmp_path / "eval_bundle"))
    break_bundle("gold out of range", broken)
    out = tmp_path / "mine.json"
    out.write_text("mine")
    result = run_script(["evaluate.py", "--init_from", hf_dir, "--eval_bundle", broken, "--device", "cpu", "--json", str(out)])
    assert_one_line_error(result, "copa_like.jsonl:2: 'gold' 2 is not an index")
    assert result.returncode == 2 and out.read_text() == "mine"
    for argv, needle in [
        (["--tasks", "copa_like,nope"], "--tasks: no task 'nope'"),
        (["--tasks", "copa_like,"], "--tasks"),
        (["--max_per_task", "0"], "--max_per_task 0"),
        (["--batch_size", "-1"], "--batch_size -1"),
        (["--json", str(tmp_path)], "is a folder"),
        (["--json", str(tmp_path / "no" / "x.json")], "does not exist"),
        (["--eval_bundle", str(tmp_path / "missing")], "does not exist"),
        (["--eval_bundle", str(out)], "neither a folder nor a readable .zip"),
        (["--eval_bundle", ""], "--eval_bundle is empty"),
    ]:
        assert_cli_error(script_cli(capsys, evaluate.main, "--init_from", hf_dir, "--eval_bundle", bundle, "--device", "cpu",
                                    *argv), needle)
    assert out.read_text() == "mine"


def score_into(hf_dir, bundle, capsys, tmp_path, path):
    """evaluate.py --json path on one small task; the JSON a plain file gets, for comparison."""
    plain = tmp_path / "plain" / "core.json"
    plain.parent.mkdir()
    for out in (plain, path):
        code, _, err = script_cli(capsys, evaluate.main, "--init_from", hf_dir, "--eval_bundle", bundle, "--device",
                                  "cpu", "--tasks", "copa_like", "--max_per_task", "4", "--json", out)
        assert code == 0, err
    with open(plain) as f:
        want = f.read()
    assert json.loads(want)["tasks"]["copa_like"]["shots"] == 0
    return want


def test_json_through_a_link_writes_its_target_and_keeps_the_link(hf_dir, bundle, tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "core.json").write_text("old")
    os.symlink(os.path.join("runs", "core.json"), tmp_path / "latest.json")
    want = score_into(hf_dir, bundle, capsys, tmp_path, str(tmp_path / "latest.json"))
    assert os.readlink(tmp_path / "latest.json") == os.path.join("runs", "core.json")
    assert (tmp_path / "runs" / "core.json").read_text() == want and os.listdir(tmp_path / "runs") == ["core.json"]


def test_json_into_a_fifo_reaches_its_reader(hf_dir, bundle, tmp_path, capsys):
    reader, got = fifo_with_reader(str(tmp_path / "fifo.json"))
    want = score_into(hf_dir, bundle, capsys, tmp_path, str(tmp_path / "fifo.json"))
    reader.join(timeout=60)
    assert not reader.is_alive() and got == [want.encode()]
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo.json").st_mode)


def test_json_into_a_character_device_leaves_the_device(hf_dir, bundle, tmp_path, capsys):
    device = safe_char_device(tmp_path)
    rdev = os.stat(device).st_rdev
    score_into(hf_dir, bundle, capsys, tmp_path, device)
    assert stat.S_ISCHR(os.lstat(device).st_mode) and os.lstat(device).st_rdev == rdev


def test_json_into_a_descriptor_follows_what_was_printed(hf_dir, bundle, tmp_path, capsys):
    """A link to /proc/self/fd/N, as /dev/stdout is, of a file a shell redirected to: the JSON follows what was
    printed, and what is printed next follows the JSON."""
    with open(tmp_path / "out.txt", "w") as f:
        f.write("printed before\n")
        f.flush()
        want = score_into(hf_dir, bundle, capsys, tmp_path, descriptor_link(tmp_path, f))
        f.write("printed after\n")
    assert (tmp_path / "out.txt").read_text() == "printed before\n" + want + "printed after\n"


def test_a_json_path_that_cannot_be_written_is_refused_before_scoring(hf_dir, bundle, tmp_path, capsys, monkeypatch):
    """Refused in one line, nothing scored: a folder, a missing folder, a place no file can be made in (/proc)."""
    scored = []
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: scored.append(1))
    for path, needle in [(tmp_path, "is a folder"), (tmp_path / "no" / "x.json", "does not exist"),
                         ("/proc/core.json", "cannot create a file in /proc")]:
        assert_cli_error(script_cli(capsys, evaluate.main, "--init_from", hf_dir, "--eval_bundle", bundle, "--device",
                                    "cpu", "--json", path), f"--json {path}", needle)
    assert scored == [] and os.listdir(tmp_path) == []


# -----------------------------------------------------------------------------
# A hostile bundle: paths out of it, huge files, empty tasks, choices that are all one text


def plain_examples(rng):
    """{label: examples} of TASKS that parse, made without a model (their answers are not known)."""
    out = {}
    for label, kind, _, _, _, n, _ in TASKS:
        if kind == "multiple_choice":
            out[label] = [{"query": words(rng, 3, 8) + "?", "choices": [f"{words(rng, 1, 3)} {k}" for k in range(3)],
                           "gold": rng.randrange(3)} for _ in range(n)]
        elif kind == "schema":
            out[label] = [{"context_options": [f"{words(rng, 2, 5)} {k}" for k in range(2)],
                           "continuation": words(rng, 2, 6), "gold": rng.randrange(2)} for _ in range(n)]
        else:
            out[label] = [{"context": words(rng, 3, 12), "continuation": words(rng, 1, 2)} for _ in range(n)]
    return out


@pytest.mark.parametrize("where", ["up", "absolute"])
def test_a_dataset_uri_outside_the_bundle_is_refused(tmp_path, where):
    """A task file outside the bundle's eval_data/ is never read, even where it exists and would parse."""
    examples = plain_examples(random.Random(1))
    bundle = write_bundle(str(tmp_path / "eval_bundle"), examples)
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text("".join(json.dumps(ex) + "\n" for ex in examples["copa_like"]))
    uri = "../../elsewhere.jsonl" if where == "up" else str(outside)
    assert os.path.isfile(os.path.join(bundle, "eval_data", uri))  # where it would lead
    replace_line(os.path.join(bundle, "core.yaml"), 3, f"  dataset_uri: {uri}")
    with pytest.raises(core_eval.UserError, match=file_line(os.path.join(bundle, "core.yaml"), 2) + re.escape(
            f"task 'copa_like' has dataset_uri '{uri}', which points outside the bundle's eval_data/")) as e:
        core_eval.load_tasks(bundle)
    assert "\n" not in str(e.value)


def declare_size(path, member, size):
    """The zip at path, its member's uncompressed size as declared (local header and central directory) set to size."""
    data = bytearray(open(path, "rb").read())
    name = member.encode()
    local, central = data.index(name), data.rindex(name)
    assert data[local - 30 : local - 26] == b"PK\x03\x04" and data[central - 46 : central - 42] == b"PK\x01\x02"
    data[local - 30 + 22 : local - 30 + 26] = size.to_bytes(4, "little")
    data[central - 46 + 24 : central - 46 + 28] = size.to_bytes(4, "little")
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("form", ["zip", "folder"])
def test_a_file_that_inflates_to_a_gibibyte_is_refused_unread(tmp_path, form):
    """The size a zip declares (or a file's size) is checked before anything is read: 1 GiB is refused in one line
    naming the file and the bound (a sparse file here, a size written into the zip's headers there)."""
    bundle = write_bundle(str(tmp_path / "eval_bundle"), plain_examples(random.Random(2)))
    gib, member = 1 << 30, "eval_bundle/eval_data/reading/squad_like.jsonl"
    if form == "zip":
        path = shutil.make_archive(str(tmp_path / "eval_bundle"), "zip", str(tmp_path), "eval_bundle")
        declare_size(path, member, gib)
        assert zipfile.ZipFile(path).getinfo(member).file_size == gib
        named = f"{path}/{member}"
    else:
        path = named = os.path.join(bundle, "eval_data", "reading", "squad_like.jsonl")
        os.truncate(path, gib)
        path = bundle
    with pytest.raises(core_eval.UserError, match=re.escape(f"{named} is 1,073,741,824 bytes (uncompressed); a file of "
                                                           "the eval bundle may be at most 256 MiB")) as e:
        core_eval.load_tasks(path, ["squad_like"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_an_empty_task_file_says_it_has_no_examples(tmp_path, text):
    bundle = write_bundle(str(tmp_path / "eval_bundle"), plain_examples(random.Random(3)))
    path = task_file(bundle, "copa_like")  # a 0-shot task
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(core_eval.UserError, match=re.escape(f"{path} has no examples (task 'copa_like')")) as e:
        core_eval.load_tasks(bundle)
    assert "\n" not in str(e.value) and "too few" not in str(e.value)


def test_choices_all_one_text_are_scored_as_nanochat_and_said_once_per_task(hf_dir, tmp_path, capsys):
    """nanochat scores an example whose choices are one text: it picks the first (no token of a choice is its own,
    every mean is nan, and min keeps the first), right when gold is 0. Scored so, with one warning line per task."""
    examples = plain_examples(random.Random(4))
    for i, ex in enumerate(examples["copa_like"]):  # every example: its count follows from the golds alone
        ex["choices"], ex["gold"] = ["the same answer"] * (2 + i % 2), i % 2
    for ex in examples["winograd_like"][:3]:  # schema: 3 of 12
        ex["context_options"] = [ex["context_options"][0]] * 2
    bundle = write_bundle(str(tmp_path / "eval_bundle"), examples)
    code, out, err = script_cli(capsys, evaluate.main, "--init_from", hf_dir, "--eval_bundle", bundle, "--device", "cpu",
                                "--tasks", "copa_like,winograd_like,arc_like")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: task 'copa_like': 16 of its 16 examples have choices all the same text ({task_file(bundle, 'copa_like')}); "
        "nothing tells them apart, and they are scored as nanochat scores them (the first is the pick)",
        f"warning: task 'winograd_like': 3 of its 12 examples have context_options all the same text "
        f"({task_file(bundle, 'winograd_like')}); nothing tells them apart, and they are scored as nanochat scores them "
        "(the first is the pick)"], err
    row = re.search(r"^copa_like +0 +([\d.]+) ", out, re.M)
    assert row and float(row.group(1)) == round(sum(ex["gold"] == 0 for ex in examples["copa_like"]) / 16, 4), out


def test_options_of_one_text_pick_the_first_whatever_rounding_says(monkeypatch):
    """nanochat scores one example a pass, so options of one text tie exactly and the first is picked; batched
    rows of different padding may differ in the last bit, which must not pick another. Options that differ are
    still picked by their means."""
    def scores(model, rows, R, T, device, n_vocab):  # each row a hair lower than the one before: rounding's worst
        return torch.tensor([1.0 - 1e-6 * r for r in range(len(rows))]), torch.zeros(len(rows), dtype=torch.bool)

    monkeypatch.setattr(core_eval, "score_rows", scores)
    same, other = np.array([EOT_TOKEN, 5, 6, 7]), np.array([EOT_TOKEN, 8, 6, 7])
    rendered = [([(same, 2), (same, 2), (same, 2)], 0), ([(same, 2), (other, 2)], 1)]
    assert core_eval.score_examples(None, "schema", rendered, "cpu", 8, 1, 16, 50257) == [True, True]


# -----------------------------------------------------------------------------
# In the training loop: --core_every


def core_flags(bundle, every="1"):
    return ["--core_every", every, "--core_bundle", bundle]


def test_training_loop_logs_core_as_evaluate_py_scores_the_checkpoint(bundle, tmp_path):
    """The step-s number is measured before step s's update, on the weights saved as model_{s-1}: evaluate.py on
    that checkpoint gives the same CORE."""
    shards = make_shards(str(tmp_path / "shards"))
    log_dir = str(tmp_path / "log")
    train_gpt2.main([*TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "3", "--eval_every", "0",
                     "--save_every", "1", "--max_lr", "1e-2", *core_flags(bundle), "--core_max_per_task", "9"])
    core = read_log(log_dir)["core"]
    assert sorted(core) == [0, 1, 2]
    for s in (1, 2):
        result = evaluate.main(["--checkpoint", os.path.join(log_dir, f"model_{s - 1:05d}.pt"), "--eval_bundle", bundle,
                                "--device", "cpu", "--max_per_task", "9"])
        assert all(r["total"] == 9 for r in result["tasks"].values())
        assert core[s] == round(result["core"], 4), (s, core, result["core"])


@pytest.mark.slow
def test_a_resumed_run_scores_core_as_the_straight_one(bundle, tmp_path):
    """`--resume` alone takes --core_every, --core_bundle and --core_max_per_task from the checkpoint."""
    shards = make_shards(str(tmp_path / "shards"))
    run = [*TINY_FLAGS, "--data_dir", shards, "--max_steps", "5", "--eval_every", "0", "--save_every", "2",
           *core_flags(bundle, "2"), "--core_max_per_task", "6"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train_gpt2.main([*run, "--log_dir", straight])
    train_gpt2.main([*run, "--log_dir", resumed])
    os.remove(os.path.join(resumed, "model_00004.pt"))
    train_gpt2.main(["--log_dir", resumed, "--resume"])
    assert sorted(read_log(straight)["core"]) == [0, 2, 4]
    assert numbers_logged(straight) == numbers_logged(resumed)


def test_a_bad_bundle_or_a_flag_without_core_every_is_refused_before_any_work(bundle, tmp_path, capsys):
    shards = make_shards(str(tmp_path / "shards"))
    broken = str(shutil.copytree(bundle, tmp_path / "eval_bundle"))
    break_bundle("bad JSON", broken)
    assert_refused_before_any_work(capsys, shards, tmp_path, core_flags(broken), "arc_like.jsonl:3: not valid JSON")
    assert_refused_before_any_work(capsys, shards, tmp_path, core_flags(bundle) + ["--core_max_per_task", "2"],
                                   "task 'arc_like' is 3-shot")
    for extra, needle in ((["--core_max_per_task", "5"], "--core_max_per_task does nothing while --core_every is off"),
                          (["--core_bundle", bundle], "--core_bundle does nothing while --core_every is off"),
                          (["--core_every", "-1"], "--core_every -1"),
                          (core_flags(bundle) + ["--core_max_per_task", "0"], "--core_max_per_task 0"),
                          (core_flags(""), "--core_bundle is empty")):
        assert_refused_before_any_work(capsys, shards, tmp_path, extra, needle)


@pytest.mark.slow  # torchrun
def test_torchrun_splits_the_examples_and_sums_the_counts(hf_dir, bundle, ref, tmp_path):
    """evaluate.py over 2 gloo processes gives one process's counts; the training loop's CORE under torchrun is
    evaluate.py's on the checkpoint it scored."""
    out = str(tmp_path / "two.json")
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "evaluate.py", "--init_from",
                    hf_dir, "--eval_bundle", bundle, "--device", "cpu", "--json", out, "--batch_size", "3"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world size 2" in r.stdout and r.stdout.count("CORE ") == 1
    written = json.loads(open(out).read())
    assert {label: t["accuracy"] for label, t in written["tasks"].items()} == {k: c / n for k, (c, n) in ref.items()}
    shards = make_shards(str(tmp_path / "shards"))
    log_dir = str(tmp_path / "log")
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_gpt2.py", *TINY_FLAGS,
                    "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "2", "--eval_every", "0", "--save_every", "1",
                    *core_flags(bundle), "--core_max_per_task", "9"], timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    core = read_log(log_dir)["core"]
    result = evaluate.main(["--checkpoint", os.path.join(log_dir, "model_00000.pt"), "--eval_bundle", bundle, "--device",
                            "cpu", "--max_per_task", "9"])
    assert sorted(core) == [0, 1] and core[1] == round(result["core"], 4)


def test_the_shipped_example_bundle_scores_as_the_reference(hf_dir, hf64, capsys):
    """data/core_example (one four-choice task, 2-shot, a baseline of 25%), the bundle docs/evaluation.md shows,
    scores offline as the reference scores its examples, read here straight from its jsonl."""
    bundle = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "core_example")
    with open(os.path.join(bundle, "eval_data", "simple_facts.jsonl")) as f:
        shipped = [json.loads(line) for line in f]
    rows = ref_task(hf64, "multiple_choice", " ", 2, ref_shuffled(shipped))
    correct = sum(right for right, _, _ in rows)
    assert all(margin > MARGIN for _, margin, _ in rows)  # no pick that float32 rounding could flip
    code, stdout, err = script_cli(capsys, evaluate.main, "--init_from", hf_dir, "--eval_bundle", bundle, "--device", "cpu")
    assert code == 0, err
    want = (correct / len(shipped) - 0.25) / 0.75
    assert re.search(rf"^simple_facts +2 +{correct / len(shipped):.4f} +{want:.4f} +[\d.]+$", stdout, re.M), stdout
    assert re.search(rf"^CORE +{re.escape(f'{want:.4f}')}$", stdout, re.M), stdout
