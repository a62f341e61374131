"""nanogpt.muon's Muon against torch.optim.Muon, the reference whose update it batches: the same weights after steps
of mixed shapes (square, tall, wide, several of one shape), state dicts that load both ways, found_inf's skip (bit for
bit, without the host reading it), the ops a step costs per added matrix, and the step shared by two gloo processes.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_muon.py     # -m "not slow": without the two processes
"""

import collections
import functools
import os

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from nanogpt.muon import Muon, adjusted_lr, stacked
from nanogpt.optimizers import (MatricesWithAdamW, OptimizerSettings, matrices_with_adamw, muon_momentum_warmup,
                                step_if_finite)

# square, tall (transposed in and out), wide, and several of one shape (a stack of 3, odd for two ranks' padding)
SHAPES = [(16, 16), (48, 16), (48, 16), (48, 16), (16, 40), (16, 40), (24, 32)]
LR, STEPS = 0.02, 3
# How far two correct implementations may differ: both run the same bf16 Newton-Schulz, and summing a matmul's
# products in another order (another kernel, a batched one) can flip the bf16 rounding of a result by one unit in
# the last place. The orthogonalised update's entries are below 2 (its singular values end in ~(0.7, 1.2), and no
# entry exceeds the largest), where a bf16 ulp is 2^-7; we allow 2 ulps of every entry per step, scaled by the
# step's rate: |dw| <= STEPS * adjusted_lr * 2^-6. On this CPU the two agree bit for bit; the bound is for kernels
# that sum in another order. test_the_tolerance_sees_a_wrong_update checks that it is tight enough to matter.
ULPS_PER_STEP = 2 * 2 ** -7


