"""hellaswag.py: scores match an independent HF reference, batched == one at a time, DDP split, bad input."""

import json
import os
import random
import re
import threading

import pytest
import torch
import torch.nn.functional as F

import hellaswag
import train_gpt2
from nanogpt import hellaswag_eval
from nanogpt.tokenizer import EOT_TOKEN, get_tokenizer
from conftest import (TINY_FLAGS, assert_one_line_error, make_shards, read_log, run_script, save_random_hf_gpt2,
                      write_hellaswag)

# one worker under -n 2 (conftest.py): the module's fixtures are made once
pytestmark = pytest.mark.xdist_group("test_hellaswag")

WORDS = ("the a man woman dog child people is are was then he she they it with on in into over of to and "
         "slowly quickly holds puts takes runs walks jumps throws water ball rope bike table kitchen field "
         "camera paint wall floor knife bowl [title] [step] ' , . ! ? 42").split()


def write_jsonl(path, n=20, seed=0, ctx_words=(3, 30), end_words=(1, 15)):
    """n synthetic HellaSwag examples of random words, with the harness's fields too."""
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    with open(path, "w") as f:
        for i in range(n):
            ctx_a, ctx_b = words(*ctx_words), words(1, 4)
            ex = {"ind": i, "activity_label": words(1, 3), "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": ctx_a + " " + ctx_b,
                  "endings": [words(*end_words) for _ in range(4)], "label": rng.randrange(4), "split": "val"}
            f.write(json.dumps(ex) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_random_hf_gpt2(str(tmp_path_factory.mktemp("hf") / "tiny-gpt2"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("hs") / "hellaswag_val.jsonl")


def clean(text):
    """lm-evaluation-harness's preprocess() of HellaSwag text, written out again for the reference."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def reference_losses(hf_dir, examples, block_size=None, style="nanogpt", dtype=torch.float64):
    """Per ending (summed loss, token count, acc_norm divisor) of the ending tokens' cross-entropy,
    straight from the HF model, one row at a time, in float64 unless dtype says otherwise. The
    rendering is written out here independently of hellaswag.py."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).to(dtype).eval()  # a GPT-2, or an exported llama
    enc = train_gpt2.get_tokenizer()
    out = []
    for ex in examples:
        if style == "nanogpt":  # build-nanogpt: ctx, then " " + ending; acc_norm divides by the tokens scored
            ctx = enc.encode(ex["ctx"])
            ends = [enc.encode(" " + e) for e in ex["endings"]]
            divisors = [None] * 4
        else:  # harness: "label: ctx_a Ctx_b" cleaned; " " + cleaned ending, split off the joint encoding;
            # a trailing space of the context moves to the continuation; acc_norm divides by characters
            query = clean(ex["activity_label"] + ": " + ex["ctx_a"] + " " + ex["ctx_b"].capitalize())
            n_spaces = len(query) - len(query.rstrip())
            choices = [clean(e) for e in ex["endings"]]
            ctx = enc.encode(query[: len(query) - n_spaces])
            ends = [enc.encode(query + " " + c)[len(ctx):] for c in choices]
            divisors = [len(c) for c in choices]
        row = []
        for end, divisor in zip(ends, divisors):
            tokens = ctx + end
            if block_size is not None:
                tokens = tokens[-block_size:]
            x = torch.tensor([tokens])
            with torch.no_grad():
                logits = model(x).logits[0]
            losses = F.cross_entropy(logits[:-1], x[0, 1:], reduction="none")
            n = min(len(end), len(tokens) - 1)
            row.append((losses[-n:].sum().item(), n, n if divisor is None else divisor))
        out.append(row)
    return out


@pytest.fixture(scope="module")
def ref(hf_dir, data):
    return reference_losses(hf_dir, hellaswag_eval.load_examples(data))


def fp32_tolerance(hf_dir, examples, ref64, **kw):
    """How far a float32 scorer's summed losses may be from float64's: 4x the largest error of the
    float32 reference (the same sums, one row at a time) on these examples. hellaswag_eval.score does the
    same float32 operations in batches, so in another order: errors of the same size, not identical
    (4x: margin for that)."""
    ref32 = reference_losses(hf_dir, examples, dtype=torch.float32, **kw)
    err = max(abs(a[0] - b[0]) for r32, r64 in zip(ref32, ref64) for a, b in zip(r32, r64))
    assert err > 0  # the two references really differ in precision
    return 4 * err


@pytest.fixture(scope="module")
def tol(hf_dir, data, ref):
    return fp32_tolerance(hf_dir, hellaswag_eval.load_examples(data), ref)


def assert_clear_winners(ref, tol):
    """In every example the best ending beats the runner-up by more than 2 tol, by summed loss and by
    the acc_norm mean (a sum's error over a divisor >= 1): an error within tol cannot change a pick,
    so equal picks are expected, not luck."""
    for r in ref:
        for key in (lambda e: e[0], lambda e: e[0] / e[2]):
            first, second = sorted(key(e) for e in r)[:2]
            assert second - first > 2 * tol, (r, tol)


def reference_counts(examples, ref):
    acc = sum(min(range(4), key=lambda j: r[j][0]) == ex["label"] for ex, r in zip(examples, ref))
    acc_norm = sum(min(range(4), key=lambda j: r[j][0] / r[j][2]) == ex["label"] for ex, r in zip(examples, ref))
    return acc, acc_norm


def test_scores_match_hf_reference_batched_and_one_at_a_time(hf_dir, data, ref, tol):
    examples = hellaswag_eval.load_examples(data)
    assert len(examples) == 20
    model = train_gpt2.load_model(init_from=hf_dir)
    enc = train_gpt2.get_tokenizer()
    rendered = [hellaswag_eval.render(ex, enc) for ex in examples]
    one, counts = hellaswag_eval.score(model, rendered, "cpu", batch_size=1, pad_multiple=1)
    # 3 batches, the last one short
    batched, _ = hellaswag_eval.score(model, rendered, "cpu", batch_size=7, pad_multiple=32)
    want = torch.tensor([[s for s, _, _ in r] for r in ref], dtype=torch.float64)
    for sums in (one, batched):
        assert sums.shape == want.shape and (sums.double() - want).abs().max().item() <= tol
    assert_clear_winners(ref, tol)
    # the same pick for every example, by sum and by mean, as the reference
    norms = torch.tensor([[n for _, n, _ in r] for r in ref], dtype=torch.float32)
    assert torch.equal(counts, norms)
    for sums in (one, batched):
        assert torch.equal(sums.argmin(1), want.argmin(1))
        assert torch.equal((sums / norms).argmin(1), (want / norms).argmin(1))
    # evaluate's counts
    acc, acc_norm = reference_counts(examples, ref)
    result = hellaswag_eval.evaluate(model, examples, enc, "cpu", batch_size=64)  # more than the 20 examples: one batch
    assert (result["correct"], result["correct_norm"], result["total"]) == (acc, acc_norm, 20)
    assert result["acc"] == acc / 20 and result["acc_norm"] == acc_norm / 20


def test_sum_and_mean_pick_differently_somewhere(hf_dir, data, ref):
    """acc (min sum) and acc_norm (min mean) are different rules: the data must tell them apart, or
    a swap of the two would go unnoticed."""
    examples = hellaswag_eval.load_examples(data)
    picks_sum = [min(range(4), key=lambda j: r[j][0]) for r in ref]
    picks_mean = [min(range(4), key=lambda j: r[j][0] / r[j][1]) for r in ref]
    assert picks_sum != picks_mean
    model = train_gpt2.load_model(init_from=hf_dir)
    enc = train_gpt2.get_tokenizer()
    sums, counts = hellaswag_eval.score(model, [hellaswag_eval.render(ex, enc) for ex in examples], "cpu", batch_size=8)
    assert sums.argmin(1).tolist() == picks_sum
    assert (sums / counts).argmin(1).tolist() == picks_mean


def test_harness_style_matches_reference(hf_dir, data):
    examples = hellaswag_eval.load_examples(data)[:12]
    ref = reference_losses(hf_dir, examples, style="harness")
    assert_clear_winners(ref, fp32_tolerance(hf_dir, examples, ref, style="harness"))
    model = train_gpt2.load_model(init_from=hf_dir)
    result = hellaswag_eval.evaluate(model, examples, train_gpt2.get_tokenizer(), "cpu", batch_size=6, style="harness")
    assert (result["correct"], result["correct_norm"]) == reference_counts(examples, ref)
    assert hellaswag_eval.harness_preprocess("  A man [title] Cut it. [step] Then  go ") == "A man. Cut it. Then go"


def test_rows_longer_than_the_context_keep_their_end(hf_dir, tmp_path):
    """A model with a short context (a tiny training run's) still scores: each row keeps its last
    block_size tokens, which the reference does the same way."""
    examples = hellaswag_eval.load_examples(write_jsonl(tmp_path / "long.jsonl", n=6, seed=1, ctx_words=(20, 40), end_words=(5, 30)))
    model = train_gpt2.load_model(init_from=hf_dir)
    model.config.block_size = 24  # wpe has 128 rows; the first 24 are the same model's
    ref = reference_losses(hf_dir, examples, block_size=24)
    tol = fp32_tolerance(hf_dir, examples, ref, block_size=24)
    enc = train_gpt2.get_tokenizer()
    rendered = [hellaswag_eval.render(ex, enc) for ex in examples]
    assert max(len(c) + len(e) for c, ends, _ in rendered for e in ends) > 24
    sums, counts = hellaswag_eval.score(model, rendered, "cpu", batch_size=4, pad_multiple=32)  # 32 > 24: capped at the context
    assert (sums.double() - torch.tensor([[s for s, _, _ in r] for r in ref], dtype=torch.float64)).abs().max() <= tol
    assert counts.tolist() == [[float(n) for _, n, _ in r] for r in ref]
    assert any(n < len(e) for (_, ends, _), r in zip(rendered, ref) for e, (_, n, _) in zip(ends, r))  # some ending was cut
    result = hellaswag_eval.evaluate(model, examples, enc, "cpu", batch_size=4)
    assert_clear_winners(ref, tol)
    assert (result["correct"], result["correct_norm"]) == reference_counts(examples, ref)


def test_a_context_of_one_token_is_refused(data):
    """A row cut to one token scores no ending token: the four sums would tie at 0 and the pick be ending 0."""
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=1, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(train_gpt2.UserError, match="context of 1 token"):
        hellaswag_eval.evaluate(model, hellaswag_eval.load_examples(data)[:4], get_tokenizer(), "cpu")


def test_padded_vocab_is_ignored(hf_dir, data, ref, tol):
    """A 50304-vocab model (ours) scores over the 50257 real tokens: padding rows with huge logits change nothing."""
    examples = hellaswag_eval.load_examples(data)[:8]
    model = train_gpt2.load_model(init_from=hf_dir)
    cfg = model.config
    padded = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=cfg.block_size, vocab_size=50304, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd))
    sd = model.state_dict()
    for k in ("transformer.wte.weight", "lm_head.weight"):
        sd[k] = torch.cat([sd[k], 5.0 * torch.randn(50304 - 50257, cfg.n_embd)])  # logits far above the real ones
    padded.load_state_dict(sd)
    padded.eval()
    enc = train_gpt2.get_tokenizer()
    rendered = [hellaswag_eval.render(ex, enc) for ex in examples]
    want = torch.tensor([[s for s, _, _ in r] for r in ref[:8]], dtype=torch.float64)
    for m, n_vocab in ((padded, enc.n_vocab), (model, None)):  # each as close to the reference as fp32 allows
        assert (hellaswag_eval.score(m, rendered, "cpu", 4, n_vocab=n_vocab)[0].double() - want).abs().max() <= tol


