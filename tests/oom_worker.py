"""train_gpt2.py's command line with an out-of-memory injected into the model's forward, for tests/test_fitting.py
(also under torchrun): a forward of more rows than OOM_ABOVE_RANK<rank> (a comma-separated list, one limit per
rank) raises torch.OutOfMemoryError, as a GPU that is too small would.

    torchrun --standalone --nproc_per_node=2 tests/oom_worker.py TRAIN_GPT2_FLAGS...   (OOM_ABOVE=4,2)
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_gpt2  # noqa: E402
from nanogpt.cli import run_cli  # noqa: E402


def failing_above(limit):
    forward = train_gpt2.GPT.forward

    def limited(self, idx, *args, **kwargs):
        if idx.size(0) > limit:
            raise torch.OutOfMemoryError(f"injected: {idx.size(0)} rows > {limit}")
        return forward(self, idx, *args, **kwargs)
    return limited


if __name__ == "__main__":
    limits = [int(x) for x in os.environ["OOM_ABOVE"].split(",")]
    train_gpt2.GPT.forward = failing_above(limits[int(os.environ.get("RANK", 0))])
    run_cli(lambda: train_gpt2.main(sys.argv[1:]))
