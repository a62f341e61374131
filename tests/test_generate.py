"""Tests of sampling: GPT.generate's KV cache, sample_next_token's top-k/top-p, and the
generate_tokens.py CLI (checkpoints, stdin, seeds, <|endoftext|>, bad input, HF export).
CPU, offline, tiny random models. Run: python -m pytest -q tests/test_generate.py"""

import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import torch

import generate_tokens
from conftest import ROOT, assert_one_line_error, run_script, peaked_tiny_gpt
from nanogpt.cli import UserError
from nanogpt.tokenizer import EOT_TOKEN, GPT2_VOCAB_SIZE, get_tokenizer
from nanogpt.sampling import sample_next_token
from train_gpt2 import GPT, KVCache


# -----------------------------------------------------------------------------
# helpers


# one worker under -n 2 (conftest.py): the module's fixtures are made once
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("test_generate")]


tiny_model = peaked_tiny_gpt


@torch.no_grad()
def reference_greedy(model, idx, max_new_tokens):
    """Greedy decoding the plain way: the whole window (the last block_size tokens) through the model
    at every step, no cache. Also returns the smallest gap between the best two logits seen, so a
    test can check that its argmaxes are not near-ties."""
    gap = float("inf")
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.block_size :])
        last = logits[:, -1, :GPT2_VOCAB_SIZE]
        top2 = last.topk(2, dim=-1).values
        gap = min(gap, (top2[:, 0] - top2[:, 1]).min().item())
        idx = torch.cat([idx, last.argmax(dim=-1, keepdim=True)], dim=1)
    return idx, gap


def save_ckpt(model, path, prefix=lambda i: ""):
    sd = {prefix(i) + k: v for i, (k, v) in enumerate(model.state_dict().items())}
    torch.save({"model": sd, "config": asdict(model.config), "step": 0}, path)
    return path


