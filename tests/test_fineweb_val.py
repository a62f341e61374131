"""fineweb.py --val_tokens: validation drawn from across all inputs.

Each run's val and train shards are read back with numpy and taken apart at <|endoftext|>; the pieces
are matched, in input order, against the inputs' documents tokenized here with tiktoken directly
(encode_ordinary): every document exactly once, each split in input order, a .txt's pieces tiling its
text with the tokens of the whole text. Run: python -m pytest -q tests/test_fineweb_val.py"""

import json
import math
import os
import re
import signal
from collections import deque

import numpy as np
import pytest

import fineweb
import train_gpt2
from nanogpt import text_inputs, train_val_split
from nanogpt.shards import list_shards
from conftest import ROOT, assert_cli_error, fineweb_cli, run_script

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
pytestmark = pytest.mark.slow

EOT = 50256


@pytest.fixture(autouse=True)
def small_units(monkeypatch):
    # small chunks and .txt units, so that a test-sized input has many of both and documents cross chunks
    monkeypatch.setattr(text_inputs, "CHUNK_CHARS", 700)
    monkeypatch.setattr(fineweb, "BATCH_CHARS", 700)
    monkeypatch.setattr(fineweb, "UNIT_CHARS", 300)


def austen(start, length):
    with open(os.path.join(ROOT, "data", "austen.txt"), encoding="utf-8") as f:
        return f.read()[start : start + length]


def write_inputs(d, txt=True):
    """Two .jsonl, a .parquet and (with txt) two .txt files, all documents different; some documents are
    longer than a chunk, one is empty. Returns the paths and [(input index, "doc" or "txt", text)]."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(d, exist_ok=True)
    paths, docs = [], []

    def add(name, texts, kind="doc"):
        path = os.path.join(d, name)
        if name.endswith(".txt"):
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(texts[0])
        elif name.endswith(".jsonl"):
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        else:
            pq.write_table(pa.table({"text": texts}), path, row_group_size=16)
        docs.extend((len(paths), kind, t) for t in texts)
        paths.append(path)

    if txt:
        add("book.txt", [austen(0, 30000)], "txt")
    add("a.jsonl", [f"a{i}: " + austen(40000 + 997 * i, 60 + (i * 37) % 1500) for i in range(70)] + [""])
    add("b.parquet", [f"b{i}\n" + austen(120000 + 1013 * i, 40 + (i * 53) % 900) for i in range(50)])
    if txt:
        add("other.txt", [austen(300000, 20000) + "\n"], "txt")
    add("c.jsonl", [f"c{i}: " + austen(400000 + 1201 * i, 30 + (i * 71) % 2500) for i in range(40)])
    return paths, docs


def split_tokens(d, split):
    """The split's tokens, its shards read in the trainer's order (list_shards: by name)."""
    paths = list_shards(d, split)
    return np.concatenate([np.fromfile(p, dtype="<u2", offset=1024) for p in paths]).astype(np.int64) if paths else np.zeros(0, np.int64)


def segments(tokens):
    """The token stream cut before each <|endoftext|>: each piece starts with one."""
    assert len(tokens) == 0 or tokens[0] == EOT
    cuts = np.flatnonzero(tokens == EOT)
    return deque(tokens[a:b].tolist() for a, b in zip(cuts, [*cuts[1:], len(tokens)]))


def match_inputs(d, docs):
    """Matches the val and train shards in d against docs (see the module docstring). Returns
    [(input index, split, tokens)] of each document, and of each run of a .txt's text in one split."""
    enc = train_gpt2.get_tokenizer()
    queues = {split: segments(split_tokens(d, split)) for split in ("val", "train")}
    found = []
    for source, kind, text in docs:
        if kind == "doc":
            want = [EOT] + enc.encode_ordinary(text)
            hits = [s for s, q in queues.items() if q and q[0] == want]
            assert len(hits) == 1, (source, text[:40], hits)
            found.append((source, hits[0], queues[hits[0]].popleft()))
            continue
        pos, tokens = 0, []
        while pos < len(text):  # the next run of the text is at the head of one split
            hits = [s for s, q in queues.items() if q and len(q[0]) > 1 and text.startswith(enc.decode(q[0][1:]), pos)]
            assert len(hits) == 1, (source, pos, hits)
            run = queues[hits[0]].popleft()
            piece = enc.decode(run[1:])
            assert run[1:] == enc.encode_ordinary(piece)  # cut where the tokenizer cuts anyway
            assert not found or found[-1][:2] != (source, hits[0]) or pos == 0  # runs alternate between the splits
            found.append((source, hits[0], run))
            tokens += run[1:]
            pos += len(piece)
        assert tokens == enc.encode_ordinary(text)  # the pieces' tokens are the whole text's
    assert not queues["val"] and not queues["train"]  # nothing else in the shards
    return found


