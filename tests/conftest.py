"""Shared test helpers: tiny shards and tiny training commands. Everything is made here, offline."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Triton kernels (--loss_impl fused's, Liger-Kernel's) run on the CPU in Triton's interpreter, in this process and in
# the scripts the tests start: the variable must be set before a kernel's module is imported (tests/test_fused_head.py)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import train_gpt2  # noqa: E402
from nanogpt.shards import write_shard  # noqa: E402

OPTIONAL = os.path.join(ROOT, ".optional")  # packages only some tests import (.ci/run installs torchao there)


def optional_package(name):
    """Whether the package name can be imported: installed, or in .optional/ (then put on the path: its tests'
    processes, and the scripts they start with optional_path())."""
    import importlib.util

    if importlib.util.find_spec(name) is None and os.path.isdir(os.path.join(OPTIONAL, name)):
        sys.path.append(OPTIONAL)  # (last: torchao's wheel also holds a package named test)
        importlib.invalidate_caches()
    return importlib.util.find_spec(name) is not None


def optional_path():
    """PYTHONPATH for a script that may import an optional package: the project, and .optional/ when there."""
    return os.pathsep.join([ROOT, *([OPTIONAL] if os.path.isdir(OPTIONAL) else [])])  # (a script of ours imports no test)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the full suite's (torchrun, torch.compile, faults, trackers, the data "
                                       "pipeline, the scripts' command lines in fresh processes, the docs' commands); "
                                       "`pytest -m \"not slow\"` is the quick check of a model change")
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU, skipped without CUDA; `pytest -m cuda tests` runs "
                                       "them all (bench/gpu_check.sh does)")
    # `-n N` (pytest-xdist): the tests of a module marked xdist_group go to one worker (--dist loadgroup for -n's
    # load), so that the training runs its module fixtures make are made once, not on each worker
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadgroup"
    if hasattr(config, "workerinput"):  # a worker parses the command line again: its tests' ids name their group
        config.option.loadgroup = True
    # and the N workers share the cores: a thread beyond a worker's share only waits (see one_thread); on 2 cores,
    # `-n 2` of a tiny run took 4x as long at 2 threads a worker as at 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


def cycle_tokens(n, period=48, seed=0):
    """n tokens repeating one random permutation: a next-token rule a tiny model learns in a few steps."""
    rng = np.random.default_rng(seed)
    cycle = rng.choice(50257, size=period, replace=False)
    return np.resize(cycle, n)


def make_shards(data_dir, val_tokens=4096, train_tokens=(20000,), seed=0, random=False):
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = [val_tokens, *train_tokens]
    for i, n in enumerate(sizes):
        split = "val" if i == 0 else "train"
        tokens = rng.integers(0, 50257, n) if random else cycle_tokens(n, seed=seed)
        write_shard(os.path.join(data_dir, f"test_{split}_{i:06d}.bin"), tokens)
    return data_dir


# flags of a few-second CPU run of a very small model
TINY_FLAGS = ["--model", "tiny", "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "32", "--batch_size", "4",
              "--total_batch_size", "256", "--warmup_steps", "2", "--max_lr", "3e-3", "--val_steps", "2",
              "--hellaswag_every", "0", "--sample_every", "0", "--device", "cpu", "--dtype", "fp32", "--no_compile",
              "--no_shuffle"]
# TINY_FLAGS less --model/--n_layer/--n_head/--n_embd and their values (an --init_from run's shape is
# its weights'), one step unless told
SHAPE_FLAGS = ("--model", "--n_layer", "--n_head", "--n_embd")
TINY_RUN_FLAGS = [flag for before, flag in zip([None, *TINY_FLAGS], TINY_FLAGS)
                  if flag not in SHAPE_FLAGS and before not in SHAPE_FLAGS] + ["--max_steps", "1"]


def read_log(log_dir):
    """{kind: {step: value}} from log.txt, parsed independently of the trainer; each step's time (`step_ms`) left
    out, as it differs between runs of the same numbers."""
    out = {}
    with open(os.path.join(log_dir, "log.txt")) as f:
        for line in f:
            step, kind, value = line.split()[:3]
            if kind != "step_ms":
                out.setdefault(kind, {})[int(step)] = float(value)
    return out


# log.txt's kinds that describe the run rather than its numbers (nanogpt/log_kinds.py), typed in here
RUN_KINDS = ("step_ms", "params", "val_fineweb_edu")


def numbers_logged(log_dir):
    """log.txt's text without its step_ms lines (each step's time, which differs from run to run): what two runs of
    the same numbers (a straight run and a resumed one, say) write alike, byte for byte."""
    with open(os.path.join(log_dir, "log.txt")) as f:
        return "".join(line for line in f if line.split()[1:2] != ["step_ms"])


def build_nanogpt_lines(log_dir):
    """log.txt's text without the lines that describe the run (RUN_KINDS): the lines build-nanogpt's loop writes."""
    with open(os.path.join(log_dir, "log.txt")) as f:
        return "".join(line for line in f if not set(line.split()[1:2]) & set(RUN_KINDS))


STEP_RE = re.compile(r"step\s+(\d+)/\d+ \| loss ([\d.]+) \| lr \S+ (?:\| muon lr \S+ )?\| norm ([\d.]+)")
NORM_TOL = 2e-4  # two norms printed to 4 decimals: 2 x 5e-5 of rounding, and as much again for float noise


def step_norms(stdout):
    """{step: gradient norm before clipping} from the trainer's step lines on stdout (4 decimals)."""
    return {int(m.group(1)): float(m.group(3)) for m in STEP_RE.finditer(stdout)}