def cli_main(argv, capsys, stdin=None, monkeypatch=None):
    """generate_tokens.main in this process (fast: torch and the tokenizer are already loaded)."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", stdin)
    generate_tokens.main(argv)
    return capsys.readouterr().out


def expected_greedy_text(model, prompt, n):
    enc = get_tokenizer()
    tokens = enc.encode(prompt) if prompt else [EOT_TOKEN]
    out, gap = reference_greedy(model, torch.tensor([tokens]), n)
    assert gap > 1e-3, "the test model has near-tied logits; pick another seed"
    return prompt + enc.decode(out[0, len(tokens) :].tolist())


GREEDY = ["--temperature", "0", "--no_stop", "--num_samples", "1", "--device", "cpu", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def ckpt_model():
    # the vocabulary of the real tokenizer, so the CLI can decode what it samples
    return tiny_model(seed=1, block_size=64, vocab_size=50304)


@pytest.fixture(scope="module")
def ckpt(ckpt_model, tmp_path_factory):
    return save_ckpt(ckpt_model, str(tmp_path_factory.mktemp("ckpt") / "model_00000.pt"))


# -----------------------------------------------------------------------------
# GPT.generate and the KV cache


def test_cached_greedy_equals_uncached_and_reference():
    model = tiny_model()
    idx = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(0))
    want, gap = reference_greedy(model, idx, 10)  # stays inside block_size 16: the cache is used all the way
    assert gap > 1e-3
    assert len(set(want[:, 5:].flatten().tolist())) > 3  # not a constant stream: the test can tell orders apart
    cached = model.generate(idx, 10, temperature=0)
    uncached = model.generate(idx, 10, temperature=0, use_cache=False)
    assert torch.equal(cached, want)
    assert torch.equal(uncached, want)


def test_greedy_past_block_size_uses_sliding_window():
    model = tiny_model(seed=2)
    idx = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    want, gap = reference_greedy(model, idx, 30)  # 36 tokens > block_size 16: the window slides
    assert gap > 1e-3
    assert want.shape == (2, 36)
    assert torch.equal(model.generate(idx, 30, temperature=0), want)
    assert torch.equal(model.generate(idx, 30, temperature=0, use_cache=False), want)
    # a prompt of exactly block_size starts without a cache, one of block_size-1 fills it exactly
    for t in (15, 16):
        idx = torch.randint(0, 64, (1, t), generator=torch.Generator().manual_seed(t))
        assert torch.equal(model.generate(idx, 5, temperature=0), reference_greedy(model, idx, 5)[0])


@pytest.mark.slow
def test_compile_for_sampling_compiles_what_generate_runs():
    """--compile must reach the key/value-cache step that generate runs, not only forward (which the cached
    path does not call): Dynamo traces frames during a generate that stays inside the context, and again
    once the window slides; the tokens are the eager model's. (backend "eager": Dynamo's tracing without
    Inductor's C++ build, which takes a minute on a CPU.)"""
    from torch._dynamo.utils import counters

    idx = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    want = tiny_model(seed=2).generate(idx, 30, temperature=0)
    model = tiny_model(seed=2)
    generate_tokens.compile_for_sampling(model, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(model.generate(idx, 9, temperature=0), want[:, :15])  # 15 < block_size 16: cached only
    cached_frames = counters["frames"]["ok"]
    assert cached_frames >= 1
    assert torch.equal(model.generate(idx, 30, temperature=0), want)  # past the context: the window's forward
    assert counters["frames"]["ok"] > cached_frames
    torch._dynamo.reset()


@torch.no_grad()
def test_cached_chunks_match_full_forward():
    """In float64: the same weights, attention over other shapes (sums in another order). Dot products
    of length <= 128 through ~10 chained ops round by < 1e3 * 128 * eps64 = 3e-11 of the logits'
    scale; checked at 1e-9 of it."""
    model = tiny_model(seed=3, block_size=32).double()
    idx = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(2))
    full, _ = model(idx)
    cache = KVCache(model.config, 2, 32, "cpu", torch.float64)
    parts = [
        model.lm_head(model.hidden_states(idx[:, :5], cache)),  # the prefix: causal attention within it
        model.lm_head(model.hidden_states(idx[:, 5:9], cache)),  # a chunk after a prefix: the attn_mask branch
        model.lm_head(model.hidden_states(idx[:, 9:10], cache)),  # one token: attends to everything cached
        model.lm_head(model.hidden_states(idx[:, 10:14], cache)),  # another chunk
    ]
    assert cache.pos == 14
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-9 * full.abs().max().item()


def test_stop_token_ends_rows_and_pads():
    model = tiny_model(seed=4)
    idx = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(3))
    want, _ = reference_greedy(model, idx, 10)
    row0 = want[0, 4:].tolist()
    k = next(i for i in range(1, 10) if row0[i] not in row0[:i])  # a token row 0 first emits at step k
    stop = row0[k]
    out = model.generate(idx[:1], 10, temperature=0, stop_token=stop)
    assert out[0].tolist() == want[0, : 4 + k + 1].tolist()  # ends right after the stop token
    out = model.generate(idx, 10, temperature=0, stop_token=stop)
    assert out[0, : 4 + k + 1].tolist() == want[0, : 4 + k + 1].tolist()
    assert set(out[0, 4 + k + 1 :].tolist()) <= {stop}  # padded after stopping
    row1 = want[1, 4:].tolist()
    n1 = row1.index(stop) + 1 if stop in row1 else 10
    assert out[1, 4 : 4 + n1].tolist() == row1[:n1]


# -----------------------------------------------------------------------------
# sample_next_token: top-k and top-p against hand computations

PROBS = [0.06, 0.40, 0.04, 0.15, 0.25, 0.10]  # a shuffled vocabulary of 6 tokens
N_SAMPLES = 20000
K_SIGMA = 5  # a correct sampler strays this far from a probability once in ~2 million tokens checked


