"""
Muon beside AdamW, stepped as one optimizer (train_gpt2.py --optimizer muon): torch.optim.Muon
orthogonalises the update of each weight matrix of the blocks (Newton-Schulz iterations, in PyTorch itself
since 2.9); AdamW takes the embedding, the output head and the 1-D parameters, as in nanochat and
modded-nanogpt.
"""

import torch


class MuonWithAdamW:
    """Two optimizers the training loop uses as one: its param_groups are both's (Muon's first, each with
    an "lr_scale" that the loop multiplies the scheduled learning rate by: --muon_lr / --max_lr), step() and
    zero_grad() act on both, and state_dict() holds both (Muon's momentum buffers too), so a resumed run
    continues exactly."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw
        self.lr_scale = [group["lr_scale"] for group in muon.param_groups]

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self):
        return {**self.muon.state, **self.adamw.state}

    def step(self):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state):
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
        for group, scale in zip(self.muon.param_groups, self.lr_scale):  # this run's --muon_lr, not the saved one
            group["lr_scale"] = scale


def muon_with_adamw(matrices, adamw, muon_lr, max_lr):
    """torch.optim.Muon over `matrices` (at muon_lr, no weight decay, as modded-nanogpt), with adamw."""
    muon = torch.optim.Muon([{"params": matrices, "lr_scale": muon_lr / max_lr if max_lr else 1.0}], lr=muon_lr,
                            weight_decay=0.0)
    return MuonWithAdamW(muon, adamw)


def rates_beside(optimizer):
    """The learning rates of the optimizers stepped beside AdamW, by name, for the step line and the trackers:
    {"muon": Muon's rate} beside AdamW, else {}."""
    return {"muon": optimizer.muon.param_groups[0]["lr"]} if isinstance(optimizer, MuonWithAdamW) else {}