def assert_same_norms(ref_stdout, stdout, steps, parted=0.0):
    """The runs logged the same gradient norms at these steps, up to printing and float rounding.
    Losses and weights cannot tell a gradient summed over ranks from an averaged one (clipping caps
    it, AdamW divides its scale out); its norm is 2x, and these norms are far above NORM_TOL. parted: where
    the runs' weights differ by rounding before a step (sums in another order at earlier steps, which training
    amplifies, Muon's orthogonalisation most), how far their norms may part then, relative to the norm."""
    ref, got = step_norms(ref_stdout), step_norms(stdout)
    assert steps and set(steps) <= ref.keys() and set(steps) <= got.keys(), (sorted(steps), sorted(ref), sorted(got))
    assert all(ref[s] > 100 * NORM_TOL for s in steps), ref
    assert all(abs(ref[s] - got[s]) <= NORM_TOL + parted * ref[s] for s in steps), ("norm", ref, got)


def run_script(args, cwd=ROOT, env=None, timeout=300):
    full_env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, *needles):
    """A user error: non-zero exit, no traceback, one line on stderr that says what is wrong."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def train(data, log_dir, *extra):
    """A tiny CPU run of train_gpt2 in this process."""
    return train_gpt2.main([*TINY_FLAGS, "--data_dir", data, "--log_dir", log_dir, *extra])


def truncate_half(path):
    """What a crash mid-copy or a full disk leaves: the first half of a file."""
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def load_weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def max_weight_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def torchrun(nproc, *args):
    return run_script(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train_gpt2.py", *args], timeout=400)


@pytest.fixture
def shards(tmp_path):
    return make_shards(str(tmp_path / "data"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine its waiting makes
    each op up to 100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def script_cli(capsys, main, *argv):
    """(exit code, stdout, stderr) of a script's command line, run in this process as `python SCRIPT.py`
    runs it (run_cli: a UserError is one line and exit 2; any other exception is a traceback)."""
    from nanogpt.cli import run_cli

    capsys.readouterr()
    code = 0
    try:
        run_cli(lambda: main([str(a) for a in argv]))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def fineweb_cli(capsys, *argv):
    """script_cli of fineweb.py."""
    import fineweb

    return script_cli(capsys, fineweb.main, *argv)


def assert_cli_error(result, *needles):
    """script_cli's result is a user error: exit 2, one `error:` line naming the needles, no traceback."""
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (code, err)
    for needle in needles:
        assert needle in lines[0], lines[0]


def peaked_tiny_gpt(seed=0, block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, **options):
    """A tiny GPT in eval mode whose logits have clear winners: at init (std 0.02) they are nearly tied,
    so rounding could flip an argmax; scaling the matrices x15 separates them. options: other GPTConfig fields."""
    torch.manual_seed(seed)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer,
                                                n_head=n_head, n_embd=n_embd, **options))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(15)
    return model.eval()


def save_random_hf_gpt2(path):
    """A random tiny transformers GPT-2 (2 layers, 64 wide, context 128) saved at path, what --init_from DIR loads:
    path. Its matrices are drawn with std 0.3, not the 0.02 init, so that continuations' losses differ clearly (no
    near-ties)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=50257))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


def write_hellaswag(path, n=24):
    """n HellaSwag-format lines of random words (labels cycling 0-3); returns path."""
    words = "the a cat dog runs jumps over under house river quickly slowly blue red man woman".split()
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for i in range(n):
            pick = lambda k: " ".join(words[j] for j in torch.randint(0, len(words), (k,), generator=g).tolist())  # noqa: E731
            f.write(json.dumps({"ctx": pick(8), "endings": [pick(3 + (e + i) % 5) for e in range(4)], "label": i % 4}) + "\n")
    return path


def straight_and_resumed(tmp, extra):
    """A 6-step run of TINY_FLAGS + extra, validated at steps 0, 2, 4 and 5 and checkpointed after steps 1, 3 and
    5, straight; and the same run killed after step 3's checkpoint and resumed: {tmp, data, flags, straight,
    resumed}."""
    data = make_shards(str(tmp / "data"))
    flags = [*TINY_FLAGS, *extra, "--data_dir", data, "--max_steps", "6", "--eval_every", "2", "--save_every", "2",
             "--total_batch_size", "512"]
    straight, resumed = str(tmp / "straight"), str(tmp / "resumed")
    train_gpt2.main([*flags, "--log_dir", straight])
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("model_00005.pt"))
    train_gpt2.main([*flags, "--log_dir", resumed, "--resume"])
    return {"tmp": tmp, "data": data, "flags": flags, "straight": straight, "resumed": resumed}


def copy_of_run(runs, name):
    """A copy of straight_and_resumed's straight run in a folder of its own: its path."""
    log_dir = str(runs["tmp"] / name)
    shutil.copytree(runs["straight"], log_dir)
    return log_dir


