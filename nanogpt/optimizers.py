"""
The optimizers: the parameters by role (parameters_by_role), the table of the optimizers (MATRIX_OPTIMIZERS: AdamW,
Muon; each entry says what it takes, the weight matrices beside AdamW or the whole model, and what it needs) from
which configure_optimizers builds a run's (build_optimizer), a matrices' optimizer stepped beside AdamW for the rest as
one optimizer (MatricesWithAdamW), AdamW's groups by role, and the step skipped when the loss or the gradients are not
finite (step_if_finite).
"""

import functools
from dataclasses import dataclass, field

import torch

from nanogpt.cli import UserError
from nanogpt.muon import Muon


MUON_MOMENTUM = (0.85, 0.95)  # --muon_momentum_warmup's climb (modded-nanogpt's); Muon's default is the top


class MatricesWithAdamW:
    """The matrices' optimizer (an entry of MATRIX_OPTIMIZERS other than AdamW, under its name) and AdamW for the
    rest, used by the training loop as one: its param_groups are both's (the matrices' first, each with an
    "lr_scale" that the loop multiplies the scheduled learning rate by: their rate / --max_lr), step() and
    zero_grad() act on both, and state_dict() holds both under {name, "adamw"}, so a resumed run continues exactly.
    before_step(matrices, steps), when given, sets the matrices' groups for their next step from the steps taken
    (Muon's momentum warm-up); the steps taken are then saved too."""

    def __init__(self, name, matrices, adamw, before_step=None):
        self.name, self.matrices, self.adamw, self.before_step, self.steps = name, matrices, adamw, before_step, 0

    @property
    def param_groups(self):
        return self.matrices.param_groups + self.adamw.param_groups

    @property
    def state(self):
        return {**self.matrices.state, **self.adamw.state}

    def step(self):
        found_inf = getattr(self.matrices, "found_inf", None)  # step_if_finite's skip decided on the device, or None
        if self.before_step:
            self.before_step(self.matrices, self.steps)
        self.matrices.step()
        self.adamw.step()
        if found_inf is None:
            self.steps += 1
        else:  # a skipped step is not counted, without the host reading the verdict: the count stays on the device
            self.steps = (1 - found_inf.to(count_dtype(found_inf.device))) + self.steps

    def zero_grad(self, set_to_none=True):
        self.matrices.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def eval(self):  # the modes of a matrices' optimizer that has them (its entry's modes)
        self.matrices.eval()

    def train(self):
        self.matrices.train()

    def state_dict(self):
        matrices = self.matrices.state_dict()
        for group in matrices["param_groups"]:  # a schedule's value computed on the device: saved as a number
            group.update({k: v.item() for k, v in group.items() if torch.is_tensor(v) and v.dim() == 0})
        steps = {"steps": int(self.steps)} if self.before_step else {}  # a run without a schedule: as it always was
        return {self.name: matrices, "adamw": self.adamw.state_dict(), **steps}

    def load_state_dict(self, state):
        self.matrices.load_state_dict(state[self.name])
        self.adamw.load_state_dict(state["adamw"])
        self.steps = state.get("steps", 0)


