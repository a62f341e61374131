"""A layer whose cost depends on the values (a mixture of experts' top-k routing) declares it, and the counts read the
declaration (nanogpt.runtime says how): MFU's FLOPs count the active share of its parameters, on the meta device where
the layer runs there and by the formula where its routing cannot; the memory estimate adds the activations it declares
beyond the formula's one MLP; and a layer the meta device cannot run that declares nothing is named, while no model
option has one. The mixture of experts is written here: a router picks 2 of 4 MLPs (the config's) for each token.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_layer_costs.py
"""

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import train_gpt2
from nanogpt.arguments import mlp_kept_bytes
from nanogpt.runtime import counted_flops_per_token, uncounted_layer
from test_memory_estimate import BLOCKS_SHAPE, MODEL_OPTIONS, assert_estimate_is_the_measured_peak, memory_table  # noqa


class TopKExperts(nn.Module):
    """A mixture-of-experts MLP: a router's softmax over the experts (in fp32), the k largest for each token; its
    output the k experts' outputs weighted by those. Each expert runs on its tokens only (their shapes depend on the
    values: the meta device cannot run it); dense, every expert runs on every token, weighted by 0 where not chosen
    (the same numbers at E / k times the matrix multiplications)."""

    def __init__(self, config, experts=4, k=2, dense=False):
        super().__init__()
        self.config, self.k, self.dense = config, k, dense
        self.router = nn.Linear(config.n_embd, experts, bias=False)
        self.experts = nn.ModuleList(train_gpt2.MLP(config) for _ in range(experts))

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))
        weights, chosen = self.router(flat).float().softmax(-1).topk(self.k, dim=-1)
        if self.dense:
            gates = torch.zeros(flat.size(0), len(self.experts), device=x.device).scatter(1, chosen, weights)
            return sum(expert(flat) * gates[:, e, None] for e, expert in enumerate(self.experts)).view_as(x)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            out = out.index_add(0, rows, (expert(flat[rows]) * weights[rows, slot, None]).to(out.dtype))
        return out.view_as(x)


class DeclaredTopKExperts(TopKExperts):
    """TopKExperts with its cost declared: k of E experts active for each token, and its activations."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.experts.active_fraction = self.k / len(self.experts)

    def extra_activation_bytes(self, a):
        """Per token, beyond one MLP's (the formula's): k - 1 more MLPs' worth (each routed row's input and hidden
        activations); the router's input (under autocast its copy), its fp32 softmax (E) and the top-k's int64
        indices; and for each routed row its int64 row and slot, the fp32 weight gathered for it, the expert's output
        in the compute dtype (the product keeps it) and the fp32 product (index_add keeps its source)."""
        C, E, k = self.config.n_embd, len(self.experts), self.k
        router = (a * C if a < 4 else 4 * C) + 4 * E + 8 * k
        return (k - 1) * mlp_kept_bytes(self.config, a) + router + k * (8 + 8 + 4 + a * C + 4 * C)


CONFIG = train_gpt2.GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64)


def with_mlp(monkeypatch, layer):
    """Every block's MLP is layer(config) (pieces_of chooses it)."""
    pieces_of = train_gpt2.pieces_of
    monkeypatch.setattr(train_gpt2, "pieces_of", lambda config: dataclasses.replace(pieces_of(config), mlp=layer))


def flops_of_a_real_step(model, T):
    """The FLOPs per token torch's counter sees in a training step of model on the CPU over T random tokens: the
    experts' matrix multiplications on the rows routed to them only, attention as the batched products of SDPA's math
    kernel (the CPU's fused kernel is not counted)."""
    x = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss, _ = train_gpt2.batch_loss(model, x, x)
        loss.backward()
    return counter.get_total_flops() / T


def test_the_formula_counts_the_experts_a_token_goes_through(monkeypatch):
    """Routed experts cannot run on the meta device, so MFU's FLOPs come from the formula, 6 per active weight a
    token and 12·L·C·T: against the count of a real step, over only by 6 per 1-D parameter a token goes through
    (biases and gains, which multiply nothing), the experts' at k / E."""
    with_mlp(monkeypatch, DeclaredTopKExperts)
    torch.manual_seed(0)
    model = train_gpt2.GPT(CONFIG)
    k_of_e = 2 / 4
    one_d = sum(p.numel() * (k_of_e if ".experts." in name else 1)
                for name, p in model.named_parameters() if p.dim() == 1)
    assert model.flops_per_token() - flops_of_a_real_step(model, CONFIG.block_size) == 6 * one_d


def test_a_layer_the_meta_device_runs_is_counted_at_its_active_share(monkeypatch):
    """Every expert on every token (dense) runs on the meta device; counted at the declared k / E of the experts'
    FLOPs, it is the real step of the routed experts, operation for operation."""
    with_mlp(monkeypatch, lambda config: DeclaredTopKExperts(config, dense=True))
    dense = counted_flops_per_token(lambda: train_gpt2.GPT(CONFIG), train_gpt2.batch_loss, CONFIG.block_size)
    with_mlp(monkeypatch, DeclaredTopKExperts)
    assert dense == flops_of_a_real_step(train_gpt2.GPT(CONFIG), CONFIG.block_size)


def test_a_routed_layer_that_declares_nothing_is_named(monkeypatch):
    count = lambda: uncounted_layer(lambda: train_gpt2.GPT(CONFIG), train_gpt2.batch_loss, CONFIG.block_size)  # noqa
    with_mlp(monkeypatch, TopKExperts)
    assert count() == "transformer.h.0.mlp (TopKExperts)"
    with_mlp(monkeypatch, DeclaredTopKExperts)
    assert count() is None


@pytest.mark.parametrize("options", MODEL_OPTIONS)
def test_every_model_options_layers_are_counted(memory_table, options):  # noqa: F811 (the fixture)
    """No layer of any model option is one the meta device cannot run that declares nothing (a new option with
    routing, say, goes into test_memory_estimate.py's MODEL_OPTIONS, and this names its layer)."""
    args, config = memory_table.model_and_flags(f"{BLOCKS_SHAPE} {options}".split())
    assert uncounted_layer(lambda: train_gpt2.make_gpt(config), train_gpt2.batch_loss, 16) is None


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_the_memory_estimate_adds_what_a_routed_layer_declares(memory_table, monkeypatch, dtype):  # noqa: F811
    """At top-2 of 4 where the blocks dominate, the estimate, with the activations the layer declares, is the peak
    of the tensors a training step holds (without them it was 25% low in fp32, 18% in bf16)."""
    with_mlp(monkeypatch, DeclaredTopKExperts)
    assert_estimate_is_the_measured_peak(memory_table, f"{BLOCKS_SHAPE} --recipe gpt2 --dtype {dtype}")