@pytest.mark.slow
def test_cli_init_from_hf_dir(hf_dir, data, ref):
    examples = hellaswag_eval.load_examples(data)
    acc, acc_norm = reference_counts(examples, ref)
    r = run_script(["hellaswag.py", "--init_from", hf_dir, "--data", data, "--device", "cpu", "--batch_size", "5"])
    assert r.returncode == 0, r.stderr
    m = re.search(r"acc ([\d.]+) \((\d+)/(\d+)\) \| acc_norm ([\d.]+) \((\d+)/(\d+)\) \| [\d.]+ s", r.stdout)
    assert m, r.stdout
    assert (int(m.group(2)), int(m.group(5)), int(m.group(3))) == (acc, acc_norm, 20)
    assert (float(m.group(1)), float(m.group(4))) == (round(acc / 20, 4), round(acc_norm / 20, 4))
    # --limit scores the first N; in-process, main returns the result
    result = hellaswag.main(["--init_from", hf_dir, "--data", data, "--device", "cpu", "--limit", "7"])
    assert result["total"] == 7
    assert (result["correct"], result["correct_norm"]) == reference_counts(examples[:7], ref[:7])


@pytest.mark.slow  # torchrun or torch.compile: the full suite's
def test_ddp_two_processes_give_the_same_counts(hf_dir, data, ref):
    """torchrun, 2 gloo processes: 19 examples split 10 + 9, counts summed, only rank 0 prints."""
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "hellaswag.py", "--init_from", hf_dir,
                    "--data", data, "--device", "cpu", "--batch_size", "3", "--limit", "19"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world size 2" in r.stdout
    acc, acc_norm = reference_counts(hellaswag_eval.load_examples(data)[:19], ref[:19])  # what one process gets (tests above)
    want = f"acc {acc / 19:.4f} ({acc}/19) | acc_norm {acc_norm / 19:.4f} ({acc_norm}/19)"
    assert want in r.stdout, (want, r.stdout)
    assert r.stdout.count("acc_norm") == 1


