"""An optimizer with modes for the tests, as schedule-free's torch optimizers have them, and its entry of the optimizer
table (nanogpt.optimizers.MATRIX_OPTIMIZERS): AdamW on the whole model whose eval() puts an exponential moving average
of the weights into the model and train() the trained weights back, trained with a held learning rate only. As a
script, train_gpt2.py with the entry added as --optimizer averaged (torchrun runs it as it runs train_gpt2.py):

    torchrun --standalone --nproc_per_node=2 tests/averaged_adamw.py --model tiny --optimizer averaged \
        --lr_schedule wsd --warmdown_frac 0

AVERAGED_DECAY in the environment sets the average's decay (default 0.5; 1: the average stays the initial weights).
"""

import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanogpt.optimizers import MatrixOptimizer  # noqa: E402


class AveragedAdamW(torch.optim.AdamW):
    """AdamW, and an average of the weights, each step average <- decay * average + (1 - decay) * weights, from the
    weights before the first step. eval(): the average into the model, the trained weights kept in the state; train():
    those back (also after loading a state saved in eval mode). As schedule-free's, it starts in eval mode, its mode is
    in its param_groups (so in its state dict), and a step in eval mode is refused. Before the first step the average
    is the weights."""

    group_state = ("train_mode",)  # its own, in its groups: a resume takes it from the checkpoint (with_settings_of)

    def __init__(self, params, decay, **kwargs):
        super().__init__(params, **kwargs)
        self.decay = decay
        for group in self.param_groups:
            group["train_mode"] = False

    def weights(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        if not self.param_groups[0]["train_mode"]:
            raise RuntimeError("AveragedAdamW: a step in eval mode; call train() first")
        first = {p: p.clone() for p in self.weights() if p not in self.state}  # (AdamW makes its state in step)
        super().step()
        for p in self.weights():
            if "average" not in self.state[p]:
                self.state[p]["average"] = first[p]
            self.state[p]["average"].lerp_(p, 1 - self.decay)

    @torch.no_grad()
    def eval(self):
        for group in self.param_groups:
            for p in group["params"] if group["train_mode"] else []:
                if "average" in self.state.get(p, {}):
                    self.state[p]["trained"] = p.clone()
                    p.copy_(self.state[p]["average"])
            group["train_mode"] = False

    @torch.no_grad()
    def train(self):
        for group in self.param_groups:
            for p in [] if group["train_mode"] else group["params"]:
                if "trained" in self.state.get(p, {}):
                    p.copy_(self.state[p].pop("trained"))
            group["train_mode"] = True


def make_averaged(groups, rate, settings, process_group, decay):
    return AveragedAdamW(groups, decay, lr=rate, betas=(0.9, 0.95), eps=1e-8), None


def averaged_entry(decay=0.5):
    """The table's entry: the whole model, modes, a held rate only; AdamW's 8 bytes of state a parameter and the
    average's 4."""
    return MatrixOptimizer(functools.partial(make_averaged, decay=decay), "AveragedAdamW", state_bytes=12,
                           shardable=False, fp16=False, takes="model", schedules=("held",), modes=True,
                           about="averaged: AdamW evaluated with an average of its weights")


if __name__ == "__main__":
    import train_gpt2
    from nanogpt import optimizers
    from nanogpt.cli import run_cli

    optimizers.MATRIX_OPTIMIZERS["averaged"] = averaged_entry(float(os.environ.get("AVERAGED_DECAY", "0.5")))
    run_cli(train_gpt2.main)
