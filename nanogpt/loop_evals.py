"""
What the training loop measures besides HellaSwag and CORE (nanogpt.hellaswag_eval, nanogpt.core_eval): the
loss on the first batches of the validation split, and samples of the model's text.
"""

import torch
import torch.nn as nn

from nanogpt.runtime import all_reduce_mean
from nanogpt.tokenizer import SAMPLE_PROMPT, decode_sample, format_sample


class Evaluated(nn.Module):
    """The model as the loop's evaluations call it: a module of its own, so that torch.compile gives them graphs of
    their own. Dynamo remembers the shapes each compiled frame has seen; through the training module, HellaSwag's
    and CORE's other shapes would make it compile the training graph with dynamic batch and length."""

    def __init__(self, model):
        super().__init__()
        self.module = model  # nanogpt.evaluation.unwrap finds the GPT here

    def forward(self, idx, targets=None):
        return self.module(idx, targets)


def evaluation_model(model, use_compile):
    """What validation, HellaSwag and CORE run: the model in an Evaluated of its own, compiled when training is
    (its first graph is validation's static one; another shape makes it dynamic, as evaluations need)."""
    evaluated = Evaluated(model)
    return torch.compile(evaluated) if use_compile else evaluated


@torch.no_grad()
def validation_loss(model, loader, steps, device, autocast, ddp, world_size, loss_of):
    """Mean loss over the first `steps` batches of the val split (the same ones every time); loss_of: the loop's
    objective (train_gpt2.batch_loss)."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=device)
    for _ in range(steps):
        x, y = loader.next_batch()
        with autocast:
            loss, _ = loss_of(model, x.to(device), y.to(device))
        total += loss.detach().float() / steps
    return all_reduce_mean(total, ddp, world_size).item()


def sample_lines(model, tokenizer, device, autocast, seed, num_samples=4, length=32):
    """The loop's samples: continuations of SAMPLE_PROMPT, as in build-nanogpt."""
    prompt = torch.tensor([tokenizer.encode(SAMPLE_PROMPT)] * num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with autocast:
        out = model.generate(prompt, length - prompt.size(1), top_k=50, generator=gen)
    return [format_sample(i, num_samples, decode_sample(tokenizer, row)) for i, row in enumerate(out.tolist())]