def sample_counts(probs, n=N_SAMPLES, **kw):
    logits = torch.tensor(probs).log().expand(n, len(probs))
    tokens = sample_next_token(logits, generator=torch.Generator().manual_seed(0), **kw)
    assert tokens.shape == (n, 1)
    counts = torch.bincount(tokens[:, 0], minlength=len(probs))
    return {i: c / n for i, c in enumerate(counts.tolist()) if c}


def nucleus(probs, top_p):
    """The smallest set of most likely tokens whose probability reaches top_p, the slow obvious way."""
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def check_frequencies(freq, probs, kept, n=N_SAMPLES):
    """Exactly the kept tokens are drawn, each with a frequency within K_SIGMA binomial standard
    deviations, sqrt(q(1-q)/n), of its probability q renormalised over the kept tokens (q = 1: exact)."""
    assert set(freq) == kept
    total = sum(probs[i] for i in kept)
    for i in kept:
        q = probs[i] / total
        assert abs(freq[i] - q) <= K_SIGMA * math.sqrt(q * (1 - q) / n), (i, freq[i], q)


def test_top_k():
    check_frequencies(sample_counts(PROBS, top_k=2), PROBS, {1, 4})  # 0.40 and 0.25
    check_frequencies(sample_counts(PROBS, top_k=1), PROBS, {1})
    check_frequencies(sample_counts(PROBS, top_k=0), PROBS, set(range(6)))  # 0 = off


def test_top_p():
    # by hand: sorted 0.40 (1), 0.25 (4), 0.15 (3): 0.65 < 0.75 <= 0.80, so the nucleus is {1, 4, 3}
    assert nucleus(PROBS, 0.75) == {1, 3, 4}
    check_frequencies(sample_counts(PROBS, top_p=0.75), PROBS, {1, 3, 4})
    check_frequencies(sample_counts(PROBS, top_p=0.3), PROBS, {1})  # the top token always stays
    check_frequencies(sample_counts(PROBS, top_p=1.0), PROBS, set(range(6)))


def test_temperature_applies_before_top_p():
    # temperature 2 flattens the distribution: p_i ∝ sqrt(p_i), and the 0.75 nucleus grows to 4 tokens
    flat = [math.sqrt(p) for p in PROBS]
    flat = [p / sum(flat) for p in flat]
    kept = nucleus(flat, 0.75)
    assert kept == {1, 3, 4, 5}
    check_frequencies(sample_counts(PROBS, temperature=2.0, top_p=0.75), flat, kept)


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next_token(logits, temperature=0, top_k=3, top_p=0.5)[:, 0], logits.argmax(dim=-1))


# -----------------------------------------------------------------------------
# the CLI, in process


def test_cli_greedy_matches_reference(ckpt, ckpt_model, capsys):
    out = cli_main(["--checkpoint", ckpt, "--prompt", "The cat sat", "--max_new_tokens", "12"] + GREEDY, capsys)
    assert out == "--- sample 1/1 ---\n" + expected_greedy_text(ckpt_model, "The cat sat", 12) + "\n"


def test_cli_strips_compile_and_ddp_prefixes(ckpt_model, tmp_path, capsys):
    path = save_ckpt(ckpt_model, str(tmp_path / "prefixed.pt"), prefix=lambda i: ["_orig_mod.", "module._orig_mod.", "module."][i % 3])
    out = cli_main(["--checkpoint", path, "--prompt", "The cat sat", "--max_new_tokens", "12"] + GREEDY, capsys)
    assert expected_greedy_text(ckpt_model, "The cat sat", 12) in out


