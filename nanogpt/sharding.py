"""
Sharding across torchrun's processes, all PyTorch's own (docs/scale.md): ZeRO-1 (ZeroRedundancyOptimizer)
and FSDP2 (fully_shard), gradient sync on the last micro-step, and the gathering of their sharded state
into the one plain checkpoint layout (model.state_dict(), AdamW's state_dict()) that every script reads.
"""

import torch

from nanogpt.cli import UserError


def choose_sharding(zero, fsdp, ddp, dtype, say):
    """(zero, fsdp) for this run, of --zero 1 and --fsdp. Both shard across torchrun's processes; one process
    without torchrun has nothing to shard, so it trains unsharded (the checkpoints are the same either way)."""
    if (zero or fsdp) and not ddp:
        say(f"note: {'--fsdp' if fsdp else '--zero 1'} shards across torchrun's processes; "
            "a single process has nothing to shard and trains unsharded")
        return False, False
    if fsdp and dtype == "fp16":
        raise UserError("--fsdp trains in bf16 or fp32 (fp16's loss scaler is not sharded here); "
                        "use --dtype bf16 or fp32, or --zero 1 for fp16")
    return zero, fsdp


def shard_model(model, dtype, device_type, use_compile):
    """FSDP2 in place: each Block is one unit (gathered for its forward and backward, freed after), then the
    root, which holds the tied wte/lm_head weight, wpe and ln_f. With use_compile each Block's forward and the
    root's head and loss are compiled for training (compile_for_training).
    bf16 on GPUs: the Blocks' weights are gathered and used in bf16 and their gradients reduced in
    fp32. Autocast stays on and the root stays fp32, so the residual stream, the embeddings'
    gradients, layer norms, softmax and the loss stay in fp32 as in a DDP bf16 run
    (cast_forward_inputs=False keeps the fp32 residual entering a Block). On a CPU (where autocast
    does not lift layer_norm to fp32) the weights stay fp32, and bf16 is autocast's alone, as in DDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if dtype == "bf16" and device_type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.transformer.h:
        if use_compile:
            compile_for_training(block)
        fully_shard(block, mp_policy=policy)
    fully_shard(model)
    if use_compile:  # the root's head and loss (the embeddings are lookups)
        compile_for_training(model, "head")
    return model


def compile_for_training(module, method="forward"):
    """A method of the module (a Block's forward, the root's head) compiled (static shapes) for training, in place
    (parameter names keep no _orig_mod.), and run eagerly without gradients: the evaluations and samples, run
    through the same sharded modules, would otherwise bring their shapes (HellaSwag's, a KV cache's) into the
    training graph and make it dynamic."""
    eager = getattr(module, method)
    compiled = torch.compile(eager, dynamic=False)
    setattr(module, method, lambda *args: compiled(*args) if torch.is_grad_enabled() else eager(*args))


def zero_redundancy(optimizer):
    """ZeRO-1: a ZeroRedundancyOptimizer over the optimizer's groups and settings, so that each rank keeps
    the AdamW state of its share of the parameters. Every key of every group travels (the loop's "lr_scale"
    of the rates by role among them), so each group trains at the rate it would in one process."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [dict(g) for g in optimizer.param_groups]
    settings = {k: optimizer.defaults[k] for k in ("lr", "betas", "eps", "fused")}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **settings)


