"""
What the training loop measures besides HellaSwag and CORE (nanogpt.hellaswag_eval, nanogpt.core_eval): the
loss on the first batches of the validation split, and samples of the model's text.
"""

import torch

from nanogpt.runtime import all_reduce_mean
from nanogpt.tokenizer import SAMPLE_PROMPT, decode_sample, format_sample


@torch.no_grad()
def validation_loss(model, loader, steps, device, autocast, ddp, world_size):
    """Mean loss over the first `steps` batches of the val split (the same ones every time)."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=device)
    for _ in range(steps):
        x, y = loader.next_batch()
        with autocast:
            _, loss = model(x.to(device), y.to(device))
        total += loss.detach().float() / steps
    return all_reduce_mean(total, ddp, world_size).item()


def sample_lines(model, tokenizer, device, autocast, seed, num_samples=4, length=32):
    """The loop's samples: continuations of SAMPLE_PROMPT, as in build-nanogpt."""
    prompt = torch.tensor([tokenizer.encode(SAMPLE_PROMPT)] * num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with autocast:
        out = model.generate(prompt, length - prompt.size(1), top_k=50, generator=gen)
    return [format_sample(i, num_samples, decode_sample(tokenizer, row)) for i, row in enumerate(out.tolist())]