def test_cli_loads_a_checkpoint_saved_on_cuda(ckpt_model, tmp_path, capsys):
    # Tag every storage as living on cuda:0, as torch.save does for a checkpoint written on a GPU.
    entry = (0, lambda storage: "cuda:0", lambda storage, location: None)
    torch.serialization._package_registry.insert(0, entry)
    try:
        path = save_ckpt(ckpt_model, str(tmp_path / "cuda.pt"))
    finally:
        torch.serialization._package_registry.remove(entry)
    if not torch.cuda.is_available():  # the file really asks for a GPU: a plain load fails here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)
    out = cli_main(["--checkpoint", path, "--prompt", "The cat sat", "--max_new_tokens", "12"] + GREEDY, capsys)
    assert expected_greedy_text(ckpt_model, "The cat sat", 12) in out


def test_cli_directory_means_newest_checkpoint(tmp_path, capsys):
    old, new = tiny_model(seed=5, block_size=64, vocab_size=50304), tiny_model(seed=6, block_size=64, vocab_size=50304)
    save_ckpt(old, str(tmp_path / "model_99999.pt"))
    save_ckpt(new, str(tmp_path / "model_100000.pt"))  # newer by step, older by name
    (tmp_path / "model_200000.pt").mkdir()  # a folder named like a checkpoint is none
    out = cli_main(["--checkpoint", str(tmp_path), "--prompt", "Once", "--max_new_tokens", "8"] + GREEDY, capsys)
    assert expected_greedy_text(new, "Once", 8) in out
    assert expected_greedy_text(old, "Once", 8) not in out


def test_cli_prompt_from_stdin_or_default(ckpt, ckpt_model, capsys, monkeypatch):
    out = cli_main(["--checkpoint", ckpt, "--max_new_tokens", "6"] + GREEDY, capsys, io.StringIO("Once upon a time\n"), monkeypatch)
    assert "\n" + expected_greedy_text(ckpt_model, "Once upon a time", 6) + "\n" in out

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = cli_main(["--checkpoint", ckpt, "--max_new_tokens", "6"] + GREEDY, capsys, Terminal(), monkeypatch)
    assert "\n" + expected_greedy_text(ckpt_model, "Hello, I'm a language model,", 6) + "\n" in out
    # an empty prompt starts from <|endoftext|>
    out = cli_main(["--checkpoint", ckpt, "--prompt", "", "--max_new_tokens", "6"] + GREEDY, capsys)
    assert out == "--- sample 1/1 ---\n" + expected_greedy_text(ckpt_model, "", 6) + "\n"


def test_cli_stdin_is_read_as_bytes_and_decoded_strictly(ckpt, ckpt_model, capsys, monkeypatch):
    """Piped bytes: valid UTF-8 (with Windows line ends and a byte-order mark) is the prompt; invalid
    bytes are refused, not turned into '?' or replacement characters."""
    text = "Caf\u00e9 na\u00efve \u2014 ok"

    def piped(data):
        return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace")  # .buffer holds the bytes

    out = cli_main(["--checkpoint", ckpt, "--max_new_tokens", "5"] + GREEDY, capsys,
                   piped(b"\xef\xbb\xbf" + text.encode() + b"\r\n"), monkeypatch)
    assert out == "--- sample 1/1 ---\n" + expected_greedy_text(ckpt_model, text, 5) + "\n"
    for bad in (b"\xff", b"ok \xc3", b"\xed\xa0\x80 surrogate", "Caf\u00e9".encode("latin-1")):
        with pytest.raises(UserError, match="stdin is not UTF-8"):
            cli_main(["--checkpoint", ckpt, "--max_new_tokens", "5"] + GREEDY, capsys, piped(bad), monkeypatch)
    # a command-line prompt with undecodable bytes reaches Python as lone surrogates: refused too
    with pytest.raises(UserError, match="--prompt is not valid UTF-8"):
        cli_main(["--checkpoint", ckpt, "--prompt", b"Hi \xff".decode("utf-8", "surrogateescape")] + GREEDY, capsys)