@pytest.mark.slow
def test_training_loop_logs_hellaswag(tmp_path, data):
    """train_gpt2.py calls load_examples/evaluate in the loop: a tiny run (context 32, shorter than the
    rows) logs hella lines. The step-s number is measured before step s's update, on the weights saved
    as model_{s-1}: hellaswag.py's CLI on that checkpoint must give the same acc_norm, at every step."""
    shards = make_shards(str(tmp_path / "shards"))
    log_dir = str(tmp_path / "log")
    flags = list(TINY_FLAGS)
    flags[flags.index("--hellaswag_every") + 1] = "1"
    train_gpt2.main([*flags, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "4", "--eval_every", "0",
                     "--save_every", "1", "--max_lr", "1e-2", "--hellaswag_data", data, "--hellaswag_limit", "20"])
    hella = read_log(log_dir)["hella"]
    assert sorted(hella) == [0, 1, 2, 3]
    cli = {s: hellaswag.main(["--checkpoint", os.path.join(log_dir, f"model_{s - 1:05d}.pt"), "--data", data,
                              "--device", "cpu"]) for s in (1, 2, 3)}
    assert all(r["total"] == 20 for r in cli.values())
    assert {s: hella[s] for s in cli} == {s: round(r["acc_norm"], 4) for s, r in cli.items()}, (hella, cli)
    # and the CLI finds the run's newest checkpoint in the folder
    newest = hellaswag.main(["--checkpoint", log_dir, "--data", data, "--device", "cpu"])
    assert newest == hellaswag.main(["--checkpoint", os.path.join(log_dir, "model_00003.pt"), "--data", data,
                                     "--device", "cpu"])


