"""Parameters placed by role (nanogpt.optimizers.parameters_by_role): today's recipes get the groups they always
had, in the same order (so their checkpoints load and resume exactly); a 2-D weight outside the blocks is a matrix
(Muon's); a parameter no rule places is refused by name."""

import pytest
import torch
import torch.nn as nn

import train_gpt2
from nanogpt.cli import UserError
from nanogpt.optimizers import OptimizerSettings

SMALL = dict(block_size=16, n_layer=2, n_head=2, n_embd=16)
RECIPES = {  # the recipes' models and configure_optimizers' arguments as set_up passes them
    "gpt2": (dict(arch="gpt2"), ("adamw", None, None)),
    "modern": (dict(arch="llama"), ("muon", 0.02, None)),
    "speedrun": (dict(arch="speedrun"), ("muon", 0.04, {"embed": 0.3, "head": 0.008, "scalar": 0.04})),
}


MUON = OptimizerSettings("muon", 1e-3, 0.1, flags={"muon_lr": 0.02})


def model_of(arch_fields):
    torch.manual_seed(0)
    return train_gpt2.make_gpt(train_gpt2.GPTConfig(**SMALL, **arch_fields))


def groups_before(model, optimizer, rates):
    """The groups' parameter names by the rule this change replaced: Muon took the 2-D weights of transformer.h,
    AdamW the rest in model.parameters()' order, split by dimension or (with rates) by matrix, embed, head, scalar."""
    names = {id(p): n for n, p in model.named_parameters()}
    matrices = [p for p in model.transformer.h.parameters() if p.dim() == 2] if optimizer == "muon" else []
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    lookups = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]

    def role(p):
        if any(p is e for e in lookups):
            return "embed"
        return "head" if p is model.lm_head.weight else "scalar" if p.dim() < 2 else "matrix"

    if rates:
        adamw = [[p for p in rest if role(p) == r] for r in ("matrix", "embed", "head", "scalar")]
    else:
        adamw = [[p for p in rest if p.dim() >= 2], [p for p in rest if p.dim() < 2]]
    groups = ([matrices] if matrices else []) + [g for g in adamw if g or not rates]
    return [[names[id(p)] for p in g] for g in groups]


def groups_now(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_todays_recipes_keep_their_groups_in_their_order(recipe):
    arch_fields, (kind, muon_lr, rates) = RECIPES[recipe]
    model = model_of(arch_fields)
    optimizer = model.configure_optimizers(OptimizerSettings(kind, 1e-3, 0.1, rates, {"muon_lr": muon_lr}), "cpu")
    assert groups_now(model, optimizer) == groups_before(model, kind, rates)


def test_a_matrix_outside_the_blocks_goes_to_muon():
    model = model_of(dict(arch="llama"))
    model.extra_head = nn.Linear(16, 16, bias=False)  # e.g. a second prediction head beside lm_head
    optimizer = model.configure_optimizers(MUON, "cpu")
    assert any(p is model.extra_head.weight for p in optimizer.matrices.param_groups[0]["params"])
    assert not any(p is model.extra_head.weight for g in optimizer.adamw.param_groups for p in g["params"])


def test_a_parameter_no_rule_places_is_refused_by_name():
    model = model_of(dict(arch="llama"))
    model.conv = nn.Parameter(torch.zeros(2, 2, 2))
    with pytest.raises(UserError, match="parameter conv .3-D. has no optimizer role"):
        model.configure_optimizers(MUON, "cpu")