def test_an_open_stdin_that_sends_nothing_is_announced(monkeypatch):
    """`ssh host python generate_tokens.py ...` or srun: stdin is an open pipe that sends nothing until the
    user ends it. A line on stderr says the prompt is awaited there (not a silent hang); what the user sends
    then is the prompt. A pipe that already holds the prompt (echo ... |) is read without a word."""
    r, w = os.pipe()
    told = []

    class User(io.StringIO):  # stderr, read by a user who answers the first line
        def write(self, text):
            if not told:
                os.write(w, b"Once upon a time\n")
                os.close(w)  # Ctrl-D
            told.append(text)
            return len(text)

    got = []
    with os.fdopen(r, "r") as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        monkeypatch.setattr(sys, "stderr", User())
        reader = threading.Thread(target=lambda: got.append(generate_tokens.read_prompt(None)), daemon=True)
        reader.start()
        reader.join(timeout=60)  # only a failing run waits this long
        if not told:
            os.close(w)  # ends the wait
            reader.join()
    assert got == ["Once upon a time"] and "--prompt" in "".join(told), told
    r, w = os.pipe()
    os.write(w, b"Hi\n")
    os.close(w)
    with os.fdopen(r, "r") as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        assert generate_tokens.read_prompt(None) == "Hi" and sys.stderr.getvalue() == ""


def test_cli_stops_at_endoftext_unless_no_stop(tmp_path, capsys):
    # a model that always predicts <|endoftext|>: ln_f outputs the constant v, and wte[EOT] = 10 v
    model = tiny_model(seed=7, block_size=64, vocab_size=50304)
    with torch.no_grad():
        v = torch.randn(model.config.n_embd)
        v /= v.norm()
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(v)
        model.transformer.wte.weight.mul_(0.02 / 0.3)
        model.transformer.wte.weight[EOT_TOKEN] = 10 * v
    path = save_ckpt(model, str(tmp_path / "eot.pt"))
    args = ["--checkpoint", path, "--prompt", "The end.", "--max_new_tokens", "3", "--num_samples", "2", "--device", "cpu"]
    out = cli_main(args, capsys)
    assert out == "--- sample 1/2 ---\nThe end.\n--- sample 2/2 ---\nThe end.\n"
    out = cli_main(args + ["--no_stop"], capsys)
    eots = "<|endoftext|>" * 3
    assert out == f"--- sample 1/2 ---\nThe end.{eots}\n--- sample 2/2 ---\nThe end.{eots}\n"


# -----------------------------------------------------------------------------
# the CLI in subprocesses: seeds and bad input (run side by side to save time)


@pytest.fixture(scope="module")
def runs(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    truncated = str(d / "model_00001.pt")
    with open(ckpt, "rb") as f:
        data = f.read()
    with open(truncated, "wb") as f:
        f.write(data[: len(data) // 2])
    sample = ["--checkpoint", ckpt, "--max_new_tokens", "20", "--num_samples", "2", "--temperature", "1", "--device", "cpu"]
    cases = {
        "missing": ["--checkpoint", str(d / "nope.pt")],
        "truncated": ["--checkpoint", truncated],
        "long_prompt": ["--checkpoint", ckpt, "--prompt", "word " * 100],  # 100 tokens > context 64
        "top_p_0": ["--checkpoint", ckpt, "--top_p", "0"],
        "top_p_big": ["--checkpoint", ckpt, "--top_p", "1.5"],
        "num_samples_0": ["--checkpoint", ckpt, "--num_samples", "0"],
        "negative_temperature": ["--checkpoint", ckpt, "--temperature", "-1"],
        "seed1": sample + ["--seed", "1"],
        "seed1_again": sample + ["--seed", "1"],
        "seed2": sample + ["--seed", "2"],
        "stdin_not_utf8": (["--checkpoint", ckpt, "--device", "cpu"], b"Hello \xff\xfe world\n"),
    }

    def run(args):
        if isinstance(args, tuple):  # (args, bytes piped to stdin)
            args, data = args
            env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
            r = subprocess.run([sys.executable, "generate_tokens.py", *args], cwd=ROOT, env=env, input=data,
                               capture_output=True, timeout=300)
            return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace"))
        return run_script(["generate_tokens.py", *args])

    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(cases, pool.map(run, cases.values())))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case, words", [
    ("missing", "does not exist"),
    ("truncated", "truncated"),
    ("long_prompt", "longer than the model's context of 64"),
    ("top_p_0", "--top_p"),
    ("top_p_big", "--top_p"),
    ("num_samples_0", "--num_samples"),
    ("negative_temperature", "--temperature"),
    ("stdin_not_utf8", "stdin is not UTF-8"),
])
def test_bad_input_is_one_line_on_stderr(runs, case, words):
    assert_one_line_error(runs[case], "error: ", words)
    assert runs[case].stdout == ""