@pytest.mark.parametrize("style", ["nanogpt", "harness"])
def test_endoftext_in_the_text_is_scored_as_each_style_reads_it(tmp_path, hf_dir, style):
    """A literal "<|endoftext|>" in a context or an ending: --style nanogpt reads it as text, as fineweb.py
    tokenizes training text (no special token, the tokens decode back to the text; tiktoken's encode refuses it:
    hellaswag.py and the training loop's evaluation died on it); --style harness as lm-evaluation-harness does,
    through transformers' GPT-2 tokenizer (the slow one, from the same BPE files): the special token, each pair of
    context and continuation encoded as the harness encodes it."""
    enc = get_tokenizer()
    example = {"ctx": "He said <|endoftext|> and", "ctx_a": "He said <|endoftext|>", "ctx_b": "and",
               "activity_label": "Talking", "endings": ["left.", "<|endoftext|> stayed.", "ran.", "sat."], "label": 1}
    ctx, endings, _ = hellaswag_eval.render(example, enc, style)
    if style == "nanogpt":
        assert EOT_TOKEN not in ctx and all(EOT_TOKEN not in e for e in endings)
        assert "<|endoftext|>" in enc.decode(ctx) and enc.decode(endings[1]).strip() == "<|endoftext|> stayed."
    else:
        from transformers import GPT2Tokenizer

        from nanogpt.tokenizer import gpt2_bpe_files

        hf = GPT2Tokenizer(*gpt2_bpe_files())
        query = "Talking: He said <|endoftext|> And"  # the harness's context: activity_label: ctx_a ctx_b.capitalize()
        want_ctx = hf.encode(query)
        assert ctx == want_ctx and EOT_TOKEN in ctx
        assert endings == [hf.encode(f"{query} {e}")[len(want_ctx):] for e in example["endings"]]
        assert EOT_TOKEN in endings[1]
    data = tmp_path / "hs.jsonl"
    data.write_text(json.dumps(example) + "\n")
    assert hellaswag.main(["--init_from", hf_dir, "--data", str(data), "--device", "cpu", "--style", style])["total"] == 1


