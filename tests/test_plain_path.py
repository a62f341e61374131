"""The plain path (fixed data order, plain loss, fp32 on CPU) is build-nanogpt's training, bit for bit.

A second, minimal implementation of build-nanogpt's train_gpt2.py (its GPT, its DataLoaderLite, its
get_lr, its AdamW groups, its loop), written here independently of train_gpt2.py, trains the same tiny
model on the same shards; the trainer's log.txt, straight and resumed from a checkpoint mid-run, must
equal the log the reference writes, byte for byte. Both run in this process at one thread, so they
see the same floating-point kernels: the claim is "same machine, same thread count", never numbers
recorded on another machine.

    python -m pytest -q tests/test_plain_path.py
"""

import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import TINY_FLAGS, build_nanogpt_lines, make_shards

import train_gpt2

# the run both sides make: TINY_FLAGS' shape and batch, ten steps, validation every three
N_LAYER, N_HEAD, N_EMBD, T, B = 2, 2, 32, 32, 4
TOTAL_BATCH, MAX_STEPS, WARMUP, MAX_LR, MIN_LR_FRAC, VAL_STEPS, EVAL_EVERY, SEED = 512, 10, 2, 3e-3, 0.1, 2, 3, 1337
VOCAB = 50304


# -----------------------------------------------------------------------------
# build-nanogpt's train_gpt2.py, reduced to what this run uses


class RefAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.c_proj.NANOGPT_SCALE_INIT = 1

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        q, k, v = (z.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class RefMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)
        self.c_proj.NANOGPT_SCALE_INIT = 1

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class RefBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(N_EMBD), RefAttention(), nn.LayerNorm(N_EMBD), RefMLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RefGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(VOCAB, N_EMBD), wpe=nn.Embedding(T, N_EMBD),
                                              h=nn.ModuleList([RefBlock() for _ in range(N_LAYER)]),
                                              ln_f=nn.LayerNorm(N_EMBD)))
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02 * ((2 * N_LAYER) ** -0.5 if hasattr(module, "NANOGPT_SCALE_INIT") else 1)
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class RefLoader:
    """build-nanogpt's DataLoaderLite for one process, reading the shard files without train_gpt2."""

    def __init__(self, data_dir, split):
        self.shards = sorted(os.path.join(data_dir, n) for n in os.listdir(data_dir) if f"_{split}_" in n)
        self.reset()

    def load(self, path):
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(1024), dtype=np.int32)
            return torch.tensor(np.frombuffer(f.read(), dtype=np.uint16)[: header[2]].astype(np.int64))

    def reset(self):
        self.current_shard, self.position = 0, 0
        self.tokens = self.load(self.shards[0])

    def next_batch(self):
        buf = self.tokens[self.position : self.position + B * T + 1]
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.position += B * T
        if self.position + B * T + 1 > len(self.tokens):
            self.current_shard = (self.current_shard + 1) % len(self.shards)
            self.tokens, self.position = self.load(self.shards[self.current_shard]), 0
        return x, y


def ref_lr(it):
    max_lr, min_lr = MAX_LR, MAX_LR * MIN_LR_FRAC
    if it < WARMUP:
        return max_lr * (it + 1) / WARMUP
    if it > MAX_STEPS:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - WARMUP) / (MAX_STEPS - WARMUP)))
    return min_lr + coeff * (max_lr - min_lr)


def reference_log(data_dir):
    """The log.txt build-nanogpt's loop writes for this run (its format: `<step> val|train <value>`)."""
    torch.manual_seed(SEED)
    model = RefGPT()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=MAX_LR, betas=(0.9, 0.95), eps=1e-8, fused=False)
    train_loader, val_loader = RefLoader(data_dir, "train"), RefLoader(data_dir, "val")
    grad_accum_steps, lines = TOTAL_BATCH // (B * T), []
    for step in range(MAX_STEPS):
        last_step = step == MAX_STEPS - 1
        if step % EVAL_EVERY == 0 or last_step:
            val_loader.reset()
            with torch.no_grad():
                val_loss_accum = 0.0
                for _ in range(VAL_STEPS):
                    x, y = val_loader.next_batch()
                    val_loss_accum += model(x, y).detach() / VAL_STEPS
            lines.append(f"{step} val {val_loss_accum.item():.4f}\n")
        optimizer.zero_grad()
        loss_accum = 0.0
        for _ in range(grad_accum_steps):
            x, y = train_loader.next_batch()
            loss = model(x, y) / grad_accum_steps  # the gradients of each backward() add up
            loss_accum += loss.detach()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = ref_lr(step)
        optimizer.step()
        lines.append(f"{step} train {loss_accum.item():.6f}\n")
    return "".join(lines)


# -----------------------------------------------------------------------------


def test_the_reference_is_build_nanogpts_recipe_for_these_flags():
    """The constants above are what TINY_FLAGS and the command below ask train_gpt2 for."""
    args = train_gpt2.parse_args([*TINY_FLAGS, "--max_steps", str(MAX_STEPS), "--eval_every", str(EVAL_EVERY),
                                  "--total_batch_size", str(TOTAL_BATCH)])
    assert (args.n_layer, args.n_head, args.n_embd, args.seq_len, args.batch_size) == (N_LAYER, N_HEAD, N_EMBD, T, B)
    assert (args.warmup_steps, args.max_lr, args.min_lr_frac, args.val_steps, args.seed) == (
        WARMUP, MAX_LR, MIN_LR_FRAC, VAL_STEPS, SEED)
    assert (args.weight_decay, args.grad_clip, args.no_shuffle, args.dtype) == (0.1, 1.0, True, "fp32")


def test_tiny_fp32_run_with_a_resume_logs_what_build_nanogpts_loop_logs(tmp_path, one_thread):
    data = make_shards(str(tmp_path / "data"))
    want = reference_log(data)
    assert want.count(" val ") == 4 and want.count(" train ") == MAX_STEPS  # steps 0, 3, 6 and the last

    log_dir = str(tmp_path / "log")
    flags = [*TINY_FLAGS, "--data_dir", data, "--log_dir", log_dir, "--max_steps", str(MAX_STEPS),
             "--eval_every", str(EVAL_EVERY), "--save_every", "4", "--total_batch_size", str(TOTAL_BATCH)]
    train_gpt2.main(flags)
    assert build_nanogpt_lines(log_dir) == want

    os.remove(os.path.join(log_dir, "model_00009.pt"))  # as if the run died after step 7's checkpoint
    train_gpt2.main([*flags, "--resume"])
    assert build_nanogpt_lines(log_dir) == want