def read_manifest(d):
    with open(os.path.join(d, "manifest.json")) as f:
        return json.load(f)


def shard_bytes(d):
    return {s["name"]: open(os.path.join(d, s["name"]), "rb").read() for s in read_manifest(d)["shards"]}


def run(paths, out, *flags, num_proc=2):
    fineweb.main(["--input", *paths, "--output_dir", str(out), "--num_proc", str(num_proc), *map(str, flags)])
    return str(out)


def test_fraction_draws_from_every_input_and_keeps_every_document_once(tmp_path, capsys):
    paths, docs = write_inputs(str(tmp_path / "in"))
    out = run(paths, tmp_path / "out", "--shard_size", 600, "--val_tokens", 0.2)
    found = match_inputs(out, docs)
    assert {source for source, split, _ in found if split == "val"} == set(range(len(paths)))  # every input gives validation
    assert sum(split == "val" for source, split, _ in found if docs[0][0] == source) >= 3  # and the book several pieces
    m = read_manifest(out)
    assert m["complete"] and m["args"]["val_tokens"] == 0.2 and m["args"]["seed"] == 1337
    val = [s for s in m["shards"] if "_val_" in s["name"]]
    train = [s for s in m["shards"] if "_train_" in s["name"]]
    assert [s["name"] for s in val] == [f"book_val_{i:06d}.bin" for i in range(len(val))] and len(val) >= 2
    assert sorted(s["name"] for s in train) == [f"book_train_{i:06d}.bin" for i in range(1, len(train) + 1)]
    for shards in (val, train):  # full shards, the last of each split shorter
        assert all(s["tokens"] == 600 for s in sorted(shards, key=lambda s: s["name"])[:-1])
    # the share of validation: each unit (a document, or a piece of a .txt) is drawn with probability 0.2,
    # so the val tokens are 0.2 of all within 4 standard deviations, sqrt(0.2 * 0.8 * sum of units' tokens squared);
    # a run of a .txt is one unit or more, so its tokens squared bound its units'
    n_val, total = len(split_tokens(out, "val")), m["tokens"]
    assert n_val == m["val"]["tokens"] and n_val + len(split_tokens(out, "train")) == total
    squares = sum(len(t) ** 2 for _, _, t in found)
    assert abs(n_val - 0.2 * total) <= 4 * math.sqrt(0.2 * 0.8 * squares) + len(found), (n_val, total)
    assert f"validation: {n_val:,} tokens" in capsys.readouterr().out


def test_crlf_text_is_drawn_from_in_pieces(tmp_path):
    """A .txt with Windows line breaks (\\r\\n) is cut into units at its line breaks like any other, not drawn whole."""
    text = austen(0, 30000).replace("\n", "\r\n")
    (tmp_path / "windows.txt").write_bytes(text.encode("utf-8"))
    out = run([str(tmp_path / "windows.txt")], tmp_path / "out", "--shard_size", 1000, "--val_tokens", 0.3)
    found = match_inputs(out, [(0, "txt", text)])
    assert sum(split == "val" for _, split, _ in found) >= 3 and sum(split == "train" for _, split, _ in found) >= 3