@pytest.mark.parametrize("line, needle", [
    ("{not json", "not valid JSON"),
    ('{"endings": ["a", "b", "c", "d"], "label": 0}', "missing field 'ctx'"),
    ('{"ctx": "x", "endings": ["a", "b", "c"], "label": 0}', "4 strings"),
    ('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 4}', "'label' must be 0, 1, 2 or 3"),
    ('{"ctx": "x", "endings": ["a", "b", "c", "d"]}', "'label'"),
    ('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": "\u00b2"}', "'label' must be"),  # a digit int() refuses
    # what cannot be scored: an ending with no text (a loss over no tokens, 0, would win), no context
    ('{"ctx": "x", "endings": ["a", "", "c", "d"], "label": 0}', "ending 2 is empty"),
    ('{"ctx": "x", "endings": ["a", "b", "c", " "], "label": 0}', "ending 4 is empty"),
    ('{"ctx": "x", "endings": ["", "", "", ""], "label": 0}', "ending 1 is empty"),
    ('{"ctx": "", "endings": ["a", "b", "c", "d"], "label": 0}', "'ctx' is empty"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, needle):
    path = str(tmp_path / "bad.jsonl")
    good = json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 1})
    with open(path, "w") as f:
        f.write(good + "\n\n" + good + "\n" + line + "\n")
    with pytest.raises(train_gpt2.UserError, match=re.escape(f"{path}:4: ") + ".*" + re.escape(needle)):
        hellaswag_eval.load_examples(path)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_text_that_is_not_utf8_names_its_line(tmp_path, newline):
    """A latin-1 line after 100 good ones is line 101 (not where the decoder's read-ahead stopped)."""
    path = str(tmp_path / "latin1.jsonl")
    good = json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 1}).encode()
    with open(path, "wb") as f:
        latin1 = '{"ctx": "caf\xe9", "endings": ["a", "b", "c", "d"], "label": 0}'.encode("latin-1")
        f.write((good + newline) * 100 + latin1 + newline + (good + newline) * 300)
    with pytest.raises(train_gpt2.UserError, match=re.escape(f"{path}:101: not UTF-8 text")):
        hellaswag_eval.load_examples(path)


