"""The training recipe's options: documents shuffled each epoch, batch-size warm-up, experiment
tracking (TensorBoard, W&B) and the torch.compile fallback.

    python -m pytest -q tests/test_recipe.py
"""

import glob
import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
import torch

import train_gpt2
from nanogpt.checkpoints import find_checkpoints
from nanogpt import runtime
from nanogpt.runtime import choose_compile
from nanogpt.shards import document_starts, read_shard, write_shard
from conftest import (TINY_FLAGS, assert_one_line_error, assert_same_norms, make_shards, numbers_logged, read_log,
                      run_script, torchrun)

# The full suite's: distributed runs, faults, trackers and the data pipeline. `pytest -m "not slow"` (README) is
# the quick check of a change to the model, which cannot break these alone.
# one worker under -n 2 (conftest.py): the module's fixtures are made once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_recipe")]

EOT = 50256
SHUFFLED_FLAGS = [f for f in TINY_FLAGS if f != "--no_shuffle"]


def document_shards(data_dir, lengths, seed=0, val_tokens=2048):
    """Train shards made of documents that each start with <|endoftext|> and hold random tokens
    (never 50256 inside); lengths[i] is shard i's token count. The last shard-less token budget goes
    into the last document. Returns the shards' token arrays."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_shard(os.path.join(data_dir, f"doc_val_{0:06d}.bin"), rng.integers(0, EOT, val_tokens))
    out = []
    for i, n in enumerate(lengths, 1):
        tokens = rng.integers(0, EOT, n)
        cuts = np.sort(rng.choice(np.arange(1, n), size=max(1, n // 10), replace=False))
        tokens[0], tokens[cuts] = EOT, EOT
        write_shard(os.path.join(data_dir, f"doc_train_{i:06d}.bin"), tokens)
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
    write_shard(str(tmp_path / "doc_train_000002.bin"), plain)
    assert list(document_starts(plain)) == [0]
    assert list(document_starts(np.array([7, 8, EOT, 9, EOT]))) == [0, 2, 4]
    assert list(document_starts(np.array([EOT, 9, EOT, EOT]), chunk=3)) == [0, 2, 3]
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
    val_run_is_the_same_shuffled_or_not(str(tmp_path / "runs"))
    args = train_gpt2.parse_args(["--data_dir", str(tmp_path), "--batch_size", "2", "--seq_len", "8"])
    assert not args.no_shuffle  # shuffling is the default
    assert isinstance(train_gpt2.make_loaders(args, 0, 1, None)[0], train_gpt2.ShuffledDataLoader)
    args.no_shuffle = True
    plain = train_gpt2.make_loaders(args, 0, 1, None)[0]
    assert type(plain) is train_gpt2.DataLoaderLite
    assert np.array_equal(plain.next_batch()[0].flatten().numpy(), read_shard(str(tmp_path / "doc_train_000001.bin"))[:16])


def val_run_is_the_same_shuffled_or_not(tmp):
    """Step 0's validation loss (the same seed: the same initial weights) is the same number with
    the training documents shuffled (the default) and with --no_shuffle: both read the val shard in
    file order. Its documents are short, so a shuffled val loader would read other tokens."""
    data = os.path.join(tmp, "data")
    document_shards(data, [700])
    rng = np.random.default_rng(1)
    val = rng.integers(0, EOT, 2048)
    val[::40] = EOT  # 52 documents of 40 tokens; a step-0 evaluation reads the first 257 tokens
    write_shard(os.path.join(data, f"doc_val_{0:06d}.bin"), val)
    losses = []
    for name, extra in (("shuffled", []), ("file_order", ["--no_shuffle"])):
        shuffled_run(data, os.path.join(tmp, name), "--max_steps", "1", "--eval_every", "1", "--save_every", "0",
                     *extra)
        losses.append(read_log(os.path.join(tmp, name))["val"][0])
    assert losses[0] == losses[1], losses


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
    assert numbers_logged(tmp_path / "straight") == numbers_logged(tmp_path / "cut")
    straight, cut = (torch.load(str(tmp_path / d / "model_00007.pt"), weights_only=True)["loader"] for d in ("straight", "cut"))
    assert straight == cut and cut["epoch"] == 1 and cut["seed"] == 1337


def test_shuffling_cannot_change_on_resume(tmp_path):
    data = str(tmp_path / "data")
    document_shards(data, [700])
    shuffled_run(data, str(tmp_path / "log"), "--max_steps", "2", "--eval_every", "0")
    with pytest.raises(train_gpt2.UserError, match="--no_shuffle True conflicts"):
        shuffled_run(data, str(tmp_path / "log"), "--max_steps", "3", "--eval_every", "0", "--resume", "--no_shuffle")


@pytest.mark.parametrize("order", [[], ["--no_shuffle"]])
def test_a_resume_over_other_shards_says_so(tmp_path, capsys, order):
    """Shards added to the data folder between two runs (fineweb.py finished meanwhile), or gone from it: the
    checkpoint's place is kept, but the data around it (a shuffled epoch's whole order) is not the interrupted
    run's, and the resume says so in one warning. Over the same shards it says nothing."""
    data = str(tmp_path / "data")
    document_shards(data, [700, 700])
    run = [*SHUFFLED_FLAGS, "--data_dir", data, "--log_dir", str(tmp_path / "log"), "--eval_every", "0", *order]
    train_gpt2.main([*run, "--max_steps", "2"])
    train_gpt2.main([*run, "--max_steps", "3", "--resume"])
    assert "warning" not in capsys.readouterr().err
    extra = os.path.join(data, "doc_train_000003.bin")
    for change, steps in ((lambda: shutil.copy(os.path.join(data, "doc_train_000002.bin"), extra), "4"),
                          (lambda: os.remove(extra), "5")):
        change()
        train_gpt2.main([*run, "--max_steps", steps, "--resume"])
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("warning:") and "doc_train_000003.bin is new or gone" in err[0], err


