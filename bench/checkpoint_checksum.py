"""
What the checksum in every checkpoint costs: save_checkpoint and load_checkpoint of a d12 run's
checkpoint (GPT-2 124M, with AdamW's state), with the checksum and without it (torch.save through the
same atomic write; a bare torch.load), and the checksum alone (not part of the tests).

    python bench/checkpoint_checksum.py                 # d12: ~124M parameters, a 1.5 GB file
    python bench/checkpoint_checksum.py --model tiny --dir /tmp

Each is timed --reps times, the two alternating: save without, save with, ..., then load without, load
with, ... (the files are then in the page cache, as after a save: what a resume right after a crash finds;
a cold read adds the disk's time to both loads alike).
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanogpt.checkpoints import content_sha256, load_checkpoint, save_checkpoint  # noqa: E402
from nanogpt.files import CPUS, atomic_write  # noqa: E402
from train_gpt2 import GPT, MODEL_PRESETS, GPTConfig  # noqa: E402


def timed(what, f):
    start = time.perf_counter()
    out = f()
    print(f"{what:<28} {time.perf_counter() - start:6.2f} s", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="d12", choices=list(MODEL_PRESETS))
    p.add_argument("--dir", default=None, help="where the two files go (default: a temporary folder)")
    p.add_argument("--reps", type=int, default=2, help="times each is timed")
    args = p.parse_args()
    torch.manual_seed(0)
    shape = {k: v for k, v in MODEL_PRESETS[args.model].items() if k in ("n_layer", "n_head", "n_embd")}
    model = GPT(GPTConfig(**shape))
    optimizer = torch.optim.AdamW(model.parameters())
    for p_ in model.parameters():  # one step, so that AdamW's state exists
        p_.grad = torch.randn_like(p_)
    optimizer.step()
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 0, "config": {}}
    params = sum(p_.numel() for p_ in model.parameters())
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        plain, checked = os.path.join(d, "plain.pt"), os.path.join(d, "checked.pt")

        def save_plain():
            with atomic_write(plain) as f:
                torch.save(checkpoint, f)

        print(f"{args.model}: {params / 1e6:.0f}M parameters, {CPUS} cores, torch {torch.__version__}")
        for _ in range(args.reps):
            timed("save, no checksum", save_plain)
            timed("save_checkpoint (checksum)", lambda: save_checkpoint(checked, checkpoint))
        print(f"file: {os.path.getsize(checked) / 1e9:.2f} GB")
        for _ in range(args.reps):
            timed("torch.load, no checksum", lambda: torch.load(plain, map_location="cpu", weights_only=True))
            loaded = timed("load_checkpoint (checked)", lambda: load_checkpoint(checked))
        timed("the checksum alone", lambda: content_sha256(loaded))


if __name__ == "__main__":
    main()