def count_dtype(device):
    """The dtype of a count of steps kept on the device: float64 (exact, and its arithmetic the host's), float32 where
    the device has no float64 (mps; exact up to 2**24 steps)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def with_settings_of(optimizer, state):
    """A checkpoint's optimizer state dict (`state`) with every param group's settings (each key but its "params": the
    rate's scale, the weight decay, fused or foreach, Muon's momentum) taken from `optimizer`, this run's, built from
    today's flags: a setting a resume changes (--weight_decay, --fused_adamw, --muon_lr, ...) holds from the resume
    step, and the checkpoint brings the state of each parameter (moments, step counts) and the keys an optimizer says
    it keeps of its own in its groups (its group_state: schedule-free's mode and counters). Groups that do not pair
    are left for the load to refuse."""
    if isinstance(optimizer, MatricesWithAdamW):
        return {**state, optimizer.name: with_settings_of(optimizer.matrices, state[optimizer.name]),
                "adamw": with_settings_of(optimizer.adamw, state["adamw"])}
    saved = state["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        return state
    kept = ("params", *getattr(optimizer, "group_state", ()))
    return {**state, "param_groups": [{**group, **{k: v for k, v in mine.items() if k not in kept}}
                                      for group, mine in zip(saved, optimizer.param_groups)]}


def muon_momentum_warmup(warmup, muon, steps):
    """Muon's momentum, climbing linearly over its first `warmup` steps from MUON_MOMENTUM[0] to [1]. steps: the
    steps taken, a number or (where a skip is decided on the device) a 0-d tensor there, which gives the momentum as
    one: the same arithmetic in float64, with no wait for the device."""
    low, high = MUON_MOMENTUM
    climbed = (steps / warmup).clamp(max=1.0) if torch.is_tensor(steps) else min(steps / warmup, 1.0)
    for group in muon.param_groups:
        group["momentum"] = low + (high - low) * climbed


def make_muon(groups, rate, settings, process_group):
    """MATRIX_OPTIMIZERS' Muon: at rate (--muon_lr), no weight decay (modded-nanogpt's), its momentum warm-up
    (--muon_momentum_warmup) as the step's schedule; process_group: DDP's, across whose ranks it shares its
    Newton-Schulz work (None: one process)."""
    warmup = settings.flags.get("muon_momentum_warmup") or 0
    muon = Muon(groups, lr=rate, weight_decay=0.0, process_group=process_group)
    return muon, functools.partial(muon_momentum_warmup, warmup) if warmup else None


@dataclass(frozen=True)
class MatrixOptimizer:
    """An entry of MATRIX_OPTIMIZERS, --optimizer's: the optimizer of the weight matrices (parameters_by_role's
    "matrix"), AdamW taking the rest; or of the whole model (takes "model"). What it is and what it needs are read from
    here by configure_optimizers (build_optimizer), the argument checks, the memory estimate and the run
    (Run.evaluation_weights), never by its name."""
    make: object = None  # (groups, rate, settings, process_group) -> (optimizer, before_step or None); None: AdamW's.
    # A whole model's: groups are AdamW's (decayed 2-D tensors, or the rates by role), rate --max_lr, no before_step
    name: str = "AdamW"  # in messages
    rate_flag: str = None  # the flag (one of flags) of the matrices' peak rate, which the schedule scales as it
    # scales --max_lr; None: --max_lr (a whole model's optimizer trains at --max_lr)
    usual_rate: float = None  # the rate_flag's usual size: its default, and in the message refusing one too large
    flags: tuple = ()  # its own flags, refused with another --optimizer ("does nothing")
    state_bytes: int = 8  # its state per parameter it takes (fp32): the memory estimate's
    shardable: bool = True  # whether --zero 1 / --fsdp can take it (ZeRO-1 shards one class; FSDP splits matrices)
    fp16: bool = True  # whether fp16's loss scaler is wired to it
    about: str = ""  # for --optimizer's help
    takes: str = "matrices"  # "matrices": the weight matrices, AdamW (at --max_lr) the rest; "model": every parameter
    schedules: tuple = None  # the learning-rate schedules it trains with, of arguments.SCHEDULE_KINDS ("held": a rate
    # that stays at its peak after the warm-up, as schedule-free's needs), others refused; None: any
    modes: bool = False  # it has modes, as schedule-free's torch optimizers: .eval() puts the weights to evaluate (an
    # average) into the model and .train() the trained ones back, both kept in its state; every rank switches around
    # the loop's evaluations and every checkpoint, which holds the weights to evaluate (Run.evaluation_weights)


# --optimizer's choices. A new optimizer is an entry here, its factory, and its flags in train_gpt2.build_parser();
# checkpoints, resumes, the step line's rate, refusals and the memory estimate follow.
MATRIX_OPTIMIZERS = {
    "adamw": MatrixOptimizer(about="adamw: AdamW on every parameter", takes="model"),
    # Muon's usual rate 0.02: docs/recipes.md
    "muon": MatrixOptimizer(make_muon, "Muon", "muon_lr", 0.02, ("muon_lr", "muon_momentum_warmup"), state_bytes=4,
                            shardable=False, fp16=False,
                            about="muon: Muon (torch.optim.Muon's update, batched over same-shape matrices) on the "
                                  "weight matrices, AdamW (at --max_lr) on the embeddings, the head and the 1-D "
                                  "parameters"),
}


@dataclass
class OptimizerSettings:
    """What configure_optimizers builds from: of() takes them from the parsed flags or a checkpoint's saved dict
    of them (a flag the checkpoint predates: None, its factory's default)."""
    optimizer: str = "adamw"  # a key of MATRIX_OPTIMIZERS
    max_lr: float = 1.0
    weight_decay: float = 0.0
    rates: dict = None  # AdamW's by role (adamw_rates), or None
    flags: dict = field(default_factory=dict)  # the matrices' optimizer's own flags (its entry's), by name

    @classmethod
    def of(cls, args):
        get = args.get if isinstance(args, dict) else lambda name: getattr(args, name, None)
        name, max_lr = get("optimizer") or "adamw", get("max_lr")
        return cls(name, 1.0 if max_lr is None else max_lr, get("weight_decay") or 0.0, adamw_rates(args),
                   {flag: get(flag) for flag in MATRIX_OPTIMIZERS[name].flags})


def build_optimizer(settings, matrices, groups, make_adamw, process_group=None):
    """The optimizer of --optimizer (settings.optimizer, an entry of MATRIX_OPTIMIZERS), as its entry says: AdamW's
    (make_adamw(groups)); a whole model's, over groups (AdamW's groups of every parameter); or a matrices' over
    `matrices` (the weight matrices, left out of groups) stepped beside AdamW over groups."""
    entry = MATRIX_OPTIMIZERS[settings.optimizer]
    if entry.make is None:
        return make_adamw(groups)
    if entry.takes == "model":
        optimizer, before_step = entry.make(groups, settings.max_lr, settings, process_group)
        assert before_step is None, f"{entry.name}: a whole model's optimizer keeps its own schedule of settings"
    else:
        optimizer = matrices_with_adamw(matrices, make_adamw(groups), settings, process_group)
    if entry.modes:  # in train mode from the start (schedule-free's torch optimizers start in eval mode)
        optimizer.train()
    return optimizer


def matrices_with_adamw(matrices, adamw, settings, process_group=None):
    """The optimizer of --optimizer (settings.optimizer, an entry of MATRIX_OPTIMIZERS) over `matrices` at its
    rate, stepped beside adamw; AdamW itself where the entry is AdamW's."""
    name = settings.optimizer
    entry = MATRIX_OPTIMIZERS[name]
    if entry.make is None or not matrices:
        return adamw
    rate = settings.flags.get(entry.rate_flag) if entry.rate_flag else settings.max_lr
    groups = [{"params": matrices, "lr_scale": rate / settings.max_lr if settings.max_lr else 1.0}]
    optimizer, before_step = entry.make(groups, rate, settings, process_group)
    return MatricesWithAdamW(name, optimizer, adamw, before_step)


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
    {name: the matrices' rate} beside AdamW, else {}."""
    if isinstance(optimizer, MatricesWithAdamW):
        return {optimizer.name: optimizer.matrices.param_groups[0]["lr"]}
    return {}


def adamw_rates(args):
    """--embed_lr, --head_lr, --scalar_lr as configure_optimizers takes them (None: no rates by role). args: the
    parsed flags, or a checkpoint's saved dict of them."""
    get = args.get if isinstance(args, dict) else lambda name: getattr(args, name, None)
    rates = {role: get(f"{role}_lr") for role in ("embed", "head", "scalar")}
    return rates if any(rate is not None for rate in rates.values()) else None


def local_optimizers(optimizer):
    """The torch optimizers this process steps itself: ZeroRedundancyOptimizer's own share (whose step() would
    broadcast to the others), the matrices' and AdamW's beside each other, or the optimizer."""
    inner = getattr(optimizer, "optim", optimizer)
    return [inner.matrices, inner.adamw] if isinstance(inner, MatricesWithAdamW) else [inner]


def takes_found_inf(optimizer):
    """Whether a torch optimizer skips its whole step on the device when handed a found_inf flag (the loss
    scaler's protocol): fused AdamW does, and the Muon here; the foreach AdamW (a CPU's default) does not, nor a
    fused one over --fsdp's sharded parameters (a plain flag among DTensors)."""
    if getattr(optimizer, "takes_found_inf", False):  # (nanogpt.muon's Muon says so)
        return True
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return (isinstance(optimizer, torch.optim.Adam) and all(group.get("fused") for group in optimizer.param_groups)
            and not any(hasattr(p, "to_local") for p in params))


def step_if_finite(optimizer, scaler, loss, norm):
    """optimizer.step(), unless the loss or the gradient norm is not finite: then the step changes nothing (weights,
    optimizer state, its step count). Returns that verdict, a bool tensor on the device. Where every optimizer of
    this process takes a found_inf flag it is decided on the device, so the host queues the optimizer's work
    without waiting for the backward to end; elsewhere (the CPU's foreach AdamW, where waiting costs nothing) the
    host reads it. fp16: the loss scaler skips an overflow of the gradients itself; the loss is read here, and a
    non-finite one skips the step as an overflow does, the scale lowered (the scaler's step is over either way:
    the next unscale_ would otherwise find this one's)."""
    if scaler.is_enabled():
        finite = torch.isfinite(loss)
        if bool(finite):
            scaler.step(optimizer)
            scaler.update()
        else:
            scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
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
