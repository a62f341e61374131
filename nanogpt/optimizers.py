"""
Muon beside AdamW, stepped as one optimizer (train_gpt2.py --optimizer muon): Muon (nanogpt.muon: torch.optim.Muon's
update, batched over same-shape matrices) orthogonalises the update of each weight matrix of the blocks; AdamW takes
the embedding, the output head and the 1-D parameters, as in nanochat and modded-nanogpt.
"""

import torch

from nanogpt.cli import UserError
from nanogpt.muon import Muon


MUON_MOMENTUM = (0.85, 0.95)  # --muon_momentum_warmup's climb (modded-nanogpt's); Muon's default is the top


class MuonWithAdamW:
    """Two optimizers the training loop uses as one: its param_groups are both's (Muon's first, each with
    an "lr_scale" that the loop multiplies the scheduled learning rate by: --muon_lr / --max_lr), step() and
    zero_grad() act on both, and state_dict() holds both (Muon's momentum buffers too), so a resumed run
    continues exactly. With momentum_warmup, Muon's momentum climbs linearly over its first that many steps
    from MUON_MOMENTUM[0] to [1]; the steps taken are then saved too."""

    def __init__(self, muon, adamw, momentum_warmup=0):
        self.muon, self.adamw, self.momentum_warmup, self.steps = muon, adamw, momentum_warmup, 0

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self):
        return {**self.muon.state, **self.adamw.state}

    def step(self):
        if self.momentum_warmup:
            low, high = MUON_MOMENTUM
            for group in self.muon.param_groups:
                group["momentum"] = low + (high - low) * min(self.steps / self.momentum_warmup, 1.0)
        self.muon.step()
        self.adamw.step()
        self.steps += 1

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        steps = {"steps": self.steps} if self.momentum_warmup else {}  # a run without the warm-up: as it always was
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict(), **steps}

    def load_state_dict(self, state):
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
        self.steps = state.get("steps", 0)


def muon_with_adamw(matrices, adamw, muon_lr, max_lr, momentum_warmup=0, process_group=None):
    """Muon over `matrices` (at muon_lr, no weight decay, as modded-nanogpt), with adamw. process_group: None in
    one process, the DDP ranks' group to share Muon's Newton-Schulz work across them."""
    muon = Muon([{"params": matrices, "lr_scale": muon_lr / max_lr if max_lr else 1.0}], lr=muon_lr, weight_decay=0.0,
                process_group=process_group)
    return MuonWithAdamW(muon, adamw, momentum_warmup)


WIDTH_OF_RATES = 768  # --embed_lr and --head_lr are rates at this width, scaled by sqrt(768 / n_embd) (nanochat's)


def parameters_by_role(model):
    """model's trainable parameters by role, each list in model.parameters()' order (nanochat's rule):
    "embed", an nn.Embedding's weight (token, position and value embeddings; a head tied to the token embedding is
    one); "head", the output head's weight (model.lm_head); "matrix", any other 2-D weight, wherever it sits (Muon's
    under --optimizer muon); "scalar", the 1-D and 0-D ones (gains, biases, learned scalars). A parameter no rule
    places is refused by name, not left to a default optimizer."""
    embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    roles = {"matrix": [], "embed": [], "head": [], "scalar": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if any(p is e for e in embeddings):
            roles["embed"].append(p)
        elif p is model.lm_head.weight:
            roles["head"].append(p)
        elif p.dim() in (0, 1, 2):
            roles["matrix" if p.dim() == 2 else "scalar"].append(p)
        else:
            raise UserError(f"parameter {name} ({p.dim()}-D) has no optimizer role: place it in "
                            "nanogpt/optimizers.py's parameters_by_role")
    return roles


def groups_by_role(roles, weight_decay, max_lr, rates, n_embd):
    """AdamW's parameter groups when a recipe gives rates by role (roles: parameters_by_role's, less any another
    optimizer takes; rates: {"embed", "head", "scalar"}, each a rate or None for max_lr): the embeddings and the
    head at their rates scaled by sqrt(WIDTH_OF_RATES / n_embd), as nanochat scales them; the scalars at theirs,
    undecayed; the matrices at max_lr. Each group's "lr_scale" is its rate over max_lr, the factor the loop
    multiplies the scheduled rate by."""
    width = (WIDTH_OF_RATES / n_embd) ** 0.5
    groups = []
    for name in ("matrix", "embed", "head", "scalar"):
        rate = max_lr if name == "matrix" or rates.get(name) is None else rates[name] * (1.0 if name == "scalar" else width)
        if roles.get(name):
            groups.append({"params": roles[name], "weight_decay": 0.0 if name == "scalar" else weight_decay,
                           "lr_scale": rate / max_lr})
    return groups


def rates_beside(optimizer):
    """The learning rates of the optimizers stepped beside AdamW, by name, for the step line and the trackers:
    {"muon": Muon's rate} beside AdamW, else {}."""
    return {"muon": optimizer.muon.param_groups[0]["lr"]} if isinstance(optimizer, MuonWithAdamW) else {}


def adamw_rates(args):
    """--embed_lr, --head_lr, --scalar_lr as configure_optimizers takes them (None: no rates by role). args: the
    parsed flags, or a checkpoint's saved dict of them."""
    get = args.get if isinstance(args, dict) else lambda name: getattr(args, name, None)
    rates = {role: get(f"{role}_lr") for role in ("embed", "head", "scalar")}
    return rates if any(rate is not None for rate in rates.values()) else None


def local_optimizers(optimizer):
    """The torch optimizers this process steps itself: ZeroRedundancyOptimizer's own share (whose step() would
    broadcast to the others), Muon's and AdamW's beside each other, or the optimizer."""
    inner = getattr(optimizer, "optim", optimizer)
    return [inner.muon, inner.adamw] if isinstance(inner, MuonWithAdamW) else [inner]


def takes_found_inf(optimizer):
    """Whether a torch optimizer skips its whole step on the device when handed a found_inf flag (the loss
    scaler's protocol): fused AdamW does, and the Muon here; the foreach AdamW (a CPU's default) does not, nor a
    fused one over --fsdp's sharded parameters (a plain flag among DTensors)."""
    if isinstance(optimizer, Muon):
        return True
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return (isinstance(optimizer, torch.optim.Adam) and all(group.get("fused") for group in optimizer.param_groups)
            and not any(hasattr(p, "to_local") for p in params))


def step_if_finite(optimizer, scaler, loss, norm):
    """optimizer.step(), unless the loss or the gradient norm is not finite: then the step changes nothing (weights,
    optimizer state, its step count). Returns that verdict, a bool tensor on the device. Where every optimizer of
    this process takes a found_inf flag it is decided on the device, so the host queues the optimizer's work
    without waiting for the backward to end; elsewhere (the CPU's foreach AdamW, where waiting costs nothing) the
    host reads it. fp16: the loss scaler skips an overflow of the gradients itself; the loss is read here."""
    if scaler.is_enabled():
        finite = torch.isfinite(loss)
        if bool(finite):
            scaler.step(optimizer)
            scaler.update()
        return finite
    finite = torch.isfinite(loss) & torch.isfinite(norm)
    local = local_optimizers(optimizer)
    if not all(takes_found_inf(opt) for opt in local):
        if bool(finite):
            optimizer.step()
        return finite
    found_inf = (~finite).float()
    for opt in local:
        opt.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        for opt in local:
            opt.found_inf = None
    return finite
