"""
What the training loop measures besides HellaSwag and CORE (nanogpt.hellaswag_eval, nanogpt.core_eval): the
loss on the first batches of the validation split, and samples of the model's text.
"""

import torch
import torch.nn as nn

from nanogpt.evaluation import out_of_memory_said
from nanogpt.runtime import all_reduce_mean
from nanogpt.tokenizer import SAMPLE_PROMPT, decode_sample, format_sample, prompt_tokens


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
def validation_loss(model, loader, steps, device, autocast, ddp, world_size, loss_of, micro_batch=None):
    """Mean loss over the first `steps` batches of the val split (the same ones every time), each read in
    pieces of the largest divisor of its rows up to micro_batch (the run's micro-batch now, which an out-of-memory
    retry may have made smaller): the tokens validated do not depend on it. loss_of: the loop's objective
    (train_gpt2.batch_loss)."""
    model.eval()
    loader.reset()
    rows = next(b for b in range(min(micro_batch or loader.B, loader.B), 0, -1) if loader.B % b == 0)
    pieces = loader.B // rows
    total = torch.zeros((), device=device)
    for _ in range(steps):
        x, y = loader.next_batch()
        for xs, ys in zip(x.split(rows), y.split(rows)):
            with autocast:
                loss, _ = loss_of(model, xs.to(device), ys.to(device))
            total += loss.detach().float() / (steps * pieces)
    return all_reduce_mean(total, ddp, world_size).item()


def sample_lines(model, tokenizer, device, autocast, seed, prompt=SAMPLE_PROMPT, num_samples=4, new_tokens=24):
    """The loop's samples: continuations of prompt (--sample_prompt) by new_tokens tokens each, as in build-nanogpt
    (32 tokens in all with its 8-token prompt, SAMPLE_PROMPT)."""
    prompt = torch.tensor([prompt_tokens(tokenizer, prompt)] * num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    fix = ("the training loop's --batch_size does not size them: pass --sample_every 0 to turn them off, and sample "
           "the saved checkpoints with generate_tokens.py")
    with out_of_memory_said(device, f"{num_samples} samples in the training loop", fix), autocast:
        out = model.generate(prompt, new_tokens, top_k=50, generator=gen)
    return [format_sample(i, num_samples, decode_sample(tokenizer, row)) for i, row in enumerate(out.tolist())]
