"""A torchrun worker for tests/test_scale.py: the optimizer state a --zero 1 checkpoint stores, taken
both ways from one ZeroRedundancyOptimizer.

    torchrun --standalone --nproc_per_node=3 tests/zero_state_worker.py OUT.pt

Every rank builds the same small GPT (a 64-token vocabulary, so that no tensor dominates and every
rank owns several of them), takes two AdamW steps with the same random gradients, then calls
gathered_state_dicts (what a checkpoint saves) and ZeroRedundancyOptimizer's own
consolidate_state_dict(to=0) + state_dict(). Rank 0 writes both to OUT.pt, with the rank that owns
each parameter index.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_gpt2  # noqa: E402
from nanogpt.cli import run_cli
from nanogpt.optimizers import OptimizerSettings  # noqa: E402
from nanogpt.sharding import gathered_state_dicts, zero_redundancy  # noqa: E402


def main():
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    optimizer = zero_redundancy(model.configure_optimizers(OptimizerSettings(max_lr=1e-3, weight_decay=0.1), "cpu"))
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    _, streamed = gathered_state_dicts(model, optimizer, zero=True, fsdp=False, master=rank == 0)
    optimizer.consolidate_state_dict(to=0)
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    owned = [index[id(p)] for p in optimizer.optim.state]
    owners = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(owned, owners, dst=0)
    if rank == 0:
        owner = {i: r for r, indices in enumerate(owners) for i in indices}
        torch.save({"streamed": streamed, "consolidated": optimizer.state_dict(), "owner": owner}, out_path)
    dist.barrier()


if __name__ == "__main__":
    run_cli(main)
