"""The training recipe's options: documents shuffled each epoch, batch-size warm-up, experiment
tracking (TensorBoard, W&B) and the torch.compile fallback.

    python -m pytest -q tests/test_recipe.py
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

import train_gpt2
from conftest import TINY_FLAGS, assert_one_line_error, make_shards, read_log, run_script

EOT = 50256
SHUFFLED_FLAGS = [f for f in TINY_FLAGS if f != "--no_shuffle"]


def document_shards(data_dir, lengths, seed=0, val_tokens=2048):
    """Train shards made of documents that each start with <|endoftext|> and hold random tokens
    (never 50256 inside); lengths[i] is shard i's token count. The last shard-less token budget goes
    into the last document. Returns the shards' token arrays."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    train_gpt2.write_shard(os.path.join(data_dir, f"doc_val_{0:06d}.bin"), rng.integers(0, EOT, val_tokens))
    out = []
    for i, n in enumerate(lengths, 1):
        tokens = rng.integers(0, EOT, n)
        cuts = np.sort(rng.choice(np.arange(1, n), size=max(1, n // 10), replace=False))
        tokens[0], tokens[cuts] = EOT, EOT
        train_gpt2.write_shard(os.path.join(data_dir, f"doc_train_{i:06d}.bin"), tokens)
        out.append(tokens)
    return out


def documents(tokens):
    """A token sequence's documents (each from one 50256 to the next), as tuples: the reference."""
    starts = np.flatnonzero(np.asarray(tokens) == EOT)
    assert len(starts) and starts[0] == 0
    return [tuple(d.tolist()) for d in np.split(np.asarray(tokens), starts[1:])]


# -----------------------------------------------------------------------------
# Shuffling


def test_each_epoch_reads_every_document_once_in_a_new_order(tmp_path):
    B, T = 2, 8
    shards = document_shards(str(tmp_path), [16 * 9 + 1, 16 * 12 + 1, 16 * 7 + 1])  # whole batches + the last target
    loader = train_gpt2.ShuffledDataLoader(str(tmp_path), "train", B, T, seed=5)
    epochs = []
    for _ in range(2):
        streams = []  # (shard name, the stream it was read as)
        for _ in range(9 + 12 + 7):
            name = loader.state_dict()["shard_name"]
            x, y = loader.next_batch()
            if not streams or streams[-1][0] != name:
                streams.append((name, []))
            streams[-1][1].append(x.flatten().numpy())
            last_target = int(y[-1, -1])
            if loader.state_dict()["shard_name"] != name or loader.state_dict()["base"] == 0:
                streams[-1][1].append(np.array([last_target]))
        epochs.append([(name, np.concatenate(parts)) for name, parts in streams])
    assert loader.state_dict()["epoch"] == 2
    names = [f"doc_train_{i:06d}.bin" for i in (1, 2, 3)]
    for epoch in epochs:
        assert sorted(name for name, _ in epoch) == names  # every shard once
        for name, stream in epoch:
            original = shards[names.index(name)]
            assert len(stream) == len(original)
            assert sorted(documents(stream)) == sorted(documents(original))  # every document once, whole
    orders = [[name for name, _ in epoch] for epoch in epochs]
    doc_orders = [{name: documents(stream) for name, stream in epoch} for epoch in epochs]
    assert orders[0] != orders[1] or doc_orders[0] != doc_orders[1]
    for name in names:  # the documents are permuted, and differently in each epoch
        file_order = documents(shards[names.index(name)])
        assert doc_orders[0][name] != file_order and doc_orders[1][name] != file_order
        assert doc_orders[0][name] != doc_orders[1][name]


def test_a_shard_without_end_of_text_is_one_document(tmp_path):
    document_shards(str(tmp_path), [16 * 3 + 1])
    plain = np.arange(1000, 1000 + 16 * 4 + 1)  # no 50256 at all, and tokens before any would be one document too
    train_gpt2.write_shard(str(tmp_path / "doc_train_000002.bin"), plain)
    assert list(train_gpt2.document_starts(plain)) == [0]
    assert list(train_gpt2.document_starts(np.array([7, 8, EOT, 9, EOT]))) == [0, 2, 4]
    assert list(train_gpt2.document_starts(np.array([EOT, 9, EOT, EOT]), chunk=3)) == [0, 2, 3]
    loader = train_gpt2.ShuffledDataLoader(str(tmp_path), "train", 2, 8, seed=0)
    for _ in range(2 * 7):
        if loader.state_dict()["shard_name"] == "doc_train_000002.bin":
            read = np.concatenate([loader.next_batch()[0].flatten().numpy() for _ in range(4)])
            assert np.array_equal(read, plain[:64])
            return
        loader.next_batch()
    raise AssertionError("the shard was never read")


def test_loader_state_resumes_with_another_world_size_and_micro_batch(tmp_path):
    """The state is a token offset in the permuted stream: 1 process of 2x8, 2 processes of 2x8 and
    1 process of 4x8 read the same tokens after it, across shard and epoch ends (shards hold whole
    strides of 32 tokens, so no stride is dropped differently)."""
    document_shards(str(tmp_path), [32 * 5 + 1, 32 * 3 + 1])
    a = train_gpt2.ShuffledDataLoader(str(tmp_path), "train", 2, 8, seed=11)
    for _ in range(6):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # plain types, as a checkpoint holds it
    want = [a.next_batch()[0] for _ in range(2 * 20)]  # beyond the end of epoch 0
    assert a.state_dict()["epoch"] == 2
    ranks = [train_gpt2.ShuffledDataLoader(str(tmp_path), "train", 2, 8, rank=r, world_size=2, seed=999) for r in range(2)]
    wide = train_gpt2.ShuffledDataLoader(str(tmp_path), "train", 4, 8, seed=999)
    for loader in (*ranks, wide):
        loader.load_state_dict(state)  # the state's seed, not the constructor's, orders the data
    for k in range(20):
        assert torch.equal(ranks[0].next_batch()[0], want[2 * k]) and torch.equal(ranks[1].next_batch()[0], want[2 * k + 1])
        assert torch.equal(wide.next_batch()[0], torch.cat([want[2 * k], want[2 * k + 1]]))


def test_validation_is_never_shuffled_and_no_shuffle_is_file_order(tmp_path):
    document_shards(str(tmp_path), [16 * 6 + 1])
    args = train_gpt2.parse_args(["--data_dir", str(tmp_path), "--batch_size", "2", "--seq_len", "8"])
    assert not args.no_shuffle  # shuffling is the default
    assert isinstance(train_gpt2.training_loader(args, 0, 1, None), train_gpt2.ShuffledDataLoader)
    args.no_shuffle = True
    plain = train_gpt2.training_loader(args, 0, 1, None)
    assert type(plain) is train_gpt2.DataLoaderLite
    assert np.array_equal(plain.next_batch()[0].flatten().numpy(), train_gpt2.read_shard(str(tmp_path / "doc_train_000001.bin"))[:16])


def shuffled_run(data, log_dir, *extra):
    return train_gpt2.main([*SHUFFLED_FLAGS, "--data_dir", data, "--log_dir", log_dir, *extra])


def test_resume_mid_epoch_equals_the_straight_run(tmp_path):
    data = str(tmp_path / "data")
    document_shards(data, [300, 400])  # 2 + 3 micro-batches of 128 tokens: an epoch of 5 one-micro-batch steps
    run = ["--max_steps", "8", "--eval_every", "4", "--save_every", "3", "--total_batch_size", "128", "--max_lr", "1e-2"]
    shuffled_run(data, str(tmp_path / "straight"), *run)
    shutil.copytree(tmp_path / "straight", tmp_path / "cut")
    for step in (5, 7):  # as if the run died after step 2's checkpoint, in the middle of epoch 0
        os.remove(str(tmp_path / "cut" / f"model_{step:05d}.pt"))
    shuffled_run(data, str(tmp_path / "cut"), *run, "--resume")
    with open(tmp_path / "straight" / "log.txt") as f, open(tmp_path / "cut" / "log.txt") as g:
        assert f.read() == g.read()
    straight, cut = (torch.load(str(tmp_path / d / "model_00007.pt"), weights_only=True)["loader"] for d in ("straight", "cut"))
    assert straight == cut and cut["epoch"] == 1 and cut["seed"] == 1337


def test_shuffling_cannot_change_on_resume(tmp_path):
    data = str(tmp_path / "data")
    document_shards(data, [700])
    shuffled_run(data, str(tmp_path / "log"), "--max_steps", "2", "--eval_every", "0")
    with pytest.raises(train_gpt2.UserError, match="--no_shuffle True conflicts"):
        shuffled_run(data, str(tmp_path / "log"), "--max_steps", "3", "--eval_every", "0", "--resume", "--no_shuffle")


def torchrun(nproc, *args):
    return run_script(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train_gpt2.py", *args], timeout=400)


def test_resume_on_two_processes_continues_at_the_same_token(tmp_path):
    data = str(tmp_path / "data")
    document_shards(data, [600, 800])  # whole strides of 1 x 129 and of 2 x 128 + 1: an epoch of 5 steps either way
    run = [*SHUFFLED_FLAGS, "--data_dir", data, "--max_steps", "7", "--eval_every", "0", "--save_every", "3"]
    train_gpt2.main([*run, "--log_dir", str(tmp_path / "one")])
    shutil.copytree(tmp_path / "one", tmp_path / "cut")
    for step in (5, 6):  # as if the 1-process run died after step 2's checkpoint
        os.remove(str(tmp_path / "cut" / f"model_{step:05d}.pt"))
    both = torchrun(2, *run, "--log_dir", str(tmp_path / "cut"), "--resume")
    assert both.returncode == 0, both.stderr[-3000:]
    one, cut = (torch.load(str(tmp_path / d / "model_00006.pt"), weights_only=True) for d in ("one", "cut"))
    assert one["loader"] == cut["loader"] and one["loader"]["epoch"] == 1
    a, b = read_log(str(tmp_path / "one"))["train"], read_log(str(tmp_path / "cut"))["train"]
    assert a.keys() == b.keys() == set(range(7))
    for s in range(3, 7):  # the same data: equal up to the 2 ranks' sum order (the DDP test's bound)
        assert abs(a[s] - b[s]) < 1e-4, (s, a[s], b[s])


# -----------------------------------------------------------------------------
# Batch-size warm-up


def ramp_tokens(steps, start, total, ramp, micro):
    """Tokens of each step under the warm-up, from the rule stated in the issue: linear in tokens
    seen from start to total over the first `ramp` tokens, floored to whole micro-batches, at least one."""
    seen, out = 0, []
    for _ in range(steps):
        want = total if seen >= ramp else start + (total - start) * seen / ramp
        tokens = micro * max(1, min(total // micro, int(want // micro)))
        out.append(tokens)
        seen += tokens
    return out


RAMP = ["--total_batch_size", "512", "--batch_size_warmup_tokens", "1000", "--batch_size_start", "128"]  # micro-batch 4 x 32


def test_tokens_per_step_follow_the_ramp(shards, tmp_path, capsys):
    log_dir = str(tmp_path / "log")
    train_gpt2.main([*TINY_FLAGS, "--data_dir", shards, "--log_dir", log_dir, "--max_steps", "7", "--eval_every", "0",
                     "--save_every", "2", *RAMP])
    want = ramp_tokens(7, 128, 512, 1000, 128)
    assert want == [128, 128, 128, 256, 256, 384, 512]  # (the formula's values, for the reader)
    out = capsys.readouterr().out
    seen = [int(line.split("| batch ")[1].split()[0]) for line in out.splitlines() if "| batch " in line]
    assert seen == want
    for step in (1, 3, 5, 6):
        ckpt = torch.load(os.path.join(log_dir, f"model_{step:05d}.pt"), weights_only=True)
        # the tokens trained on, and the fixed-order loader's offset in its one 20000-token shard: the same
        assert ckpt["tokens"] == ckpt["loader"]["base"] == sum(want[: step + 1])


def test_resume_mid_ramp_equals_the_straight_run(shards, tmp_path):
    run = [*TINY_FLAGS, "--data_dir", shards, "--max_steps", "6", "--eval_every", "3", "--save_every", "2", *RAMP]
    train_gpt2.main([*run, "--log_dir", str(tmp_path / "straight")])
    shutil.copytree(tmp_path / "straight", tmp_path / "cut")
    for step in (3, 5):  # resume after step 1, at the ramp's start
        os.remove(str(tmp_path / "cut" / f"model_{step:05d}.pt"))
    train_gpt2.main([*run, "--log_dir", str(tmp_path / "cut"), "--resume"])
    with open(tmp_path / "straight" / "log.txt") as f, open(tmp_path / "cut" / "log.txt") as g:
        assert f.read() == g.read()
    straight, cut = (torch.load(str(tmp_path / d / "model_00005.pt"), weights_only=True) for d in ("straight", "cut"))
    assert straight["tokens"] == cut["tokens"] == sum(ramp_tokens(6, 128, 512, 1000, 128))
    assert straight["loader"] == cut["loader"]


@pytest.mark.parametrize("start,needle", [("1024", "to --total_batch_size 512"), ("64", "from 128"), ("200", "a multiple of")])
def test_a_bad_batch_size_start_is_one_line(shards, tmp_path, start, needle):
    argv = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"), "--total_batch_size", "512",
            "--batch_size_warmup_tokens", "1000", "--batch_size_start", start]
    with pytest.raises(train_gpt2.UserError, match=f"--batch_size_start {start}: .*{needle}"):
        train_gpt2.main(argv)
    assert not os.listdir(tmp_path / "log")  # refused before any work


def test_a_bad_batch_warmup_end_to_end(shards, tmp_path):
    result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"),
                         "--batch_size_start", "256"])
    assert_one_line_error(result, "--batch_size_start 256 needs --batch_size_warmup_tokens")
