"""
A next token drawn from a model's logits, as GPT.generate draws each one: greedy, or softmax sampling at a
temperature within the top k tokens and the top p of the probability.
"""

import torch


def sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row from logits (B, V): greedy at temperature 0, else softmax sampling
    restricted to the top_k tokens and to the smallest set whose probability reaches top_p."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum - sorted_logits.softmax(dim=-1) >= top_p  # mass before this token already reaches top_p
        drop = drop_sorted.scatter(1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)