def tolerance(shape, steps=STEPS):
    return steps * adjusted_lr(LR, None, shape) * ULPS_PER_STEP


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def matrices(shapes=SHAPES, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def twin(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_gradients(groups, step, bad=False):
    """The same random gradients (a function of step) on each list of groups; bad: an inf and a NaN in them."""
    generator = torch.Generator().manual_seed(100 + step)
    for i, grad in enumerate(torch.randn(p.shape, generator=generator) for p in groups[0]):
        if bad and i < 2:
            grad[0, i] = float("inf") if i == 0 else float("nan")
        for params in groups:
            params[i].grad = grad.clone()


def buffers(optimizer, params):
    return [optimizer.state[p]["momentum_buffer"] for p in params]


def assert_close_weights(ours, theirs, steps=STEPS):
    for p, q in zip(ours, theirs):
        diff = (p - q).abs().max().item()
        assert diff <= tolerance(p.shape, steps), (tuple(p.shape), diff, tolerance(p.shape, steps))


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_update_is_torch_optim_muons(nesterov):
    ours = matrices()
    theirs = twin(ours)
    muon = Muon(ours, lr=LR, weight_decay=0.1, nesterov=nesterov)
    reference = torch.optim.Muon(theirs, lr=LR, weight_decay=0.1, nesterov=nesterov)
    for step in range(STEPS):
        set_gradients([ours, theirs], step)
        muon.step()
        reference.step()
    assert_close_weights(ours, theirs)
    assert all(torch.equal(a, b) for a, b in zip(buffers(muon, ours), buffers(reference, theirs)))  # fp32, exact
    assert stacked(buffers(muon, ours)[1:4]) is not None  # the three (48, 16) momentum buffers are one tensor


def test_the_tolerance_sees_a_wrong_update():
    """Nesterov's momentum left out after one step moves some weight by more than the tolerance allows."""
    ours = matrices()
    theirs = twin(ours)
    muon, reference = Muon(ours, lr=LR, nesterov=False), torch.optim.Muon(theirs, lr=LR, nesterov=True)
    for step in range(2):
        set_gradients([ours, theirs], step)
        muon.step()
        reference.step()
    assert any((p - q).abs().max() > tolerance(p.shape, 2) for p, q in zip(ours, theirs))


WARMUP = functools.partial(muon_momentum_warmup, 4)  # Muon's momentum climbing over 4 steps


def adamw_beside(params, fused=False):
    return torch.optim.AdamW([{"params": params, "lr_scale": 1.0}], lr=1e-3, fused=fused)


def test_state_dicts_load_both_ways(tmp_path):
    """MatricesWithAdamW's state dict holding torch.optim.Muon's (checkpoints before nanogpt.muon) loads into ours, and
    ours into torch's, through torch.save and torch.load(weights_only=True) as checkpoints go; each continues as the
    one that saved it would."""
    for saver_class, loader_class in ((torch.optim.Muon, Muon), (Muon, torch.optim.Muon)):
        saved_params, bias = matrices(), torch.nn.Parameter(torch.zeros(16))
        saver = MatricesWithAdamW("muon", saver_class([{"params": saved_params, "lr_scale": 20.0}], lr=LR,
                                                      weight_decay=0.0), adamw_beside([bias]), WARMUP)
        for step in range(2):
            set_gradients([saved_params], step)
            bias.grad = torch.ones(16)
            saver.step()
        torch.save(saver.state_dict(), tmp_path / "state.pt")
        state = torch.load(tmp_path / "state.pt", weights_only=True)

        loaded_params = twin(saved_params)
        loader = MatricesWithAdamW("muon", loader_class([{"params": loaded_params, "lr_scale": 20.0}], lr=LR,
                                                        weight_decay=0.0),
                                   adamw_beside([torch.nn.Parameter(bias.detach().clone())]), WARMUP)
        loader.load_state_dict(state)
        assert state["muon"]["param_groups"][0].keys() == loader.matrices.state_dict()["param_groups"][0].keys()
        loaded = buffers(loader.matrices, loaded_params)
        assert all(torch.equal(a, b) for a, b in zip(buffers(saver.matrices, saved_params), loaded))
        assert loader_class is not Muon or stacked(loaded[1:4]) is not None  # ours: restacked as it loads
        assert loader.steps == 2
        for step in range(2, 4):
            set_gradients([saved_params, loaded_params], step)
            saver.step()
            loader.step()
        assert_close_weights(saved_params, loaded_params, steps=2)


def test_ours_saves_torchs_layout():
    ours = matrices()
    theirs = twin(ours)
    muon, reference = Muon(ours, lr=LR), torch.optim.Muon(theirs, lr=LR)
    set_gradients([ours, theirs], 0)
    muon.step()
    reference.step()
    mine, its = muon.state_dict(), reference.state_dict()
    assert mine["param_groups"] == its["param_groups"]
    assert mine["state"].keys() == its["state"].keys()
    assert all(mine["state"][i].keys() == {"momentum_buffer"} and mine["state"][i]["momentum_buffer"].shape
               == its["state"][i]["momentum_buffer"].shape for i in its["state"])


class CountedOps(TorchDispatchMode):
    """The aten ops run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


HOST_READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "item"}  # .item(), bool(), nonzero: the host waits


@pytest.mark.parametrize("found", [0.0, 1.0])
def test_found_inf_skips_on_the_device_bit_for_bit(found):
    """found_inf 1: weights and momentum buffers exactly as before, though the gradients hold inf and NaN; 0: the
    step without it, bit for bit (weight decay on). Neither reads found_inf on the host."""
    ours = matrices()
    plain = twin(ours)
    muon, reference = Muon(ours, lr=LR, weight_decay=0.1), Muon(plain, lr=LR, weight_decay=0.1)
    set_gradients([ours, plain], 0)
    muon.step()  # momentum buffers to keep
    reference.step()
    before = [p.detach().clone() for p in ours], [b.clone() for b in buffers(muon, ours)]
    set_gradients([ours, plain], 1, bad=found == 1.0)
    muon.found_inf = torch.tensor(found)
    with CountedOps() as counted:
        muon.step()
    assert not HOST_READS & set(counted.ops), counted.ops
    if found:
        assert all(torch.equal(p, b) for p, b in zip(ours, before[0]))
        assert all(torch.equal(a, b) for a, b in zip(buffers(muon, ours), before[1]))
    else:
        reference.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, plain))
        assert all(torch.equal(a, b) for a, b in zip(buffers(muon, ours), buffers(reference, plain)))


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_step_is_skipped_by_muon_and_adamw_together(fused):
    """step_if_finite: with a fused AdamW (the CPU has one too) beside Muon the skip is decided on the device, the
    host reading nothing before the step; with the foreach AdamW the host reads the verdict. Either way a NaN leaves
    weights and state as they were, and a finite step is the plain step, bit for bit."""
    params, bias = matrices(), torch.nn.Parameter(torch.ones(16))
    plain, plain_bias = twin(params), torch.nn.Parameter(torch.ones(16))
    settings = OptimizerSettings("muon", 1e-3, flags={"muon_lr": LR})
    optimizer = matrices_with_adamw(params, adamw_beside([bias], fused=fused), settings)
    reference = matrices_with_adamw(plain, adamw_beside([plain_bias], fused=fused), settings)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step, bad in ((0, False), (1, True), (2, False)):
        set_gradients([params, plain], step, bad=bad)
        bias.grad = plain_bias.grad = torch.full((16,), float("nan") if bad else 0.5)
        before = [p.detach().clone() for p in [*params, bias]]
        loss = torch.tensor(float("nan") if bad else 1.0)
        with CountedOps() as counted:
            finite = step_if_finite(optimizer, scaler, loss, torch.tensor(1.0))
        assert bool(HOST_READS & set(counted.ops)) == (not fused), counted.ops
        assert bool(finite) == (not bad)
        if bad:
            assert all(torch.equal(p, b) for p, b in zip([*params, bias], before))
        else:
            reference.step()
            assert all(torch.equal(p, q) for p, q in zip([*params, bias], [*plain, plain_bias]))
    assert all(torch.equal(a, b)
               for a, b in zip(buffers(optimizer.matrices, params), buffers(reference.matrices, plain)))


def test_a_step_skipped_on_the_device_moves_nothing_of_the_momentum_warm_up(tmp_path):
    """Muon's momentum warm-up counts the steps taken: a step skipped on the device (found_inf, fused AdamW beside)
    leaves the count, the momentum and the saved state as a run that never took it has them, bit for bit, without
    the host reading the verdict; the steps after it climb from there. The reference decides on the host and calls no
    step at all for the bad one."""
    params, bias = matrices(), torch.nn.Parameter(torch.ones(16))
    plain, plain_bias = twin(params), torch.nn.Parameter(torch.ones(16))
    settings = OptimizerSettings("muon", 1e-3, flags={"muon_lr": LR, "muon_momentum_warmup": 5})
    optimizer = matrices_with_adamw(params, adamw_beside([bias], fused=True), settings)
    reference = matrices_with_adamw(plain, adamw_beside([plain_bias], fused=True), settings)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step, bad in ((0, False), (1, False), (2, True), (3, True), (4, False), (5, False)):
        set_gradients([params, plain], step, bad=bad)
        bias.grad = plain_bias.grad = torch.full((16,), float("nan") if bad else 0.5)
        loss = torch.tensor(float("nan") if bad else 1.0)
        with CountedOps() as counted:
            step_if_finite(optimizer, scaler, loss, torch.tensor(1.0))
        assert not HOST_READS & set(counted.ops), counted.ops
        if not bad:
            reference.step()
        assert int(optimizer.steps) == reference.steps
    assert all(torch.equal(p, q) for p, q in zip([*params, bias], [*plain, plain_bias]))
    assert all(torch.equal(a, b)
               for a, b in zip(buffers(optimizer.matrices, params), buffers(reference.matrices, plain)))
    ours, theirs = optimizer.state_dict(), reference.state_dict()
    assert ours["steps"] == theirs["steps"] == 4
    assert ours["muon"]["param_groups"] == theirs["muon"]["param_groups"]  # the momentum: a number, the same
    torch.save(ours, tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt", weights_only=True)["muon"]["param_groups"][0]["momentum"] == \
        theirs["muon"]["param_groups"][0]["momentum"]


def test_fp16s_scaler_skips_a_non_finite_loss_and_the_next_step_runs():
    """fp16 (the loss scaler on): a non-finite loss skips the step, lowers the scale as an overflow does, and ends
    the scaler's step, so the next step unscales and steps as a run that never had the bad one (at the lowered
    scale) does, bit for bit. Both a NaN loss with NaN gradients and an inf loss whose gradients are finite."""
    def run(losses, scale):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        weights = []
        for kind in losses:
            loss = model(x).square().mean()
            if kind == "nan":
                loss = loss * float("nan")
            elif kind == "inf":  # a loss that overflowed on its own, its gradients finite
                loss = loss + (torch.tensor(float("inf")) - loss.detach())
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            finite = step_if_finite(optimizer, scaler, loss.detach(), torch.tensor(1.0))
            assert bool(finite) == (kind == "ok")
            optimizer.zero_grad(set_to_none=True)
            weights.append([p.detach().clone() for p in model.parameters()])
        return weights, scaler.get_scale()

    for bad in ("nan", "inf"):
        weights, scale = run(["ok", bad, "ok", "ok"], 2.0 ** 10)
        assert scale == 2.0 ** 9  # lowered once, by the backoff factor
        assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))  # the bad step moved nothing
        reference, _ = run(["ok", "ok", "ok"], 2.0 ** 10)
        assert all(torch.equal(a, b) for a, b in zip(weights[0], reference[0]))
        # (the scale is a power of two: unscaled gradients are exact, so the lowered scale changes no number)
        assert all(torch.equal(a, b) for a, b in zip(weights[3], reference[2]))


def ops_of_a_step(optimizer_class, n_same_shape):
    """aten ops of a second step (the momentum buffers exist) over n_same_shape (24, 16) matrices and three others."""
    params = matrices([(24, 16)] * n_same_shape + [(16, 16), (48, 16), (16, 40)])
    optimizer = optimizer_class(params, lr=LR, weight_decay=0.1)
    for step in range(2):
        set_gradients([params], step)
        if step:
            with CountedOps() as counted:
                optimizer.step()
        else:
            optimizer.step()
    return sum(counted.ops.values())


def test_a_step_costs_at_most_6_ops_per_added_matrix():
    n, k = 2, 6
    ours = (ops_of_a_step(Muon, n + k) - ops_of_a_step(Muon, n)) / k
    torchs = (ops_of_a_step(torch.optim.Muon, n + k) - ops_of_a_step(torch.optim.Muon, n)) / k
    assert ours <= 6, f"{ours} ops per added matrix (torch.optim.Muon: {torchs})"
    assert torchs > 6, torchs  # the count sees per-matrix work


def sharded_steps(rank, world_size, init_file, out_dir):
    """A spawned rank: STEPS steps of Muon sharded over the gloo group, its weights saved."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        params = matrices()
        muon = Muon(params, lr=LR, weight_decay=0.1, process_group=dist.group.WORLD)
        for step in range(STEPS):
            set_gradients([params], step)  # every rank the same, as DDP's all-reduce leaves them
            muon.step()
        torch.save([p.detach() for p in params], os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes: the full suite's (~9 s on a busy 2-core machine, most of it importing torch twice)
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_two_gloo_processes_share_the_step_and_end_alike(tmp_path):
    """Each rank orthogonalises half of each shape's stack (the stack of 3 padded to 4) and all-gathers the rest:
    both end with the same weights, the one process's within the tolerance."""
    mp.spawn(sharded_steps, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)  # (not fork: OpenMP's pool)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1))
    alone = matrices()
    muon = Muon(alone, lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        set_gradients([alone], step)
        muon.step()
    assert_close_weights(rank0, alone)