def assert_two_processes_train_like_one(runs, capsys):
    """DDP over 2 gloo processes against one process with the same total batch (runs: straight_and_resumed's):
    the same sums in another order (the DDP test's bounds), and the same gradient norms (averaged over the ranks,
    not summed)."""
    capsys.readouterr()
    one_dir, two_dir = str(runs["tmp"] / "one"), str(runs["tmp"] / "two")
    flags = [*runs["flags"], "--eval_every", "0", "--max_steps", "4"]
    train_gpt2.main([*flags, "--log_dir", one_dir])
    one_out = capsys.readouterr().out
    both = torchrun(2, *flags, "--log_dir", two_dir)
    assert both.returncode == 0, both.stderr[-3000:]
    a, b = read_log(one_dir)["train"], read_log(two_dir)["train"]
    assert a.keys() == b.keys() == set(range(4))
    assert all(abs(a[s] - b[s]) < 1e-4 for s in a), (a, b)
    assert_same_norms(one_out, both.stdout, range(1))  # the same weights: rounding alone
    # later, weights parted by rounding (~1e-7 of each sum); a sum in place of a mean would be off by 2x
    assert_same_norms(one_out, both.stdout, range(1, 4), parted=1e-3)


def assert_refused_before_any_work(capsys, data, tmp_path, extra, *named, max_steps=1):
    """A tiny run with these flags is one `error:` line naming `named`, and makes no log folder."""
    result = script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--data_dir", data, "--log_dir", tmp_path / "log",
                        "--max_steps", str(max_steps), *extra)
    assert_cli_error(result, *named)
    assert not (tmp_path / "log").exists()


def random_tokens(rows=2, n=32, seed=0):
    """(rows, n) token ids of GPT-2's vocabulary, from a fixed generator."""
    return torch.randint(0, 50257, (rows, n), generator=torch.Generator().manual_seed(seed))


def moved_from_init(model, scale):
    """model in eval mode, every parameter (gains, zero-initialised projections, learned scalars too) moved by
    scale x N(0, 1) noise from where it started, so that each piece shows in the logits."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


# -----------------------------------------------------------------------------
# Output files that are not plain files (tests of --json, --out)


def fifo_with_reader(path):
    """A FIFO at path and a thread that opens it and reads it to the end: (the thread, a list that gets what it
    read). Join the thread with a timeout: a FIFO replaced by a file leaves the reader waiting for ever."""
    os.mkfifo(path)
    got = []

    def read():
        with open(path, "rb") as f:
            got.append(f.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, got


def safe_char_device(tmp_path):
    """A character device that writing to harms nothing and that code which replaces its output cannot take away
    from the system: a twin of /dev/null made in tmp_path (os.mknod, where we may); else /dev/null itself, when
    we cannot create files in /dev; else the test is skipped."""
    twin = str(tmp_path / "null")
    null = os.stat(os.devnull)
    try:
        os.mknod(twin, 0o666 | stat.S_IFCHR, null.st_rdev)
        return twin
    except (OSError, AttributeError):
        pass
    if os.access("/dev", os.W_OK):
        pytest.skip("cannot make a device node here, and /dev is writable: /dev/null would be at risk")
    return os.devnull


def descriptor_link(tmp_path, f):
    """A link to /proc/self/fd/N of the open file f, as /dev/stdout is to fd 1: tmp_path/stdout."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd")
    link = tmp_path / "stdout"
    os.symlink(f"/proc/self/fd/{f.fileno()}", link)
    return str(link)


def count_validation_tokens(monkeypatch):
    """A list that each batch the val split's loader hands out adds its tokens to (DataLoaderLite.next_batch
    watched): the tokens validation reads, counted as the loader gives them."""
    read, next_batch = [], train_gpt2.DataLoaderLite.next_batch

    def counted(self, *args, **kwargs):
        x, y = next_batch(self, *args, **kwargs)
        if "_val_" in self.found_names[0]:
            read.append(x.numel())
        return x, y

    monkeypatch.setattr(train_gpt2.DataLoaderLite, "next_batch", counted)
    return read