def test_resume_on_two_processes_continues_at_the_same_token(tmp_path, capsys):
    data = str(tmp_path / "data")
    document_shards(data, [600, 800])  # whole strides of 1 x 129 and of 2 x 128 + 1: an epoch of 5 steps either way
    run = [*SHUFFLED_FLAGS, "--data_dir", data, "--max_steps", "7", "--eval_every", "0", "--save_every", "3"]
    capsys.readouterr()
    train_gpt2.main([*run, "--log_dir", str(tmp_path / "one")])
    one_out = capsys.readouterr().out
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
    assert_same_norms(one_out, both.stdout, range(3, 7))  # and the same gradients: averaged over the ranks, not summed


# -----------------------------------------------------------------------------
# Batch-size warm-up


def ramp_tokens(steps, start, total, ramp, micro):
    """Tokens of each step under the warm-up, from the rule docs/training.md states: linear in tokens
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
    assert numbers_logged(tmp_path / "straight") == numbers_logged(tmp_path / "cut")
    straight, cut = (torch.load(str(tmp_path / d / "model_00005.pt"), weights_only=True) for d in ("straight", "cut"))
    assert straight["tokens"] == cut["tokens"] == sum(ramp_tokens(6, 128, 512, 1000, 128))
    assert straight["loader"] == cut["loader"]


@pytest.mark.parametrize("start,needle", [("1024", "to --total_batch_size 512"), ("64", "from 128"), ("200", "a multiple of")])
def test_a_bad_batch_size_start_is_one_line(shards, tmp_path, start, needle):
    argv = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"), "--total_batch_size", "512",
            "--batch_size_warmup_tokens", "1000", "--batch_size_start", start]
    with pytest.raises(train_gpt2.UserError, match=f"--batch_size_start {start}: .*{needle}"):
        train_gpt2.main(argv)
    assert not (tmp_path / "log").exists()  # refused before any work


@pytest.mark.parametrize("value", ["-1", str(2**63), "1.5", "x"])
def test_bad_batch_warmup_tokens_are_refused(shards, tmp_path, value, capsys):
    argv = [*TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"), "--batch_size_warmup_tokens", value]
    try:
        train_gpt2.main(argv)
    except train_gpt2.UserError as e:
        assert f"--batch_size_warmup_tokens {value}: must be a whole number" in str(e)
    except SystemExit as e:  # argparse: one line on stderr
        assert e.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    else:
        raise AssertionError("accepted")
    assert not (tmp_path / "log").exists() or not os.listdir(tmp_path / "log")


def test_a_bad_batch_warmup_end_to_end(shards, tmp_path):
    result = run_script(["train_gpt2.py", *TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"),
                         "--batch_size_start", "256"])
    assert_one_line_error(result, "--batch_size_start 256 needs --batch_size_warmup_tokens")


# -----------------------------------------------------------------------------
# Experiment tracking: TensorBoard and W&B (offline)

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A 4-step run with every tracker that is installed, killed after step 1's checkpoint and resumed:
    the folders of its log, TensorBoard events and offline W&B runs."""
    if not (HAVE_TENSORBOARD or HAVE_WANDB):
        pytest.skip("neither tensorboard nor wandb is installed (pip install tensorboard wandb)")
    tmp = tmp_path_factory.mktemp("tracked")
    shards = make_shards(str(tmp / "data"))
    hella = str(tmp / "hellaswag.jsonl")
    with open(hella, "w") as f:
        for i in range(4):
            f.write(json.dumps({"ctx": f"Example {i}: a man", "endings": ["runs", "sits down", "eats", "sleeps"], "label": i}) + "\n")
    dirs = {"log": str(tmp / "log"), "tensorboard": str(tmp / "tb"), "wandb": str(tmp / "wandb_dir"),
            "other_log": str(tmp / "other")}
    os.makedirs(dirs["wandb"])
    flags = list(TINY_FLAGS)
    flags[flags.index("--hellaswag_every") + 1] = "2"
    cmd = ["train_gpt2.py", *flags, "--data_dir", shards, "--log_dir", dirs["log"], "--max_steps", "4", "--eval_every", "2",
           "--save_every", "2", "--hellaswag_data", hella, "--peak_tflops", "1"]
    if HAVE_TENSORBOARD:
        cmd += ["--tensorboard", dirs["tensorboard"]]
    if HAVE_WANDB:
        cmd += ["--wandb", "recipe-test"]
    env = {"WANDB_MODE": "offline", "WANDB_DIR": dirs["wandb"], "WANDB_SILENT": "true"}
    first = run_script(cmd, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    if HAVE_TENSORBOARD:  # another run sharing the TensorBoard folder, with the same number of steps
        other = [*cmd[:cmd.index("--log_dir") + 1], dirs["other_log"], *cmd[cmd.index("--log_dir") + 2:], "--max_lr", "1e-3"]
        if HAVE_WANDB:
            other = other[:other.index("--wandb")] + other[other.index("--wandb") + 2:]
        other = run_script(other, env=env)
        assert other.returncode == 0, other.stderr[-3000:]
    os.remove(os.path.join(dirs["log"], "model_00003.pt"))  # as if the run died after step 1's checkpoint
    resumed = run_script([*cmd, "--resume"], env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return dirs


def assert_matches_log(series, log, decimals):
    """Tracked values (float32 or float64) against log.txt's rounded ones, step for step."""
    assert sorted(series) == sorted(log)
    for step, value in series.items():
        assert abs(value - log[step]) <= 0.5 * 10**-decimals + abs(log[step]) * 2**-23, (step, value, log[step])


def check_step_scalars(scalars, log_dir):
    """The scalars a step logs, against log.txt, the LR schedule and the MFU formula (peak 1 TFLOP/s)."""
    log = read_log(log_dir)
    assert_matches_log(scalars["train/loss"], log["train"], 6)
    assert_matches_log(scalars["val/loss"], log["val"], 4)
    assert_matches_log(scalars["hellaswag/acc_norm"], log["hella"], 4)
    config = train_gpt2.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
    flops_per_token = train_gpt2.GPT(config).flops_per_token()
    for step in range(4):
        lr = train_gpt2.get_lr(step, 3e-3, 3e-4, 2, 4)
        assert abs(scalars["train/lr"][step] - lr) <= lr * 2**-23
        assert scalars["train/grad_norm"][step] > 0 and scalars["train/batch_tokens"][step] == 256
        assert scalars["train/tokens"][step] == 256 * (step + 1)
        tok_s = scalars["train/tokens_per_sec"][step]
        assert tok_s > 0 and abs(scalars["train/mfu"][step] - 100 * flops_per_token * tok_s / 1e12) <= 1e-5 * scalars["train/mfu"][step]


@pytest.mark.skipif(not HAVE_TENSORBOARD, reason="tensorboard is not installed (pip install tensorboard: an optional dependency)")
def test_tensorboard_events_follow_the_run_through_a_resume(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    def scalars_of(folder):
        acc = EventAccumulator(folder)
        acc.Reload()
        scalars = {}
        for tag in acc.Tags()["scalars"]:
            events = acc.Scalars(tag)
            assert len({e.step for e in events}) == len(events), tag  # each step once
            scalars[tag] = {e.step: e.value for e in events}
        return scalars

    # each run writes into a subfolder of its own, named in its checkpoints
    run_folder = {name: torch.load(find_checkpoints(tracked[name])[0], weights_only=True)["args"]["tensorboard_run"]
                  for name in ("log", "other_log")}
    assert sorted(os.listdir(tracked["tensorboard"])) == sorted(run_folder.values()) and len(set(run_folder.values())) == 2
    mine = os.path.join(tracked["tensorboard"], run_folder["log"])
    check_step_scalars(scalars_of(mine), tracked["log"])
    # the resumed writer purges its own first life's events from step 2 on (the checkpoint was step 1's) ...
    files = sorted(os.listdir(mine), key=lambda n: int(n.split(".")[3]))
    assert len(files) == 2
    starts = [e.step for e in EventFileLoader(os.path.join(mine, files[1])).Load()
              if e.HasField("session_log") and e.session_log.status == e.session_log.START]
    assert starts == [2]
    # ... and none of the other run's, whose curve is its log's
    other = scalars_of(os.path.join(tracked["tensorboard"], run_folder["other_log"]))
    assert_matches_log(other["train/loss"], read_log(tracked["other_log"])["train"], 6)
    assert sorted(other["train/loss"]) == [0, 1, 2, 3]


def wandb_records(path):
    """The records of an offline W&B run file (a LevelDB-style log of protobuf records, 32 KiB blocks)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, part, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (pip install wandb: an optional dependency)")
def test_wandb_offline_run_is_continued_after_resume(tracked):
    ckpt = torch.load(os.path.join(tracked["log"], "model_00001.pt"), weights_only=True)
    run_id = ckpt["args"]["wandb_id"]
    assert run_id
    runs = sorted(glob.glob(os.path.join(tracked["wandb"], "wandb", f"offline-run-*-{run_id}")))
    assert len(runs) == 2  # the resumed life logs into the same run (another run sharing the folder has its own id)
    lives = []
    for run in runs:
        scalars = {}
        for record in wandb_records(os.path.join(run, f"run-{run_id}.wandb")):
            if record.WhichOneof("record_type") == "run":
                assert record.run.run_id == run_id and record.run.project == "recipe-test"
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                for key, value in items.items():
                    if not key.startswith("_"):
                        scalars.setdefault(key, {})[items["_step"]] = value
        lives.append(scalars)
    assert sorted(lives[0]["train/loss"]) == [0, 1, 2, 3] and sorted(lives[1]["train/loss"]) == [2, 3]
    merged = {key: {**lives[0][key], **lives[1].get(key, {})} for key in lives[0]}  # as W&B shows a resumed run
    check_step_scalars(merged, tracked["log"])


def test_a_missing_tracking_package_is_one_line_before_any_work(shards, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    for flag, value in (("--tensorboard", str(tmp_path / "tb")), ("--wandb", "project")):
        with pytest.raises(train_gpt2.UserError, match=f"{flag} needs the {flag[2:]} package, which is not installed; `pip install"):
            train_gpt2.main([*TINY_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"), flag, value])
    assert not (tmp_path / "log").exists() and not (tmp_path / "tb").exists()


# -----------------------------------------------------------------------------
# torch.compile fallback

EAGER_FLAGS = [f for f in TINY_FLAGS if f != "--no_compile"]  # neither --compile nor --no_compile: the default


def test_default_compile_that_cannot_work_is_said_once_and_the_run_goes_on(shards, tmp_path, monkeypatch, capsys):
    """The default asks for compilation (as on CUDA) where Inductor's code generation fails, as it does
    without Triton or a C compiler: the real torch.compile and Dynamo, with the Inductor backend raising."""
    import torch._dynamo
    import torch._inductor.compile_fx

    def no_backend(*args, **kwargs):
        raise RuntimeError("Cannot find a working triton installation (made unavailable by the test)")

    run = ["--data_dir", shards, "--max_steps", "2", "--eval_every", "1", "--save_every", "0"]
    train_gpt2.main([*TINY_FLAGS, *run, "--log_dir", str(tmp_path / "eager")])
    capsys.readouterr()
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", no_backend)
    monkeypatch.setattr(runtime, "compile_by_default", lambda device_type: True)
    torch._dynamo.reset()
    try:
        train_gpt2.main([*EAGER_FLAGS, *run, "--log_dir", str(tmp_path / "fallback")])
    finally:
        torch._dynamo.reset()
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "torch.compile does not work" in line]
    assert len(notes) == 1 and "Cannot find a working triton installation" in notes[0] and "running uncompiled" in notes[0]
    assert "compile False" in out
    assert numbers_logged(tmp_path / "eager") == numbers_logged(tmp_path / "fallback")


def test_explicit_compile_that_cannot_work_is_one_line(shards, tmp_path, monkeypatch):
    def lazy_failure(model, *args, **kwargs):  # torch.compile compiles at the first call, and fails there
        def first_call(*a, **k):
            raise RuntimeError("Cannot find a working triton installation (made unavailable by the test)")
        return first_call

    monkeypatch.setattr(torch, "compile", lazy_failure)
    with pytest.raises(train_gpt2.UserError, match=r"^--compile: torch.compile does not work on cpu here \(RuntimeError: Cannot find "
                                                   r"a working triton installation .*\); run with --no_compile$"):
        train_gpt2.main([*EAGER_FLAGS, "--data_dir", shards, "--log_dir", str(tmp_path / "log"), "--compile"])
    assert not (tmp_path / "log").exists()
    # an explicit --no_compile never probes
    monkeypatch.setattr(runtime, "compile_problem", lambda device: pytest.fail("probed"))
    assert choose_compile(False, "cuda", print) is False