@pytest.mark.slow
def test_same_seed_same_text_other_seed_other_text(runs):
    for case in ("seed1", "seed1_again", "seed2"):
        assert runs[case].returncode == 0, runs[case].stderr
    assert runs["seed1"].stdout.count("--- sample") == 2
    assert runs["seed1"].stdout == runs["seed1_again"].stdout
    assert runs["seed1"].stdout != runs["seed2"].stdout
    samples = runs["seed1"].stdout.split("--- sample 2/2 ---")
    assert samples[0].split("\n", 1)[1].strip() != samples[1].strip()  # the samples of one run differ too


# -----------------------------------------------------------------------------
# transformers: HF -> ours, ours -> HF


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=50257))
    with torch.no_grad():
        hf.transformer.wte.weight.mul_(10)  # separate the greedy argmaxes (see tiny_model)
    path = str(tmp_path_factory.mktemp("hf") / "gpt2-tiny")
    hf.save_pretrained(path)
    return path


def hf_logits(path, ids):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        return hf(ids).logits


def test_from_pretrained_matches_hf(hf_dir):
    ids = torch.randint(0, GPT2_VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(0))
    ours = GPT.from_pretrained(hf_dir).eval()
    assert ours.config.vocab_size == GPT2_VOCAB_SIZE and ours.config.block_size == 128
    with torch.no_grad():
        logits, _ = ours(ids)
    assert (logits - hf_logits(hf_dir, ids)).abs().max().item() < 1e-4


def test_cli_init_from_hf_dir_greedy_matches_hf(hf_dir, capsys):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    enc = get_tokenizer()
    ids = torch.tensor([enc.encode("Hello there")])
    with torch.no_grad():
        for _ in range(10):  # greedy with transformers' own forward, the full sequence every step
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    out = cli_main(["--init_from", hf_dir, "--prompt", "Hello there", "--max_new_tokens", "10"] + GREEDY, capsys)
    assert out == "--- sample 1/1 ---\n" + enc.decode(ids[0].tolist()) + "\n"