def sync_gradients(model, last_micro_step):
    """Whether the next backward reduces the gradients across the ranks: on the last micro-step only (the
    others add up locally). DDP's switch (what no_sync() sets), or FSDP2's."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last_micro_step)
    else:
        model.require_backward_grad_sync = last_micro_step


def clip_grad_norm(model, max_norm):
    """Clip the global gradient norm to max_norm (0: only measure it); the norm before clipping. Under
    --fsdp the norm is over every rank's shards."""
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    elif hasattr(torch.nn.utils, "get_total_norm"):  # (torch 2.6) the norm alone: no pass multiplying by 1
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def gathered_state_dicts(raw_model, optimizer, zero, fsdp, master):
    """(model state, optimizer state) in the plain layout on rank 0, (None, None) on the others.
    Under --zero 1 and --fsdp it gathers the shards, so every rank must call it."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0 only
        model_state = get_model_state_dict(raw_model, options=options)
        optimizer_state = get_optimizer_state_dict(raw_model, optimizer, options=options)
        if not master:
            return None, None
        return tie_shared_weights(model_state, raw_model), optimizer_state_by_index(optimizer_state)
    if zero:
        optimizer_state = zero_optimizer_state(optimizer, master)
        return (raw_model.state_dict(), optimizer_state) if master else (None, None)
    return (raw_model.state_dict(), optimizer.state_dict()) if master else (None, None)


def zero_optimizer_state(optimizer, master):
    """AdamW.state_dict() of a ZeroRedundancyOptimizer's shares on rank 0 (None on the others): the
    dict consolidate_state_dict(to=0) + state_dict() give, tensor for tensor. Those pickle each rank's
    whole share and broadcast the bytes; the copies made on the way took the sending rank of the 96M
    shape from 1.4 to 5.4 GB (docs/scale.md). Here each rank sends its state tensors one at a time,
    straight from its optimizer; rank 0 keeps its own and receives the others' into new CPU tensors,
    so it holds the state the file needs and no more. Every rank must call it."""
    import torch.distributed as dist

    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    # this rank's share, {index: {name: value}}: 0-d tensors (AdamW's step) travel in it; a meta
    # tensor of the same shape and dtype stands for each larger tensor, which is sent apart
    share = {index[id(p)]: state for p, state in optimizer.optim.state.items()}
    outline = {i: {k: (v.to("meta") if v.dim() else v.cpu()) if torch.is_tensor(v) else v for k, v in state.items()}
               for i, state in share.items()}
    outlines = [None] * dist.get_world_size() if master else None
    dist.gather_object(outline, outlines, dst=0)
    if not master:
        for i in sorted(share):  # the order rank 0 receives in
            for v in share[i].values():
                if torch.is_tensor(v) and v.dim():
                    dist.send(v.contiguous(), dst=0)
        return None
    state = {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in share.items()}
    for rank, outline in enumerate(outlines[1:], start=1):
        for i in sorted(outline):
            state[i] = {}
            for k, v in outline[i].items():
                if torch.is_tensor(v) and v.is_meta:
                    received = torch.empty(v.shape, dtype=v.dtype, device=params[i].device)
                    dist.recv(received, src=rank)
                    v = received.cpu()
                state[i][k] = v
    groups, start = [], 0
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def tie_shared_weights(state, model):
    """Names of one shared parameter (wte and lm_head) point to one tensor, as in model.state_dict(),
    so torch.save stores the weight once."""
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in state:
            state[name] = state[first.setdefault(id(p), name)]
    return state


def optimizer_state_by_index(state):
    """get_optimizer_state_dict's layout (keyed by parameter name) -> AdamW.state_dict()'s (keyed by
    the parameter's index across the groups, in order)."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    groups, start = [], 0
    for group in state["param_groups"]:
        groups.append({**group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": {index[name]: s for name, s in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(state, optimizer, model):
    """AdamW.state_dict()'s layout -> the one set_optimizer_state_dict takes (keyed by name)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    saved = state["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g) for g in names]:
        raise ValueError(f"{len(saved)} parameter groups of {[len(g['params']) for g in saved]} parameters, "
                         f"this model has {[len(g) for g in names]}")
    flat = [name for group in names for name in group]
    groups = [{**g, "params": group} for g, group in zip(saved, names)]
    return {"state": {flat[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def load_optimizer_state(optimizer, state, fsdp_model=None):
    """A plain AdamW state dict into this run's optimizer: AdamW itself, a ZeroRedundancyOptimizer
    (which keeps its rank's share), or under --fsdp the sharded AdamW (every rank holds the file)."""
    if fsdp_model is None:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(fsdp_model, optimizer, optimizer_state_by_name(state, optimizer, fsdp_model),
                             options=StateDictOptions(full_state_dict=True))


def optimizer_state_bytes(optimizer):
    """Bytes of optimizer state this rank holds: all of AdamW's, or its share under --zero 1 / --fsdp."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: the rank's local AdamW
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                value = value.to_local() if hasattr(value, "to_local") else value
                total += value.numel() * value.element_size()
    return total


def optimizer_state_line(optimizer, world_size, device):
    """'optimizer state per rank: ...' from every rank (a collective)."""
    import torch.distributed as dist

    mine = torch.tensor([optimizer_state_bytes(optimizer)], dtype=torch.long, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return "optimizer state per rank: " + ", ".join(f"{t.item():,} bytes" for t in everyone)