def test_a_byte_order_mark_starts_a_file_only(tmp_path, data):
    """A UTF-8 byte-order mark (Windows editors) at the start of the file is read past; one mid-file is not JSON."""
    with open(data, "rb") as f:
        body = f.read()
    path = str(tmp_path / "bom.jsonl")
    with open(path, "wb") as f:
        f.write(b"\xef\xbb\xbf" + body)
    assert hellaswag_eval.load_examples(path) == [dict(ex, where=ex["where"].replace(data, path))
                                                  for ex in hellaswag_eval.load_examples(data)]
    lines = body.splitlines(keepends=True)
    with open(path, "wb") as f:
        f.write(lines[0] + b"\xef\xbb\xbf" + lines[1])
    with pytest.raises(train_gpt2.UserError, match=re.escape(f"{path}:2: not valid JSON")):
        hellaswag_eval.load_examples(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_data_from_a_pipe(tmp_path, data):
    """--data <(zcat hellaswag_val.jsonl.gz) names a pipe, not a regular file: it is read like one."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    with open(data, "rb") as f:
        body = f.read()

    def feed():
        with open(fifo, "wb") as f:  # blocks until a reader opens the pipe
            f.write(body)

    writer = threading.Thread(target=feed, daemon=True)  # daemon: left blocked if the pipe is never read
    writer.start()
    examples = hellaswag_eval.load_examples(fifo)
    writer.join()
    assert examples == [dict(ex, where=ex["where"].replace(data, fifo)) for ex in hellaswag_eval.load_examples(data)]


@pytest.mark.slow
def test_cli_errors(tmp_path, hf_dir, data):
    bad = str(tmp_path / "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": "seven"}\n')
    # through the real command line once: one line on stderr, no traceback
    assert_one_line_error(run_script(["hellaswag.py", "--init_from", hf_dir, "--data", bad, "--device", "cpu"]), f"{bad}:1", "label")
    for argv, needle in [
        (["--checkpoint", str(tmp_path / "nope.pt"), "--data", data], "nope.pt does not exist"),
        (["--checkpoint", str(tmp_path), "--data", data], "no model_*.pt checkpoint"),
        (["--init_from", "gpt5", "--data", data], "'gpt5'"),
        (["--data", data], "give exactly one of --checkpoint"),
        (["--init_from", hf_dir, "--data", str(tmp_path / "missing.jsonl")], "missing.jsonl does not exist"),
        (["--init_from", hf_dir, "--data", data, "--batch_size", "0"], "--batch_size"),
    ]:
        with pytest.raises(train_gpt2.UserError, match=re.escape(needle)):
            hellaswag.main([*argv, "--device", "cpu"])


def test_offline_download_is_a_user_error(tmp_path, monkeypatch):
    """No network: a clear UserError (the training loop turns it into 'HellaSwag is off'), no partial file."""
    monkeypatch.setattr(hellaswag_eval, "DATA_URL", "http://127.0.0.1:9/hellaswag_{split}.jsonl")
    cache = str(tmp_path / "cache")
    with pytest.raises(train_gpt2.UserError, match="--data"):
        hellaswag_eval.load_examples(None, cache_dir=cache)
    assert os.listdir(cache) == []


def test_download_writes_the_file_whole_and_leaves_other_files_alone(tmp_path, monkeypatch):
    """The download path end to end over a file:// URL: the cache gets the bytes served, and a file of the
    user's named like a temporary (hellaswag_val.jsonl.tmp) is neither used nor removed."""
    source = tmp_path / "served" / "hellaswag_val.jsonl"
    source.parent.mkdir()
    write_hellaswag(str(source), n=5)
    monkeypatch.setattr(hellaswag_eval, "DATA_URL", (tmp_path / "served").as_uri() + "/hellaswag_{split}.jsonl")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "hellaswag_val.jsonl.tmp").write_text("theirs")
    examples = hellaswag_eval.load_examples(None, cache_dir=str(cache))
    assert len(examples) == 5 and (cache / "hellaswag_val.jsonl").read_bytes() == source.read_bytes()
    assert sorted(os.listdir(cache)) == ["hellaswag_val.jsonl", "hellaswag_val.jsonl.tmp"]
    assert (cache / "hellaswag_val.jsonl.tmp").read_text() == "theirs"


def test_the_shipped_example_file_scores_as_the_reference(hf_dir):
    """data/hellaswag_example.jsonl, the ten-line file docs/evaluation.md runs, scores offline as the reference
    (transformers' forward, float64) scores its lines, read here straight from the file."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "hellaswag_example.jsonl")
    with open(path) as f:
        examples = [json.loads(line) for line in f]
    assert len(examples) == 10
    result = hellaswag.main(["--init_from", hf_dir, "--data", path, "--device", "cpu"])
    ref = reference_losses(hf_dir, examples)
    assert_clear_winners(ref, 1e-3)  # float32's error in these sums is ~1e-5: no pick it could flip
    assert result["total"] == 10
    assert (result["correct"], result["correct_norm"]) == reference_counts(examples, ref)