def test_export_hf_round_trip(ckpt, ckpt_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything below reads the folder, nothing from the hub
    out_dir = str(tmp_path / "exported")
    cli_main(["--checkpoint", ckpt, "--export_hf", out_dir], capsys)
    ids = torch.randint(0, GPT2_VOCAB_SIZE, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = ckpt_model(ids)
    theirs = hf_logits(out_dir, ids)
    assert theirs.shape[-1] == GPT2_VOCAB_SIZE  # the padded rows are gone
    assert (ours[..., :GPT2_VOCAB_SIZE] - theirs).abs().max().item() < 1e-4
    back = GPT.from_pretrained(out_dir).eval()  # and back into ours
    with torch.no_grad():
        again, _ = back(ids)
    assert (again - theirs).abs().max().item() < 1e-5
    # the tokenizer saved beside it is GPT-2's: same ids as tiktoken
    from transformers import AutoTokenizer

    text = "Hello, I'm a language model,<|endoftext|> naïve   spacing\n\n"
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert tokenizer(text).input_ids == get_tokenizer().encode(text, allowed_special="all")
    # and a tokenizer that reads vocab.json and merges.txt alone (transformers 4's slow GPT2Tokenizer; transformers 5
    # builds its GPT2Tokenizer from them where a folder has no tokenizer.json) loads the folder offline, the same ids
    from transformers import GPT2Tokenizer

    bare = tmp_path / "vocab_and_merges"
    bare.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(os.path.join(out_dir, name), bare / name)
    for folder in (out_dir, str(bare)):
        assert GPT2Tokenizer.from_pretrained(folder)(text).input_ids == get_tokenizer().encode(text, allowed_special="all")
    # its longest input is the model's context, so truncation cuts text to what the model takes
    with open(os.path.join(out_dir, "config.json")) as f:
        n_positions = json.load(f)["n_positions"]
    assert n_positions == ckpt_model.config.block_size == tokenizer.model_max_length
    assert len(tokenizer(text * 100, truncation=True).input_ids) == n_positions


def test_export_takes_over_no_file_of_the_users(ckpt, tmp_path, capsys, monkeypatch):
    """A file and a folder of the user's named like the export's temporary (DIR.tmp) are left as they were,
    and an export into the current folder (empty) works."""
    (tmp_path / "out.tmp").write_text("theirs")
    (tmp_path / "other.tmp").mkdir()
    (tmp_path / "other.tmp" / "notes.txt").write_text("theirs")
    for name in ("out", "other"):
        cli_main(["--checkpoint", ckpt, "--export_hf", str(tmp_path / name)], capsys)
        assert os.path.isfile(tmp_path / name / "config.json")
    assert (tmp_path / "out.tmp").read_text() == "theirs" and os.listdir(tmp_path / "other.tmp") == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["other", "other.tmp", "out", "out.tmp"]  # no temporary left
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    cli_main(["--checkpoint", ckpt, "--export_hf", "."], capsys)
    assert os.path.isfile(tmp_path / "here" / "config.json")


def test_export_makes_the_folders_above_it_and_takes_them_back_when_it_fails(ckpt, tmp_path, capsys, monkeypatch):
    """--export_hf into a folder whose parents do not exist yet makes them (as fineweb.py's --output_dir and
    --log_dir are made); an export that fails removes the folders it made, and only those."""
    out = tmp_path / "exports" / "2024" / "mine"
    cli_main(["--checkpoint", ckpt, "--export_hf", str(out)], capsys)
    assert os.path.isfile(out / "config.json") and os.listdir(tmp_path) == ["exports"]
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    with pytest.raises(UserError, match="No space left on device"):
        cli_main(["--checkpoint", ckpt, "--export_hf", str(tmp_path / "exports" / "new" / "deeper" / "mine")], capsys)
    assert os.listdir(tmp_path / "exports") == ["2024"]  # exports/ was there already: it stays, new/ and below go


def test_export_refuses_an_existing_directory(ckpt, tmp_path, capsys):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="--export_hf"):
        cli_main(["--checkpoint", ckpt, "--export_hf", str(occupied)], capsys)
    assert os.listdir(occupied) == ["notes.txt"] and (occupied / "notes.txt").read_text() == "mine"


def test_export_refuses_sampling_flags_it_would_ignore(ckpt, tmp_path, capsys):
    """--export_hf writes the model and exits: a --prompt or --temperature given with it would do nothing."""
    out = tmp_path / "out"
    for flags, named in [(["--prompt", "Hi"], "--prompt"), (["--dtype", "bf16", "--device", "cpu"], "--dtype"),
                         (["--temperature", "0.5", "--top_k", "5"], "--temperature, --top_k")]:
        with pytest.raises(UserError, match=re.escape(f"drop {named}")):
            cli_main(["--checkpoint", ckpt, "--export_hf", str(out), *flags], capsys)
    assert os.listdir(tmp_path) == []