def test_count_stops_one_document_past_the_quota(tmp_path, monkeypatch, capsys):
    paths, docs = write_inputs(str(tmp_path / "in"), txt=False)
    # the size estimate 3x too small: the rate is 3x too high, and the quota is met about a third of the way in
    monkeypatch.setattr(train_val_split, "BYTES_PER_TOKEN", 12)
    out = run(paths, tmp_path / "out", "--shard_size", 1000, "--val_tokens", 3000)
    found = match_inputs(out, docs)
    val = [t for _, split, t in found if split == "val"]
    assert sum(map(len, val)) - len(val[-1]) < 3000 <= sum(map(len, val))  # at most one document over
    last = max(i for i, (_, split, _) in enumerate(found) if split == "val")
    assert last < 0.8 * len(found)  # none after the quota was met
    assert "fewer than" not in capsys.readouterr().out


def test_count_that_the_input_does_not_reach_is_reported(tmp_path, capsys):
    paths, docs = write_inputs(str(tmp_path / "in"))
    code, stdout, _ = fineweb_cli(capsys, "--input", *paths, "--output_dir", tmp_path / "out", "--num_proc", 1,
                                  "--shard_size", 2000, "--val_tokens", 5000)
    found = match_inputs(str(tmp_path / "out"), docs)
    val = [t for _, split, t in found if split == "val"]
    got = sum(map(len, val))
    # the input's 180 kB are estimated at 45,000 tokens (it holds 42,629): the draws at that rate fall short
    assert code == 0 and got < 5000 and f"validation: {got:,} tokens" in stdout and "fewer than the 5,000 asked for" in stdout, stdout


def test_a_count_too_small_to_draw_one_unit_is_refused(tmp_path, capsys):
    """Shards without a val split are of no use to train_gpt2.py: a draw that takes no unit at all is an error."""
    paths, docs = write_inputs(str(tmp_path / "in"))
    out = tmp_path / "out"
    code, _, err = fineweb_cli(capsys, "--input", *paths, "--output_dir", out, "--num_proc", 1, "--shard_size", 2000,
                               "--val_tokens", 2)
    assert code != 0 and "--val_tokens 2: no unit of the input was drawn for validation" in err, err
    assert not [n for n in os.listdir(out) if "_val_" in n] and not read_manifest(str(out))["complete"]


def test_seed_decides_the_draw(tmp_path):
    paths, docs = write_inputs(str(tmp_path / "in"))
    flags = ["--shard_size", 800, "--val_tokens", 0.1]
    a = shard_bytes(run(paths, tmp_path / "a", *flags))
    assert shard_bytes(run(paths, tmp_path / "b", *flags, "--seed", 1337, num_proc=1)) == a
    c = run(paths, tmp_path / "c", *flags, "--seed", 7)
    match_inputs(str(tmp_path / "c"), docs)
    assert split_tokens(c, "val").tolist() != split_tokens(str(tmp_path / "a"), "val").tolist()


def test_output_does_not_depend_on_how_the_work_is_cut(tmp_path, monkeypatch):
    """Shards and manifest (its order of val and train entries too) are the same whatever the batch of text a
    worker gets and however many workers there are."""
    paths, _ = write_inputs(str(tmp_path / "in"))
    flags = ["--shard_size", 700, "--val_tokens", 0.2]
    outputs = []
    for batch_chars, num_proc in ((700, 2), (5000, 1), (64, 2)):
        monkeypatch.setattr(fineweb, "BATCH_CHARS", batch_chars)
        out = run(paths, tmp_path / f"out{batch_chars}", *flags, num_proc=num_proc)
        outputs.append((shard_bytes(out), read_manifest(out)))
    names = [s["name"] for s in outputs[0][1]["shards"]]
    assert any("_train_" in a and "_val_" in b for a, b in zip(names, names[1:]))  # the splits interleave
    assert outputs[0] == outputs[1] == outputs[2]


KILLER = """
import os, signal, sys
import fineweb
from nanogpt import text_inputs
from nanogpt.files import temporary_name
text_inputs.CHUNK_CHARS, fineweb.BATCH_CHARS, fineweb.UNIT_CHARS = 700, 700, 300
real, calls = fineweb.write_shard, [0]
def write_then_die(path, tokens):
    calls[0] += 1
    if calls[0] == 4:
        with open(temporary_name(path), "wb") as f:  # half a shard in the temporary file, then the power goes
            f.write(b"half a shard")
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, tokens)
fineweb.write_shard = write_then_die
fineweb.main(sys.argv[1:])
"""


