"""A torchrun worker for tests/test_fsdp_small_tensors.py: the weights' health check under --fsdp when a
tensor has fewer rows than there are ranks.

    torchrun --standalone --nproc_per_node=2 tests/fsdp_health_worker.py

Every rank builds the same tiny speedrun GPT with n_layer 2 (skip_weights: 1 row, so rank 1's shard of
it is empty) and shards it as --fsdp does. Each rank prints `rank R: empty shards N, healthy H, after a
NaN on rank 0: B` (B: the check after rank 0 alone puts a NaN in its shard of the token embedding).
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_gpt2  # noqa: E402
from nanogpt.run import weights_finite  # noqa: E402
from nanogpt.sharding import shard_model  # noqa: E402


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = train_gpt2.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, arch="speedrun")
    model = shard_model(train_gpt2.make_gpt(config), "fp32", "cpu", use_compile=False)
    empty = sum(p.to_local().numel() == 0 for p in model.parameters())
    healthy = weights_finite(model)
    if rank == 0:
        with torch.no_grad():
            model.transformer.wte.weight.to_local()[0, 0] = float("nan")
    # one write of the whole line: the ranks share torchrun's stdout, and print() writes the text and its newline apart
    os.write(1, f"rank {rank}: empty shards {empty}, healthy {healthy}, after a NaN on rank 0: {weights_finite(model)}\n"
             .encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