@pytest.mark.parametrize("val_tokens", ["0.25", "4000"])
def test_stopped_and_killed_runs_resume_to_the_same_shards(tmp_path, monkeypatch, val_tokens):
    if val_tokens == "4000":
        monkeypatch.setattr(train_val_split, "BYTES_PER_TOKEN", 8)  # the size estimate too small: the quota is met before the end
    paths, docs = write_inputs(str(tmp_path / "in"))
    flags = ["--shard_size", 2000, "--val_tokens", val_tokens]
    whole = shard_bytes(run(paths, tmp_path / "whole", *flags))
    names = [s["name"] for s in read_manifest(str(tmp_path / "whole"))["shards"]]
    assert sum("_val_" in n for n in names) >= 2 and len(names) > 10
    parts = tmp_path / "parts"
    for stop, num_proc in ((2, 1), (5, 2), (14, 2), (0, 1)):  # --num_proc does not change the output; 14: past the quota
        run(paths, parts, *flags, "--max_shards", stop, num_proc=num_proc)
        assert len(read_manifest(str(parts))["shards"]) == (stop or len(names))
    assert shard_bytes(str(parts)) == whole
    match_inputs(str(parts), docs)
    if val_tokens == "4000":
        return
    killed = str(tmp_path / "killed")
    r = run_script(["-c", KILLER, "--input", *paths, "--output_dir", killed, *map(str, flags), "--num_proc", "2"])
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert len(read_manifest(killed)["shards"]) == 3 and any(n.endswith(".tmp") for n in os.listdir(killed))
    run(paths, killed, *flags)
    assert shard_bytes(killed) == whole and sorted(os.listdir(killed)) == sorted(names + ["manifest.json"])


def test_max_shards_is_never_passed_and_reaching_the_end_completes(tmp_path):
    """At the end of the input both splits' last, shorter shards are written: --max_shards may stop between them
    (it was passed by one), and one that the input's shards just reach makes a complete folder."""
    paths, docs = write_inputs(str(tmp_path / "in"), txt=False)
    flags = ["--shard_size", 5000, "--val_tokens", 0.3]
    whole = shard_bytes(run(paths, tmp_path / "whole", *flags, num_proc=1))
    n = len(whole)
    assert 4 <= n <= 12
    for stop in range(1, n + 2):
        out = run(paths, tmp_path / f"stop{stop}", *flags, "--max_shards", stop, num_proc=1)
        m = read_manifest(out)
        assert len(m["shards"]) == min(stop, n) and m["complete"] == (stop >= n), (stop, n)
        if stop in (n - 1, n):
            run(paths, out, *flags, num_proc=1)
            assert shard_bytes(out) == whole
    match_inputs(out, docs)


def test_hub_stream_is_drawn_from_and_resumes(tmp_path, monkeypatch):
    """--dataset with a local folder of parquet files runs the hub code (datasets, streaming) offline."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "hubdata"
    data.mkdir()
    docs = [f"document {i}: " + austen(1000 * i, 40 + 29 * i) for i in range(60)]
    for f in range(3):
        pq.write_table(pa.table({"text": docs[20 * f : 20 * f + 20]}), str(data / f"part{f}.parquet"), row_group_size=7)
    flags = ["--dataset", str(data), "--name", "", "--shard_size", "1000", "--num_proc", "2", "--val_tokens", "0.25"]
    fineweb.main([*flags, "--output_dir", str(tmp_path / "whole")])
    found = match_inputs(str(tmp_path / "whole"), [(0, "doc", t) for t in docs])
    assert 5 <= sum(split == "val" for _, split, _ in found) <= 25
    out = str(tmp_path / "out")
    fineweb.main([*flags, "--output_dir", out, "--max_shards", "3"])
    assert all("checkpoint" not in s for s in read_manifest(out)["shards"])  # it restarts from the start, not a position
    fineweb.main([*flags, "--output_dir", out])
    assert shard_bytes(out) == shard_bytes(str(tmp_path / "whole"))


def test_trainer_reads_both_splits(tmp_path):
    paths, _ = write_inputs(str(tmp_path / "in"))
    out = run(paths, tmp_path / "out", "--shard_size", 3000, "--val_tokens", 0.2)
    for split in ("val", "train"):
        want = split_tokens(out, split)
        x, y = train_gpt2.DataLoaderLite(out, split, B=2, T=8).next_batch()
        assert np.array_equal(x.numpy().ravel(), want[:16]) and np.array_equal(y.numpy().ravel(), want[1:17])
        assert all(f"_{split}_" in os.path.basename(p) for p in list_shards(out, split))


def test_other_val_tokens_or_seed_is_refused(tmp_path, capsys):
    paths, _ = write_inputs(str(tmp_path / "in"), txt=False)
    out = run(paths, tmp_path / "out", "--shard_size", 1000, "--val_tokens", 0.1, "--max_shards", 2)
    before = shard_bytes(out)
    for flags, key in ((["--val_tokens", 0.2], "val_tokens"), (["--val_tokens", 0.1, "--seed", 1], "seed"), ([], "val_tokens")):
        assert_cli_error(fineweb_cli(capsys, "--input", *paths, "--output_dir", out, "--shard_size", 1000, *flags), key, "--overwrite")
    assert shard_bytes(out) == before


@pytest.mark.parametrize("module, name, value", [(fineweb, "UNIT_CHARS", 400),
                                                 (text_inputs, "SAFE_SPLIT", re.compile(r"(?<=\S\n)(?=\n?\S)"))])
def test_a_resume_under_other_unit_sizes_or_cuts_is_refused(tmp_path, capsys, monkeypatch, module, name, value):
    """Which .txt units are drawn depends on how the text is cut: a resume cut otherwise would mix two draws."""
    paths, _ = write_inputs(str(tmp_path / "in"))
    out = run(paths, tmp_path / "out", "--shard_size", 1000, "--val_tokens", 0.1, "--max_shards", 2)
    before = shard_bytes(out)
    monkeypatch.setattr(module, name, value)
    result = fineweb_cli(capsys, "--input", *paths, "--output_dir", out, "--shard_size", 1000, "--val_tokens", 0.1)
    assert_cli_error(result, "txt_cuts", "--overwrite")
    assert shard_bytes(out) == before


def test_a_resume_of_a_manifest_with_unit_sizes_but_no_txt_goes_on(tmp_path, capsys):
    """Manifests written before the cut rule was recorded hold "unit_chars" for every --val_tokens run; without
    a .txt input, how a .txt would be cut decides nothing, so such a run resumes, to the same bytes."""
    paths, _ = write_inputs(str(tmp_path / "in"), txt=False)
    whole = run(paths, tmp_path / "whole", "--shard_size", 1000, "--val_tokens", 0.1)
    out = run(paths, tmp_path / "out", "--shard_size", 1000, "--val_tokens", 0.1, "--max_shards", 2)
    manifest = read_manifest(out)
    assert "txt_cuts" not in manifest["args"]
    manifest["args"]["unit_chars"] = [fineweb.UNIT_CHARS, text_inputs.CHUNK_CHARS]
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    run(paths, out, "--shard_size", 1000, "--val_tokens", 0.1)
    assert shard_bytes(out) == shard_bytes(whole)


@pytest.mark.parametrize("value", ["0", "-1", "-0.2", "nan", "inf", "x", "", "1.5", "1e6", "hub"])
def test_bad_val_tokens_is_one_line(tmp_path, capsys, value):
    paths, _ = write_inputs(str(tmp_path / "in"), txt=False)  # about 30,000 tokens
    out = tmp_path / "out"
    source = ["--dataset", "someone/data"] if value == "hub" else ["--input", *paths]  # a hub dataset of unknown size
    result = fineweb_cli(capsys, *source, "--output_dir", out, "--val_tokens", "1000" if value == "hub" else value, "--num_proc", 1)
    assert_cli_error(result, "--val_tokens", "fraction", *{"1e6": ["only about"], "hub": ["someone/data"]}.get(value, []))
    assert not out.exists()
