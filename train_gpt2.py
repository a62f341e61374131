"""
Pretrain GPT-2 on token shards, the way "Let's reproduce GPT-2 (124M)" does, as a program.

    python fineweb.py                                         # make edu_fineweb10B/ shards
    torchrun --standalone --nproc_per_node=8 train_gpt2.py    # GPT-2 124M on 10B tokens
    python train_gpt2.py                                      # the same on one GPU (grad accumulation)
    python train_gpt2.py --model tiny                         # a laptop: 4 x 128 on the text shipped in data/

It reads top to bottom as the lecture builds it: the config, the model (attention, MLP, Block, GPT with
generate and from_pretrained), the data loaders, the learning-rate schedule, the distributed set-up and
the training loop, then the command line. The plumbing (checkpoint files, HF import/export, sharding,
the log folder, argument checks, the device) lives in the nanogpt/ package (docs/layout.md).
Importing this file does nothing; hellaswag.py, evaluate.py and generate_tokens.py import the model from it.
"""

import functools
import inspect
import math
import os
import time
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogpt import arguments, hf
from nanogpt.arguments import ADAMW_USUAL, LARGEST_INT, LARGEST_RATE
from nanogpt.checkpoints import (check_resumable, checkpoint_config, find_checkpoints, load_checkpoint,
                                 newest_checkpoint, refuse_checkpoint_lookalikes, restore_training_state,
                                 resume_checkpoint, resumed_schedule, strip_prefixes)
from nanogpt.cli import (CLIParser, UserError, add_system_flags, add_weights_flags, borrowed_settings, brief,
                         name_settings_in_help, run_cli)
from nanogpt.config_fields import (add_config_flags, config_from_flags, lowest_count, make_config, option,
                                  refuse_another_model)
from nanogpt.core_eval import scorer_for_training
from nanogpt.fitting import (batch_ramp, batch_size_arg, candidate_batch_sizes, describe_split, every_rank_agrees,
                             fit_batch_size, fits_by_trial, fits_in_memory, largest_batch_size, micro_batches_per_step,
                             smallest_of_every_rank, trial_step)
from nanogpt.float8 import convert_to_fp8
from nanogpt.hellaswag_eval import hellaswag_scorer
from nanogpt.layers import (RMS_EPS, KVCache, LlamaAttention, ReLUSquared, SoftcappedLinear, SwiGLU, attend,
                            value_embed_layers)
from nanogpt.loop_evals import evaluation_model, sample_lines, validation_loss
from nanogpt.loss_head import LOSS_IMPLS, linear_loss, logits_loss
from nanogpt.optimizers import (MATRIX_OPTIMIZERS, OptimizerSettings, build_optimizer, groups_by_role,
                                parameters_by_role, step_if_finite)
from nanogpt.run import Attempt, Run
from nanogpt.runlog import check_tracking, run_header
from nanogpt.sampling import sample_next_token
from nanogpt.runtime import (KEPT_UNTIL_EXIT, active_parameters, all_reduce_mean, autocast_context, choose_compile,
                             counted_flops_per_token, peak_flops, pick_device, pick_dtype, waiting_for_peers_said)
from nanogpt.shards import (SHIPPED_TEXT_SHARDS, check_not_shrunk, document_starts, laptop_data_dir, list_shards,
                            read_shard, shard_shipped_text, shuffle_rng, verify_shards)
from nanogpt.sharding import clip_grad_norm, choose_sharding, shard_model, sync_gradients, zero_redundancy
from nanogpt.tokenizer import GPT2_VOCAB_SIZE, SAMPLE_PROMPT, get_tokenizer

# -----------------------------------------------------------------------------
# Model config

PADDED_VOCAB_SIZE = 50304  # 50257 rounded up to a multiple of 128: faster matmuls, unused rows
# logits within +-c give a token at most e^2c / (e^2c + vocab_size - 1) of the probability, so no token's loss goes
# under ln(1 + (vocab_size - 1) e^-2c): over GPT-2's vocabulary 1.2 at c = 5, 3.9 at c = 3.5, 9.8 at c = 0.5, where a
# GPT-2's mean loss is ~3: below 5 the cap holds the model back from the tokens it can be sure of
MIN_LOGIT_SOFTCAP = 5.0


@dataclass
class GPTConfig:
    """The model. Each field is a flag of train_gpt2.py (--<name>, with the help beside it), saved in every
    checkpoint and held to on --resume, --init_from and export (nanogpt.config_fields): a model idea is a
    field here and its use in the classes below (docs/layout.md). None: worked out from the other fields."""
    block_size: int = option(1024, "context length", flag="seq_len")
    vocab_size: int = option(PADDED_VOCAB_SIZE, "rows of the embedding and the head: GPT-2's 50257 tokens padded to "
                                                "a multiple of 128 for faster matmuls")
    mask_padding: bool = option(None, "the padded vocabulary's ids (50257 and up) get no probability: their logits are "
                                      "-inf (default: llama and speedrun on; gpt2 off, as build-nanogpt)")
    n_layer: int = option(12, "blocks (default: the --model preset's)")
    n_head: int = option(12, "attention heads (default: the --model preset's)")
    n_embd: int = option(768, "width of the residual stream (default: the --model preset's)")
    # beyond GPT-2's shape: the architecture and the options of its pieces (docs/recipes.md)
    arch: str = option("gpt2", "gpt2: the lecture's block; llama: RMSNorm, rotary positions instead of wpe, a SwiGLU "
                               "MLP, no biases; speedrun: the block of the GPT-2 speedruns (modded-nanogpt, nanochat), "
                               "below (default: the --recipe's)", choices=("gpt2", "llama", "speedrun"))
    n_kv_head: int = option(None, "key/value heads, each shared by n_head // n_kv_head query heads (grouped-query "
                                  "attention; default: n_head)", archs=("llama", "speedrun"))
    qk_norm: bool = option(None, "RMSNorm on each head's queries and keys before the rotation (as Qwen3; default: "
                                 "llama off, speedrun on)", archs=("llama", "speedrun"))
    rope_theta: float = option(10000.0, "the base of the rotary positions", archs=("llama", "speedrun"))
    mlp_act: str = option(None, "the MLP: gelu (GPT-2's, tanh approximation), swiglu (llama's: silu(x W_gate) * x W_fc) "
                                "or relu2 (ReLU squared; the speedrun's) (default: the architecture's)",
                          choices=("gelu", "swiglu", "relu2"))
    mlp_hidden: int = option(None, "the MLP's hidden width (default: 4 x n_embd; swiglu: a multiple of 64 near 8/3 x "
                                   "n_embd)")
    tie_embeddings: bool = option(None, "the output head is the token embedding (default: untied, docs/recipes.md; "
                                        "GPT-2's always is)", archs=("llama", "speedrun"))
    zero_init: bool = option(None, "the blocks' output projections start at zero, so each block starts as the "
                                   "identity (default: speedrun on)")
    logit_softcap: float = option(None, "logits become c * tanh(logits / c) for this c, 5 or more; 0: off (default: "
                                        "speedrun 15)")
    x0_mix: bool = option(None, "before every block x = a_i * x + b_i * x0, x0 the normed token embedding, a_i and "
                                "b_i learned per layer (default: on)", archs=("speedrun",))
    value_embeds: bool = option(None, "embeddings of the tokens added into the values of every other layer's "
                                      "attention, through a learned gate per head (default: on)", archs=("speedrun",))
    unet_skips: bool = option(None, "the first half's block outputs added into the mirrored second-half blocks' inputs "
                                    "with learned weights; needs --n_layer 2 or more (default: on from 2 blocks)",
                              archs=("speedrun",))

    def __post_init__(self):
        gpt2, speedrun = self.arch == "gpt2", self.arch == "speedrun"
        if self.mask_padding is None:
            self.mask_padding = not gpt2
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.mlp_act is None:
            self.mlp_act = {"gpt2": "gelu", "llama": "swiglu", "speedrun": "relu2"}[self.arch]
        if self.mlp_hidden is None:
            swiglu = self.mlp_act == "swiglu"
            self.mlp_hidden = max(64, 64 * round(8 * self.n_embd / 3 / 64)) if swiglu else 4 * self.n_embd
        if self.tie_embeddings is None:
            self.tie_embeddings = gpt2
        if self.logit_softcap is None:
            self.logit_softcap = 15.0 if speedrun else 0.0
        if self.unet_skips is None:  # one block has no half to skip over
            self.unet_skips = speedrun and self.n_layer >= 2
        for name in ("qk_norm", "zero_init", "x0_mix", "value_embeds"):  # the speedrun's, on by default
            if getattr(self, name) is None:
                setattr(self, name, speedrun)
        # what no model can be built of (a ValueError: nanogpt.config_fields says it in one line)
        for f in fields(self):  # every count: 1 or more (0 or more where 0, the default, is off)
            if f.type is int and getattr(self, f.name) < lowest_count(f):
                raise ValueError(f"{f.name} {getattr(self, f.name)}: must be {lowest_count(f)} or more")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n_embd {self.n_embd} is not divisible by --n_head {self.n_head}")
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"--n_kv_head {self.n_kv_head} does not divide --n_head {self.n_head}: each key/value "
                             "head serves the same number of query heads; pick a divisor")
        if not gpt2 and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"--n_embd {self.n_embd} / --n_head {self.n_head} gives heads of "
                             f"{self.n_embd // self.n_head} dimensions; rotary positions turn pairs of them, so --arch "
                             f"{self.arch} needs an even head size: pick another --n_head or --n_embd")
        if not self.rope_theta >= 1 or not math.isfinite(self.rope_theta):
            raise ValueError(f"--rope_theta {self.rope_theta}: must be a finite number >= 1 (Llama's is 10000 or "
                             "500000)")
        if self.logit_softcap < 0:
            raise ValueError(f"--logit_softcap {self.logit_softcap}: must be 0 (off) or more")
        if 0 < self.logit_softcap < MIN_LOGIT_SOFTCAP:
            c, v = self.logit_softcap, self.vocab_size
            raise ValueError(f"--logit_softcap {c}: must be 0 (off) or {MIN_LOGIT_SOFTCAP:g} or more; logits within "
                             f"+-{c} keep every token's loss above {math.log1p((v - 1) * math.exp(-2 * c)):.2f} over "
                             f"{v} tokens, so the model cannot learn (the speedrun's is 15)")
        if self.unet_skips and self.n_layer < 2:
            raise ValueError(f"--unet_skips needs --n_layer 2 or more (with {self.n_layer} block there is no first half "
                             "to skip from); pass --no_unet_skips or more layers")


# Shapes of the GPT-2 family by depth; `tiny` trains in minutes on a laptop CPU.
MODEL_PRESETS = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128),
    "d12": dict(n_layer=12, n_head=12, n_embd=768),  # GPT-2 124M
    "d24": dict(n_layer=24, n_head=16, n_embd=1024),  # GPT-2 350M
    "d36": dict(n_layer=36, n_head=20, n_embd=1280),  # GPT-2 774M
    "d48": dict(n_layer=48, n_head=25, n_embd=1600),  # GPT-2 1558M
}
# Run settings that suit a preset better than the GPT-2 recipe's (flags still win): `tiny` takes
# a few minutes on a laptop CPU instead of asking for 0.5M-token steps.
RUN_PRESETS = {
    "tiny": dict(batch_size=8, seq_len=256, total_batch_size=4096, max_steps=50, warmup_steps=5, max_lr=1e-2,
                 eval_every=10, val_steps=4, hellaswag_every=0, sample_every=50, save_every=0),
}
# The architecture and optimizer beyond GPT-2's, measured against it in docs/recipes.md (flags still win).
RECIPES = {
    "gpt2": dict(arch="gpt2", optimizer="adamw"),
    "modern": dict(arch="llama", optimizer="muon"),
    # the GPT-2 speedruns' block and optimizer set-up (modded-nanogpt, nanochat): Muon with momentum warm-up on the
    # blocks' matrices, AdamW on the embeddings (high), head (low) and scalars at their own rates, warm-up / stable /
    # decay, no clipping; Muon's rate the best of 0.01-0.08 at 8 x 128 on the CPU (docs/recipes.md)
    "speedrun": dict(arch="speedrun", optimizer="muon", muon_lr=0.04, muon_momentum_warmup=100, max_lr=3e-3,
                     embed_lr=0.3, head_lr=0.008, scalar_lr=0.04, weight_decay=0.0, grad_clip=0.0, warmup_steps=40,
                     lr_schedule="wsd", warmdown_frac=0.4, min_lr_frac=0.05),
}
BATCH_SIZE = 64  # --batch_size's default, the lecture's micro-batch (on a GPU the largest auto tries)


# -----------------------------------------------------------------------------
# Model


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.config, self.layer_idx, self.n_head, self.n_embd = config, layer_idx, config.n_head, config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # flash attention (SDPA, causal); and the KV cache when sampling
        y = attend(q, k, v, self.config, kv_cache, self.layer_idx)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config, bias=True, activation=None):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=bias)
        self.act = activation or nn.GELU(approximate="tanh")  # GPT-2's GELU, its tanh approximation
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=bias)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


@dataclass(frozen=True)
class Pieces:
    """What a GPT's blocks are made of: GPT-2's, or another architecture's chosen by pieces_of(config) below."""
    norm: object = nn.LayerNorm  # size -> the norm before attention, before the MLP and at the end
    attention: object = CausalSelfAttention  # (config, layer_idx) -> the attention
    mlp: object = MLP  # config -> the MLP
    learned_positions: bool = True  # GPT-2's wpe; the other architectures rotate queries and keys instead


class Block(nn.Module):
    def __init__(self, config, layer_idx, pieces=Pieces()):
        super().__init__()
        self.ln_1 = pieces.norm(config.n_embd)
        self.attn = pieces.attention(config, layer_idx)
        self.ln_2 = pieces.norm(config.n_embd)
        self.mlp = pieces.mlp(config)

    def forward(self, x, kv_cache=None, *attn_inputs):  # attn_inputs: the speedrun's value embedding
        x = x + self.attn(self.ln_1(x), kv_cache, *attn_inputs)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    # --recompute (activation checkpointing): in training, keep only each Block's input and run the
    # Block again during backward (torch.utils.checkpoint): less memory, ~1/3 more compute, the same numbers
    recompute = False

    def __init__(self, config):
        super().__init__()
        self.config = config
        pieces = pieces_of(config)
        positions = dict(wpe=nn.Embedding(config.block_size, config.n_embd)) if pieces.learned_positions else {}
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                **positions,
                h=nn.ModuleList([Block(config, i, pieces) for i in range(config.n_layer)]),
                ln_f=pieces.norm(config.n_embd),
            )
        )
        self.lm_head = (nn.Linear(config.n_embd, config.vocab_size, bias=False) if not config.logit_softcap
                        else SoftcappedLinear(config.n_embd, config.vocab_size, config.logit_softcap))
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        # How forward computes the loss when given targets: "plain" materialises the logits (the reference path);
        # "chunked" and "fused" never hold them (nanogpt.loss_head) and return (None, loss).
        self.loss_impl = "plain"
        self.loss_chunk_size = None  # rows per chunk for "chunked"; None: default_loss_chunk_size

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):  # each layer adds twice to the residual stream
                std = 0.0 if self.config.zero_init else std * (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len=None, say=None):
        """Training FLOPs per token, for MFU: those of the matrix multiplications of batch_loss's forward and backward
        over one sequence of seq_len tokens (None: the context), counted on a meta-device twin of this model, so a
        new layer counts as it computes. Where the model cannot run on the meta device (said by say): 6N + 12·L·H·Q·T,
        the formula nanoGPT and llm.c use (N less the lookup embeddings; a routed layer's at its active_fraction)."""
        T = seq_len or self.config.block_size
        counted = counted_flops_per_token(lambda: type(self)(self.config), batch_loss, T, say)
        if counted is not None:
            return counted
        lookups = [m.weight for m in self.modules() if isinstance(m, nn.Embedding) and m.weight is not self.lm_head.weight]
        n = active_parameters(self) - sum(w.numel() for w in lookups)  # a lookup is no matmul (a tied head is)
        return 6 * n + 12 * self.config.n_layer * self.config.n_embd * T

    def hidden_states(self, idx, kv_cache=None):
        """The final normed hidden states (B, T, C) of the tokens idx (B, T); with kv_cache, idx continues the
        positions the cache holds and extends it (generate's decode_step). The blocks in between: trunk."""
        T, start = idx.size(1), 0 if kv_cache is None else kv_cache.pos
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than the context of {self.config.block_size}")
        x = self.trunk(idx, start, kv_cache)
        if kv_cache is not None:
            kv_cache.pos += T
        return self.transformer.ln_f(x)

    def trunk(self, idx, start, kv_cache):
        """The residual stream after the last block (B, T, C), idx's first token at position start (SpeedrunGPT's own)."""
        x = self.transformer.wte(idx)
        if "wpe" in self.transformer:  # GPT-2's learned positions
            x = x + self.transformer.wpe(torch.arange(start, start + idx.size(1), dtype=torch.long, device=idx.device))
        for block in self.transformer.h:
            x = self.run_block(block, x, kv_cache)
        return x

    def run_block(self, block, x, kv_cache, *extra):
        """block(x, kv_cache, *extra); under --recompute in training, its activations recomputed in backward."""
        if self.recompute and kv_cache is None and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(block, x, None, *extra, use_reentrant=False)
        return block(x, kv_cache, *extra)

    def forward(self, idx, targets=None, row_losses=None):
        return self.head(self.hidden_states(idx), targets, row_losses)

    def head(self, x, targets=None, row_losses=None):
        """(logits, loss) of the hidden states x: the output head and, given targets, the loss (a method of its own,
        which --fsdp compiles apart from its sharded Blocks). row_losses: the objective's terms, of each row's lse
        and target logit (nanogpt.loss_head); then (logits, loss, {name: mean})."""
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(f"loss_impl {self.loss_impl!r}: expected one of {LOSS_IMPLS}")
        if targets is not None and self.loss_impl != "plain":  # the logits never held
            loss = linear_loss(self.loss_impl, x.view(-1, x.size(-1)), self.lm_head.weight, targets.view(-1),
                               self.loss_chunk_size, self.config.logit_softcap,
                               GPT2_VOCAB_SIZE if self.config.mask_padding else None, row_losses)
            return (None, loss) if row_losses is None else (None, *loss)
        logits = self.lm_head(x)
        if self.config.mask_padding:  # in place: the padding is a sliver of the logits
            logits[..., GPT2_VOCAB_SIZE:] = float("-inf")
        if targets is not None and row_losses is not None:
            return logits, *logits_loss(logits.view(-1, logits.size(-1)), targets.view(-1), row_losses)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @classmethod
    def from_pretrained(cls, name_or_dir):
        """GPT-2 weights from the HF hub (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or a local transformers
        GPT-2, Llama or Qwen3 directory, refused before loading when this GPT would compute something else
        with them (nanogpt.hf checks the config). The vocabulary stays as saved (50257 for OpenAI's)."""
        model = cls(config := pretrained_config(name_or_dir))
        model.load_state_dict(hf.hf_state_dict(name_or_dir, config.arch))
        return model

    def configure_optimizers(self, settings, device_type, process_group=None, fused=None):
        # settings: an OptimizerSettings (nanogpt.optimizers), from the flags or a checkpoint. Decay the 2-D tensors
        # (matmul weights, embeddings); biases and LayerNorm gains stay undecayed. --optimizer's entry of
        # MATRIX_OPTIMIZERS takes the weight matrices (parameters_by_role), AdamW the rest; or the whole model.
        roles = parameters_by_role(self)
        matrices = roles.pop("matrix") if MATRIX_OPTIMIZERS[settings.optimizer].takes == "matrices" else []
        params = [p for p in self.parameters() if p.requires_grad and all(p is not m for m in matrices)]
        if settings.rates:  # a recipe's rates for the embeddings, the head and the 1-D parameters
            groups = groups_by_role(roles, settings.weight_decay, settings.max_lr, settings.rates, self.config.n_embd)
        else:
            decay = [p for p in params if p.dim() >= 2]
            no_decay = [p for p in params if p.dim() < 2]
            groups = [{"params": decay, "weight_decay": settings.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}]
        if fused is None:  # fused on GPUs; on a CPU the foreach AdamW, build-nanogpt's numbers
            fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        adamw = functools.partial(torch.optim.AdamW, lr=settings.max_lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
        return build_optimizer(settings, matrices, groups, adamw, process_group)

    def decode_step(self, tokens, cache, head_t=None):
        """generate's step: run tokens (B, n) on top of the KV cache, extending it; the logits of the last
        position's GPT2_VOCAB_SIZE real tokens (B, V). head_t: lm_head's weight transposed, or None.
        A method of its own so that it can be compiled (generate_tokens.py --compile)."""
        x = self.hidden_states(tokens, cache)[:, -1]  # the prompt's other positions need no logits
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
        # One row on a CPU: MKL's matrix-vector product with the head (a third of a d12 step) is ~1.5x faster from
        # an (in, out) copy, which costs what ~30 tokens save (not under autocast, which would convert it each step;
        # not for a wrapped, quantised or already transposed head, as generate_tokens.py lays one out on the CPU)
        head_t = None
        if (cache is not None and idx.device.type == "cpu" and B == 1 and max_new_tokens >= 32
                and type(self.lm_head) is nn.Linear and self.lm_head.weight.is_contiguous()
                and not torch.is_autocast_enabled("cpu")):
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


# -----------------------------------------------------------------------------
# Beyond GPT-2: the other architectures' pieces (their layers are in nanogpt.layers) and --arch speedrun's trunk
# (docs/recipes.md)


def pieces_of(config):
    """The layers config's blocks are made of, chosen here and nowhere else: GPT-2's (LayerNorm, the attention and
    MLP above, learned positions), or llama's and the speedrun's: RMSNorm (the speedrun's without gains), rotary
    attention, no biases; each with the MLP of --mlp_act."""
    if config.arch == "gpt2":
        norm, attention, bias = nn.LayerNorm, CausalSelfAttention, True
    else:
        norm = functools.partial(nn.RMSNorm, eps=RMS_EPS, elementwise_affine=config.arch == "llama")
        attention, bias = functools.partial(LlamaAttention, norm=norm), False
    mlp = {"gelu": MLP if bias else functools.partial(MLP, bias=False),
           "relu2": lambda cfg: MLP(cfg, bias, activation=ReLUSquared()),
           "swiglu": SwiGLU}[config.mlp_act]
    return Pieces(norm, attention, mlp, learned_positions=config.arch == "gpt2")


class SpeedrunGPT(GPT):
    """The GPT of --arch speedrun: llama's attention (rotary, QK-norm without gains), a ReLU² MLP, RMSNorm without
    gains, no biases (pieces_of), an untied and softcapped head (GPTConfig's defaults), and a trunk of its own: the
    token embedding normed (x0), mixed back in before every block with learned per-layer scalars (x0_mix); the first
    half's block outputs added into the mirrored second half's inputs with learned weights (unet_skips); value
    embeddings into every other layer's attention (value_embeds)."""

    def __init__(self, config):
        super().__init__(config)
        n, kv_dim = config.n_layer, config.n_kv_head * (config.n_embd // config.n_head)
        if config.x0_mix:
            self.resid_lambdas = nn.Parameter(torch.ones(n))
            self.x0_lambdas = nn.Parameter(torch.full((n,), 0.1))
        if config.unet_skips:
            self.skip_weights = nn.Parameter(torch.ones(n // 2))
        if config.value_embeds:
            self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, kv_dim)
                                               for i in value_embed_layers(config)})
            for embedding in self.value_embeds.values():
                torch.nn.init.normal_(embedding.weight, mean=0.0, std=0.02)

    def trunk(self, idx, start, kv_cache):
        cfg = self.config
        x = x0 = F.rms_norm(self.transformer.wte(idx), (cfg.n_embd,), eps=RMS_EPS)
        skips, decoder_start = [], cfg.n_layer - cfg.n_layer // 2  # layers 0.. feed layers ..n-1, mirrored
        for i, block in enumerate(self.transformer.h):
            if cfg.unet_skips and i >= decoder_start:
                x = x + self.skip_weights[i - decoder_start] * skips.pop()
            if cfg.x0_mix:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx) if cfg.value_embeds and str(i) in self.value_embeds else None
            x = self.run_block(block, x, kv_cache, ve)
            if cfg.unet_skips and i < cfg.n_layer // 2:
                skips.append(x)
        return x


def make_gpt(config):
    """The model of a config: SpeedrunGPT for --arch speedrun, else GPT."""
    return (SpeedrunGPT if config.arch == "speedrun" else GPT)(config)


def batch_loss(model, x, y, args=None):
    """A micro-batch's objective, in one place: the loop backpropagates it, the --batch_size auto trial tries it,
    validation averages it (without gradients). (loss, {name: 0-D tensor} logged as train/<name>); model: the GPT,
    compiled and wrapped; args: the run's flags, for an objective with settings of its own (None: counting FLOPs)."""
    _, loss = model(x, y)
    return loss, {}


# -----------------------------------------------------------------------------
# Weights in: our checkpoints, and --init_from's transformers models


def pretrained_config(name_or_dir):
    """The GPTConfig of --init_from's weights, known without loading them: a hub name's is its preset's,
    a local directory's comes from its config.json (checked by nanogpt.hf). Cheap and offline."""
    if os.path.isdir(name_or_dir):
        return make_config(GPTConfig, hf.local_shape(name_or_dir), f"--init_from {name_or_dir}")
    if name_or_dir in hf.HF_GPT2_PRESETS:
        return GPTConfig(block_size=1024, vocab_size=GPT2_VOCAB_SIZE, **MODEL_PRESETS[hf.HF_GPT2_PRESETS[name_or_dir]])
    raise UserError(f"--init_from {name_or_dir!r}: not a GPT-2 model name ({', '.join(hf.HF_GPT2_MODELS)}) "
                    "nor a local HF model directory")


def model_from_checkpoint(ckpt, source):
    """The GPT of a loaded checkpoint, its config checked first; a mismatch of the weights is raised as
    torch raises it (the caller says what it means)."""
    model = make_gpt(checkpoint_config(ckpt, source, GPTConfig))
    model.load_state_dict(strip_prefixes(ckpt["model"]))
    return model


def load_model(checkpoint=None, init_from=None, device="cpu", source=None):
    """The one way every script turns weights into a GPT: our checkpoint (a file, the newest in a log
    folder, or a checkpoint already loaded from `source`) or GPT-2 weights (--init_from: a hub name or a
    local transformers folder)."""
    if bool(checkpoint) == bool(init_from):
        raise UserError("give exactly one of --checkpoint PATH (ours) "
                        "or --init_from NAME_OR_HF_DIR (gpt2, gpt2-medium, ...)")
    if init_from:
        model, source = GPT.from_pretrained(init_from), init_from
    else:
        if not isinstance(checkpoint, dict):
            source = newest_checkpoint(checkpoint)
            checkpoint = load_checkpoint(source)
        try:
            model = model_from_checkpoint(checkpoint, source)
        except (TypeError, RuntimeError, AttributeError) as e:
            raise UserError(f"{source}: weights do not fit the GPT architecture its config describes ({brief(e)}); "
                            "it is damaged or not a checkpoint of this program") from None
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:  # a diverged run: it would sample garbage and score at chance
        raise UserError(f"{source}: {len(bad)} weight tensors hold NaN or inf (e.g. {bad[0]}); "
                        "the run diverged before this checkpoint, use an earlier one")
    return model.to(device).eval()


# -----------------------------------------------------------------------------
# Data: a loader over llm.c-compatible token shards (nanogpt.shards reads and writes them)


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
        self.mapped = os.stat(self.shards[shard])  # the file the map reads: next_batch checks it has not shrunk
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
        check_not_shrunk(self.shards[self.shard], self.mapped)
        start = self.base + B * T * self.rank
        buf = torch.from_numpy(self._span(start, B * T + 1).astype(np.int64))
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.base += B * T * self.world_size
        self._advance_if_full()
        return x, y


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
        # the documents the span crosses, a slice of each (not an index per token: a batch is ~60 documents of ~1k)
        first, last = np.searchsorted(self.doc_offsets, [start, start + n - 1], side="right") - 1
        pieces = []
        for doc in range(first, last + 1):
            lo, hi = max(start, self.doc_offsets[doc]), min(start + n, self.doc_offsets[doc + 1])
            pieces.append(self.tokens[self.doc_starts[doc] + lo - self.doc_offsets[doc] :
                                      self.doc_starts[doc] + hi - self.doc_offsets[doc]])
        return np.concatenate(pieces)

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


def make_loaders(args, rank, world_size, warn, val_rows=None):
    """(train, val) loaders; val is None when validation is off. Training documents are shuffled every
    epoch, or read in build-nanogpt's fixed order with --no_shuffle; validation always reads the fixed
    order (the same batches at every evaluation), in batches of val_rows rows (default: the micro-batch)."""
    B, T = args.batch_size, args.seq_len
    if args.no_shuffle:
        train_loader = DataLoaderLite(args.data_dir, "train", B, T, rank, world_size, warn)
    else:
        train_loader = ShuffledDataLoader(args.data_dir, "train", B, T, rank, world_size, warn, seed=args.seed)
    val_loader = (DataLoaderLite(args.data_dir, "val", val_rows or B, T, rank, world_size, warn) if args.eval_every
                  else None)
    return train_loader, val_loader


# -----------------------------------------------------------------------------
# Learning-rate schedule


def get_lr(step, max_lr, min_lr, warmup_steps, max_steps, shape="cosine", warmdown_steps=0, start=0, start_lr=None):
    """Linear warmup for warmup_steps, then down to min_lr at max_steps, then min_lr. The way down is the
    shape: cosine (GPT-2's: half a cosine) or wsd (warm-up, stable, decay: max_lr until the last
    warmdown_steps, then a straight line). A resume that moved the schedule (--schedule_change) begins it
    again at step `start`: with start_lr, from that rate without a warmup (stretch); else warmup and all."""
    if start_lr is None and step - start < warmup_steps:
        return max_lr * (step - start + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    top, begin = (max_lr, start + warmup_steps) if start_lr is None else (start_lr, start)
    if shape == "wsd":
        begin = max(begin, max_steps - warmdown_steps)
        return top if step < begin else top + (min_lr - top) * (step - begin) / (max_steps - begin)
    decay_ratio = (step - begin) / max(1, max_steps - begin)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 -> 0
    return min_lr + coeff * (top - min_lr)


class LRSchedule:
    """get_lr with a run's settings, the rate of each step: schedule(step). `start`, `start_lr`: where a resume
    that changed the settings moved it (nanogpt.checkpoints.resumed_schedule); its checkpoints keep that (moved())."""

    SETTINGS = ("lr_schedule", "max_lr", "min_lr_frac", "warmup_steps", "max_steps", "warmdown_frac")

    def __init__(self, settings, start=0, start_lr=None):
        self.settings, self.start, self.start_lr = settings, start, start_lr

    @classmethod
    def of(cls, args, **moved):
        return cls({name: getattr(args, name) for name in cls.SETTINGS}, **moved)

    def __call__(self, step):
        s = self.settings
        return get_lr(step, s["max_lr"], s["max_lr"] * s["min_lr_frac"], s["warmup_steps"], s["max_steps"],
                      s["lr_schedule"], round(s["warmdown_frac"] * s["max_steps"]), self.start, self.start_lr)

    def moved(self):
        return None if (self.start, self.start_lr) == (0, None) else {"start": self.start, "start_lr": self.start_lr}

    def min_lr(self):
        return self(math.inf)  # where the schedule ends, whatever its shape

    def way_down(self):
        """The shape after the warmup, in words (the run header's and a resume's)."""
        s = self.settings
        begin = self.start + s["warmup_steps"] if self.start_lr is None else self.start
        held_until = max(begin, s["max_steps"] - round(s["warmdown_frac"] * s["max_steps"]))
        return {"cosine": "half a cosine", "wsd": f"held until step {held_until}, then a straight line"}[s["lr_schedule"]]

    def describe(self):
        s = self.settings
        return (f"{s['lr_schedule']}: {s['warmup_steps']} warm-up steps to {s['max_lr']:.4e}, {self.way_down()} down to "
                f"{self.min_lr():.4e} at step {s['max_steps']}")


# -----------------------------------------------------------------------------
# Distributed set-up: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE for each process


def setup_distributed(device_arg):
    """(ddp, rank, local_rank, world_size, device). Under torchrun (RANK set) joins the process
    group: NCCL on GPUs, gloo on CPU."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        return False, 0, 0, 1, pick_device(device_arg)
    arguments.check_torchrun_environment(os.environ)  # (hellaswag.py's and evaluate.py's first check of it)
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    kind = pick_device(device_arg).split(":")[0]
    if kind not in ("cuda", "cpu"):
        raise UserError(f"DDP needs cuda or cpu devices, not {kind}")
    device = f"cuda:{local_rank}" if kind == "cuda" else "cpu"
    with waiting_for_peers_said(os.environ):  # every process of WORLD_SIZE joins; a long wait is said
        if kind == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl", device_id=torch.device(device))
        else:
            dist.init_process_group(backend="gloo")
    return True, rank, local_rank, world_size, device


# -----------------------------------------------------------------------------
# Training


def train(args, config, lr_schedule, ckpt=None, ckpt_path=None):
    ddp, rank, local_rank, world_size, device = setup_distributed(args.device)
    device_type = device.split(":")[0]
    dtype = pick_dtype(args.dtype, device_type)
    autocast = autocast_context(device_type, dtype)
    with Run(args, ddp, rank, device) as run:  # console, log.txt, checkpoints, the ranks' agreement
        setup = set_up(args, config, ckpt, ckpt_path, lr_schedule, run, ddp, rank, local_rank, world_size, device, dtype)
        # the training step's pieces by their lecture names; the evaluations' stay setup's
        model, raw_model, optimizer, scaler = setup.model, setup.raw_model, setup.optimizer, setup.scaler
        train_loader, tokens_seen = setup.train_loader, setup.tokens_seen
        tokenizer = get_tokenizer() if args.sample_every else None

        for step in range(setup.start_step, args.max_steps):
            # once in a while evaluate: the validation loss, HellaSwag, CORE, samples (with the compiled model, every
            # rank with the weights to evaluate); a failure (a shard gone) first saves the last step's state
            with run.keeping_progress(step), run.evaluation_weights(step):
                if setup.val_loader is not None and run.due(step, args.eval_every):
                    val_loss = validation_loss(setup.eval_model, setup.val_loader, args.val_steps, device, autocast, ddp,
                                               world_size, functools.partial(batch_loss, args=args), args.batch_size)
                    run.log(step, f"val {val_loss:.4f}", {"val/loss": val_loss},
                            f"step {step:5d} | validation loss {val_loss:.4f}")
                if setup.score_hellaswag and run.due(step, args.hellaswag_every):
                    with autocast:
                        result = setup.score_hellaswag(setup.eval_model)
                    run.log(step, f"hella {result['acc_norm']:.4f}", {"hellaswag/acc_norm": result["acc_norm"]},
                            f"step {step:5d} | HellaSwag acc_norm {result['acc_norm']:.4f} "
                            f"({result['correct_norm']}/{result['total']})")
                if setup.score_core and run.due(step, args.core_every):
                    with autocast:
                        result = setup.score_core(setup.eval_model)
                    run.log(step, f"core {result['core']:.4f}", {"core/score": result["core"]},
                            f"step {step:5d} | CORE {result['core']:.4f} ({len(result['tasks'])} tasks)")
                if step > 0 and run.due(step, args.sample_every) and (run.master or run.fsdp):  # FSDP: every rank
                    run.say("\n".join(sample_lines(raw_model, tokenizer, device, autocast, args.seed + step,
                                                    args.sample_prompt)))

            # --------------- TRAINING SECTION BEGIN -----------------------------------------
            model.train()
            t0 = time.time()
            attempt = Attempt(retry=True)
            while attempt.retry:  # out of memory, the step runs again from its start at a smaller micro-batch
                micro = args.batch_size * args.seq_len * world_size  # tokens of one micro-batch of every process
                grad_accum_steps = micro_batches_per_step(tokens_seen, micro, args.total_batch_size,
                                                          args.batch_size_warmup_tokens, **setup.ramp)
                loss_accum, numbers = torch.zeros((), device=device), {}
                with run.keeping_progress(step, attempt):  # a failure here first saves the last step's state
                    for micro_step in range(grad_accum_steps):
                        x, y = train_loader.next_batch()
                        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                        if ddp:  # all-reduce (FSDP: reduce-scatter) the gradients on the last micro-step only
                            sync_gradients(model, micro_step == grad_accum_steps - 1)
                        with autocast:
                            loss, logged = batch_loss(model, x, y, args)
                        # we have to scale the loss to account for gradient accumulation, because the gradients
                        # just add on each successive backward(): a sum, where we want the mean over the batch
                        loss = loss / grad_accum_steps
                        loss_accum += loss.detach()
                        for name, value in logged.items():  # the objective's own numbers, averaged as the loss is
                            numbers[name] = numbers.get(name, 0.0) + value.detach().float() / grad_accum_steps
                        scaler.scale(loss).backward()
            loss_accum = all_reduce_mean(loss_accum, ddp, world_size)
            numbers = {name: all_reduce_mean(value, ddp, world_size) for name, value in numbers.items()}
            scaler.unscale_(optimizer)
            norm = clip_grad_norm(raw_model, args.grad_clip)
            lr = lr_schedule(step)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr * param_group.get("lr_scale", 1.0)  # the matrices': their rate / --max_lr
            # a non-finite loss or gradient skips the update; decided on the device where the optimizer can, so the
            # CPU queues the update without waiting for the backward to end
            finite = step_if_finite(optimizer, scaler, loss_accum, norm)
            optimizer.zero_grad(set_to_none=True)  # now: evaluations and checkpoints need the memory
            # the step's one wait: its numbers to the host, once the GPU has finished the step
            loss_accum, norm, finite, *values = torch.stack((loss_accum, norm.float(), finite.float(),
                                                             *numbers.values())).tolist()
            dt = time.time() - t0
            # --------------- TRAINING SECTION END -------------------------------------------
            # everything that follows now is just diagnostics, prints, logging and checkpoints

            step_tokens = grad_accum_steps * micro
            tokens_seen += step_tokens
            run.log_step(step, loss_accum, lr, norm, dt, step_tokens, tokens_seen, bool(finite),
                         dict(zip(numbers, values)))
            if run.checkpoint(step, tokens_seen):  # a signal to any rank: it saved, and the run stops
                break
        run.summary(world_size, tokens_seen, train_loader.total_tokens)


@dataclass
class TrainingSetup:
    """What set_up() builds for the loop (every field has a default, so that one more can go anywhere)."""
    model: nn.Module = None  # the one to train: compiled, and wrapped by DDP (FSDP: sharded in place)
    eval_model: nn.Module = None  # compiled apart, not wrapped: validation, HellaSwag and CORE run on every rank alone
    raw_model: nn.Module = None  # the GPT itself: its weights, clipping, samples
    optimizer: object = None  # torch's AdamW (ZeRO-1: sharded), or the matrices' optimizer beside it
    scaler: torch.amp.GradScaler = None
    train_loader: object = None  # a DataLoaderLite, or the shuffled one
    val_loader: object = None  # None when --eval_every is 0
    score_hellaswag: object = None  # model -> this rank's share of HellaSwag scored; None when it is off
    score_core: object = None  # model -> CORE, this rank's share of its tasks scored; None when it is off
    start_step: int = 0
    tokens_seen: int = 0  # trained on before start_step
    ramp: dict = field(default_factory=dict)  # batch_ramp's: the batch warm-up in tokens, fixed at the start ({}: none)


def set_up(args, config, ckpt, ckpt_path, lr_schedule, run, ddp, rank, local_rank, world_size, device, dtype):
    """Everything the loop needs, in the lecture's order: seeds, data, model, optimizer, the checkpoint's
    state put back, the compiled and DDP-wrapped model, HellaSwag's examples and CORE's tasks; then, everything
    checked, the run's log folder and header. config: model_config's."""
    device_type = device.split(":")[0]
    torch.manual_seed(args.seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and newer
    with torch.device("meta"):  # the parameters counted without allocating them
        params = arguments.counted_parameters(make_gpt(config))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    fit = fits_by_trial(args, ckpt, device_type)
    if fit:  # the largest micro-batch it may take (twice the lecture's where the logits are never held); a trial
        # below picks the one that fits
        preset = RUN_PRESETS.get(args.model, {}).get("batch_size", BATCH_SIZE * (1 if args.loss_impl == "plain" else 2))
        args.batch_size, skipped = largest_batch_size(args, preset, config, params, dtype, device_type, world_size,
                                                      local_world_size, smallest=smallest_of_every_rank(ddp, device))
    arguments.check_batch_split(args, world_size, resuming=ckpt is not None)
    arguments.check_batch_warmup(args, world_size)
    ramp = batch_ramp(args, world_size, ckpt)  # before --batch_size auto's trial picks a smaller micro-batch
    # validation's rows per batch, fixed as the ramp is (in the checkpoint; one written before has its micro-batch)
    val_rows = ckpt.get("val_rows", args.batch_size) if ckpt is not None else args.batch_size
    arguments.check_memory(config, params, args, dtype, device_type, local_world_size)
    arguments.check_optimizer(args, dtype, lr_schedule)
    arguments.check_loss_impl(args.loss_impl, device_type)
    arguments.check_fp8(args.fp8, device)
    if args.data_dir == SHIPPED_TEXT_SHARDS and not list_shards(args.data_dir, "train"):
        run.on_rank0(shard_shipped_text, args.data_dir, run.say)  # the first `--model tiny` on a fresh clone
    if args.verify_data:
        run.on_rank0(verify_shards, args.data_dir)
    use_compile = choose_compile(args.compile, device, run.say)

    if ckpt is not None:
        raw_model = load_model(ckpt, source=ckpt_path)
    elif args.init_from != "scratch":
        raw_model = load_model(init_from=args.init_from)
    else:
        raw_model = make_gpt(config)
    raw_model.loss_impl, raw_model.recompute = args.loss_impl, args.recompute
    raw_model.to(device)
    if args.fp8:  # (its weights stay plain parameters: the checkpoints are as without it)
        layers = convert_to_fp8(raw_model, emulate=device_type == "cpu")
        run.say(f"--fp8: FP8 matmuls in {len(layers)} layers (the head and the MLPs)"
                f"{', emulated on the CPU (no speed)' if device_type == 'cpu' else ''}")
    zero, fsdp = choose_sharding(args.zero == 1, args.fsdp, ddp, dtype, run.say)
    if fsdp:  # sharded in place (and its Blocks compiled): every rank runs every forward
        shard_model(raw_model, dtype, device_type, use_compile)
    optimizer = raw_model.configure_optimizers(OptimizerSettings.of(args), device_type,
                                               torch.distributed.group.WORLD if ddp else None, args.fused_adamw)
    if zero:
        optimizer = zero_redundancy(optimizer)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == "fp16")
    # training's one graph, of static shapes; the evaluations (on every rank alone, without DDP) get their own
    model = raw_model if fsdp or not use_compile else torch.compile(raw_model, dynamic=False)
    if ddp and not fsdp:  # before the trial compiles it, so that Dynamo splits the graph at DDP's gradient buckets
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)
    eval_model = evaluation_model(raw_model, use_compile and not fsdp)
    split = functools.partial(describe_split, seq_len=args.seq_len, world_size=world_size,
                              total_batch_size=args.total_batch_size)
    if fit and fsdp:  # (a sharded step's collectives cannot be tried one process at a time)
        run.say(f"--batch_size auto: micro-batch {args.batch_size}, the largest the memory formula fits, untried under "
                f"--fsdp: {split(args.batch_size)}")
    if fit and not fsdp:
        trial = functools.partial(trial_step, model, optimizer, functools.partial(batch_loss, args=args),
                                  seq_len=args.seq_len, device=device, autocast=autocast_context(device_type, dtype))
        candidates = candidate_batch_sizes(args.total_batch_size, args.seq_len, world_size, args.batch_size)
        args.batch_size = fit_batch_size(candidates, fits_in_memory(trial, device_type), every_rank_agrees(ddp, device),
                                         run.say, split, skipped)
        if device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()  # the summary's peak is the run's, not the trials'
    arguments.check_ramp_unit(ramp, args, world_size)
    train_loader, val_loader = make_loaders(args, rank, world_size, run.warn, val_rows)
    start_step, tokens_seen = (0, 0) if ckpt is None else restore_training_state(
        ckpt, optimizer, scaler, train_loader, device_type, args.total_batch_size, raw_model if fsdp else None)
    if ddp:
        KEPT_UNTIL_EXIT.extend((model, raw_model, optimizer))  # see there
    score_hellaswag = hellaswag_scorer(args, rank, world_size, device, fsdp) if args.hellaswag_every else None
    score_core = (scorer_for_training(args.core_bundle, args.core_max_per_task, ddp, rank, world_size, device, fsdp)
                  if args.core_every else None)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device)
    accumulation = micro_batches_per_step(math.inf, args.batch_size * args.seq_len * world_size, args.total_batch_size)
    run.start(run_header(args, device, dtype, use_compile, world_size, raw_model, accumulation, lr_schedule, ramp,
                         borrowed_settings(args, build_parser(), RUN_PRESETS, RECIPES) if ckpt is None else (),
                         val_rows),
              ckpt=ckpt, ckpt_path=ckpt_path, fixed={"ramp": ramp, "val_rows": val_rows},
              start_step=start_step, model=raw_model, optimizer=optimizer, scaler=scaler, loader=train_loader,
              zero=zero, fsdp=fsdp, lr_schedule=lr_schedule, warnings=arguments.settings_not_kept(args, val_loader),
              flops_per_token=peak and raw_model.flops_per_token(args.seq_len, run.say),  # (where MFU is shown)
              peak=peak and peak * world_size)  # tokens/s counts the tokens of every rank: so does the peak, for MFU
    return TrainingSetup(model=model, eval_model=eval_model, raw_model=raw_model, optimizer=optimizer, scaler=scaler,
                         train_loader=train_loader, val_loader=val_loader, score_hellaswag=score_hellaswag,
                         score_core=score_core, start_step=start_step, tokens_seen=tokens_seen, ramp=ramp)


def model_config(args, saved_config=None):
    """The model this run trains: the checkpoint's when resuming (saved_config), the weights' with --init_from
    (read before loading them; a model flag that asks for another is refused), else the --model preset's shape
    with the model flags (GPTConfig's fields, from the command line or the --recipe) over it."""
    if saved_config is None and args.init_from == "scratch":
        config = config_from_flags(GPTConfig, args, MODEL_PRESETS[args.model])
        if config.vocab_size < GPT2_VOCAB_SIZE:
            raise UserError(f"--vocab_size {config.vocab_size}: the GPT-2 tokenizer makes {GPT2_VOCAB_SIZE} token "
                            f"ids, each needs a row; give {GPT2_VOCAB_SIZE} or more")
        return config
    config = saved_config
    if config is None:
        config = pretrained_config(args.init_from)
        refuse_another_model(config, args, f"--init_from {args.init_from}", "drop the flags (the weights bring it)")
        arguments.check_init_from_recipe(args, config)
    if args.seq_len > config.block_size:
        source = "the checkpoint" if saved_config is not None else f"--init_from {args.init_from}"
        raise UserError(f"--seq_len {args.seq_len} exceeds {source}'s context of {config.block_size}; "
                        f"give --seq_len {config.block_size} or less")
    return config


# -----------------------------------------------------------------------------
# Command line


def build_parser():
    p = CLIParser(description="Pretrain GPT-2 on token shards (single process, or DDP under torchrun).")
    g = p.add_argument_group("data and output")
    g.add_argument("--data_dir", default="edu_fineweb10B", not_empty=True,
                   help="folder of *_train_*.bin / *_val_*.bin shards (fineweb.py writes them)")
    g.add_argument("--log_dir", default="log", not_empty=True, resume="local",
                   help="log.txt and model_<step>.pt checkpoints go here")
    g.add_argument("--verify_data", action="store_true",
                   help="check the shards against manifest.json's sha256 before training")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="d12", choices=sorted(MODEL_PRESETS), resume="fixed",
                   help="shape preset: d12/d24/d36/d48 = GPT-2 124M/350M/774M/1558M; "
                        "tiny (4x128) also brings laptop-sized run settings")
    add_weights_flags(g, checkpoint=False, init_from_default="scratch", resume="fixed")
    add_config_flags(g, GPTConfig)  # --n_layer, --arch, ...: every field of GPTConfig
    g = p.add_argument_group("recipe and optimizer (docs/recipes.md)")
    g.add_argument("--recipe", default="gpt2", choices=sorted(RECIPES), resume="fixed",
                   help="gpt2: GPT-2's architecture and AdamW; modern: --arch llama --optimizer muon; speedrun: "
                        "--arch speedrun with the GPT-2 speedruns' optimizer set-up (Muon with momentum warm-up, AdamW "
                        "rates by role, warm-up/stable/decay; docs/recipes.md) (flags you give still win)")
    g.add_argument("--optimizer", default="adamw", choices=list(MATRIX_OPTIMIZERS), resume="fixed",
                   help="; ".join(entry.about for entry in MATRIX_OPTIMIZERS.values()))
    muon = MATRIX_OPTIMIZERS["muon"]
    g.add_argument("--muon_lr", type=float, default=muon.usual_rate, above=0, at_most=LARGEST_RATE,
                   usual=f"{muon.name}'s usual rate is ~{muon.usual_rate:g}",
                   help="Muon's peak learning rate; the schedule scales it as it scales --max_lr")
    g.add_argument("--muon_momentum_warmup", type=int, default=0, at_least=0,
                   help="Muon's momentum climbs from 0.85 to 0.95 over its first N steps (0: 0.95 throughout)")
    for role, what in (("embed", "the token and value embeddings"), ("head", "the output head")):
        g.add_argument(f"--{role}_lr", type=float, default=None, above=0, at_most=LARGEST_RATE, usual=ADAMW_USUAL,
                       resume="fixed",
                       help=f"AdamW's peak rate for {what}, at width 768, scaled by sqrt(768 / n_embd) as nanochat "
                            "does (default: --max_lr, unscaled)")
    g.add_argument("--scalar_lr", type=float, default=None, above=0, at_most=LARGEST_RATE, usual=ADAMW_USUAL,
                   resume="fixed",
                   help="AdamW's peak rate for the 1-D parameters: gains, biases, learned scalars (default: --max_lr)")
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--batch_size", type=batch_size_arg, default=BATCH_SIZE, at_least=1,
                   help="micro-batch size per process, or auto: the largest up to the preset's that fits (the default "
                        "on CUDA and MPS; a step that runs out of memory later runs again at half; docs/training.md)")
    g.add_argument("--seq_len", type=int, default=1024, at_least=1, resume="fixed",
                   help="tokens per row (the context length of a scratch model)")
    g.add_argument("--total_batch_size", type=int, default=524288, at_least=1, resume="fixed",
                   help="tokens per optimizer step; gradient accumulation makes it up")
    g.add_argument("--max_steps", type=int, default=19073, at_least=1,
                   help="optimizer steps (19073 x 524288 = 10B tokens)")
    g.add_argument("--batch_size_warmup_tokens", type=int, default=0, at_least=0, at_most=LARGEST_INT,
                   help="ramp the batch linearly from --batch_size_start to --total_batch_size over the first N tokens "
                        "(GPT-3); 0: off")
    g.add_argument("--batch_size_start", type=int, default=None,
                   help="tokens per step where the ramp starts, a multiple of batch_size*seq_len*world_size "
                        "(default: one such micro-batch)")
    g.add_argument("--warmup_steps", type=int, default=715, at_least=0, help="steps of linear learning-rate warmup")
    g.add_argument("--max_lr", type=float, default=6e-4, above=0, at_most=LARGEST_RATE, usual=ADAMW_USUAL,
                   help="peak learning rate, reached after the warmup")
    g.add_argument("--min_lr_frac", type=float, default=0.1, at_least=0, at_most=1,
                   help="the schedule ends at max_lr * min_lr_frac")
    g.add_argument("--lr_schedule", default="cosine", choices=["cosine", "wsd"],
                   help="after the warmup: cosine = half a cosine down to the minimum (GPT-2's); wsd = warm-up, stable, "
                        "decay: --max_lr until the last --warmdown_frac of the steps, then a straight line down")
    g.add_argument("--warmdown_frac", type=float, default=0.2, at_least=0, at_most=1,
                   help="wsd: the share of --max_steps spent going down")
    g.add_argument("--weight_decay", type=float, default=0.1, at_least=0, at_most=LARGEST_RATE, usual=ADAMW_USUAL,
                   help="AdamW weight decay of the 2-D tensors")
    g.add_argument("--grad_clip", type=float, default=1.0, at_least=0,
                   help="clip the global grad norm to this (0: off)")
    g.add_argument("--schedule_change", default="recompute", choices=["recompute", "stretch", "restart"],
                   help="--resume with other settings of the schedule (--max_steps, --warmup_steps, --max_lr, "
                        "--min_lr_frac, --lr_schedule, --warmdown_frac): recompute = the new settings' schedule from step "
                        "0 (the rate may jump at the resume step); stretch = from the rate at the resume step, down to "
                        "the minimum at the new --max_steps; restart = a new warmup from the resume step, then down")
    g.add_argument("--no_shuffle", action="store_true", resume="fixed", before=True,  # (before: the fixed order)
                   help="read the training shards and their documents in file order every epoch "
                        "(build-nanogpt's order); default: both shuffled each epoch from --seed")
    g = p.add_argument_group("evaluation, logging, checkpoints (every 0 = off)")
    g.add_argument("--eval_every", type=int, default=250, at_least=0, help="validation loss every N steps")
    g.add_argument("--val_steps", type=int, default=20, at_least=1, help="batches per validation, per process")
    g.add_argument("--hellaswag_every", type=int, default=250, at_least=0, help="HellaSwag accuracy every N steps")
    g.add_argument("--hellaswag_data", default=None, not_empty=True, needs=("hellaswag_every", "N"),
                   help="local HellaSwag .jsonl (default: hellaswag.py's downloaded val split)")
    g.add_argument("--hellaswag_limit", type=int, default=None, at_least=1, needs=("hellaswag_every", "N"),
                   help="score only the first N HellaSwag examples (default: all)")
    g.add_argument("--core_every", type=int, default=0, at_least=0,
                   help="CORE (DCLM's 22 tasks, as evaluate.py scores them) every N steps; 0: off")
    g.add_argument("--core_bundle", default=None, not_empty=True, needs=("core_every", "N"),
                   help="DCLM's eval bundle, a folder or .zip (default: evaluate.py's, downloaded once)")
    g.add_argument("--core_max_per_task", type=int, default=500, at_least=1, needs=("core_every", "N"),
                   help="score the first N of each CORE task's shuffled examples (nanochat scores 500 in training)")
    g.add_argument("--sample_every", type=int, default=250, at_least=0, help="print samples every N steps")
    g.add_argument("--sample_prompt", default=SAMPLE_PROMPT, needs=("sample_every", "N"),
                   help="the text the samples continue (24 tokens each)")
    g.add_argument("--save_every", type=int, default=5000, at_least=0,
                   help="checkpoint every N steps (also at the last step and on SIGTERM/Ctrl-C)")
    g.add_argument("--keep_checkpoints", type=int, default=0, at_least=0,
                   help="keep only the newest K checkpoints (0: keep all)")
    g.add_argument("--tensorboard", default=None, metavar="DIR", not_empty=True,
                   help="also write the run's scalars as TensorBoard events into DIR (needs `pip install tensorboard`)")
    g.add_argument("--tensorboard_run", default=None, metavar="NAME", not_empty=True, needs=("tensorboard", "DIR"),
                   help="the subfolder of --tensorboard DIR for this run's events (default: a new one named "
                        "<start time>-<log_dir's name>; --resume continues the checkpoint's)")
    g.add_argument("--wandb", default=None, metavar="PROJECT", not_empty=True,
                   help="also log the run's scalars to this Weights & Biases project "
                        "(needs `pip install wandb`; WANDB_MODE=offline logs locally)")
    g.add_argument("--wandb_id", default=None, not_empty=True, needs=("wandb", "PROJECT"),
                   help="the W&B run to log into (default: a new run; --resume continues the checkpoint's)")
    g.add_argument("--resume", action="store_true", resume="local",
                   help="continue the run in --log_dir from its newest loadable checkpoint, with its settings "
                        "(fresh start if none)")
    g.add_argument("--overwrite", action="store_true", resume="local",
                   help="start a new run in a --log_dir that holds an earlier run's checkpoints: they and its log.txt "
                        "are deleted once the new run has passed its checks (without it, such a folder is refused)")
    g.add_argument("--max_bad_steps", type=int, default=10, at_least=1,
                   help="stop after this many non-finite steps in a row (each is skipped)")
    g = p.add_argument_group("system")
    add_system_flags(g, dtype_help="autocast dtype; auto = bf16 on GPUs with it, else fp16; fp32 on cpu/mps")
    g.add_argument("--seed", type=int, default=1337, at_least=0, at_most=LARGEST_INT, resume="fixed",
                   help="seeds the weights' initialisation, the samples and the data order")
    g.add_argument("--loss_impl", default="plain", choices=LOSS_IMPLS,
                   help="plain: logits then F.cross_entropy (build-nanogpt's numbers); chunked: a linear + "
                        "cross-entropy head that never holds the (batch, vocab) logits (less memory and traffic); "
                        "fused: the same by Liger-Kernel's Triton kernel (a CUDA GPU; pip install liger-kernel); "
                        "without the logits --batch_size auto tries up to 128")
    g.add_argument("--fp8", action="store_true",
                   help="FP8 matmuls in the output head and the MLPs (torchao's float8 training; a GPU with FP8 "
                        "tensor cores, compute capability 8.9 or more; emulated on a CPU); checkpoints stay plain")
    g.add_argument("--fused_adamw", dest="fused_adamw", action="store_true", default=None,
                   help="AdamW's fused kernel, which also skips a non-finite step on the device without the host "
                        "waiting (default: on for CUDA; on a CPU the foreach AdamW, build-nanogpt's numbers)")
    g.add_argument("--no_fused_adamw", dest="fused_adamw", action="store_false", help="the foreach AdamW")
    g.add_argument("--peak_tflops", type=float, default=None, above=0,
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
    name_settings_in_help(p, {f"--model {name}": s for name, s in RUN_PRESETS.items()},
                          {f"--recipe {name}": s for name, s in RECIPES.items()})
    return p


def parse_args(argv=None, saved_args=None):
    """The run's settings. Each flag comes from the command line, else (resuming) the checkpoint's
    saved arguments, else the --model preset's run settings, else the --recipe's, else the parser's default.
    args.explicit is the set of flags given on the command line (args.given_as: each as spelt)."""
    parser = build_parser()
    given = parser.parse_marked(argv)  # the preset is the one of the --model given, or the default's
    if saved_args is not None:  # (a flag declared resume="local" is today's command line's only)
        kept = {name for name, option in parser.options.items() if option.resume != "local"}
        parser.set_defaults(**{k: v for k, v in saved_args.items() if k in kept})
    else:
        parser.set_defaults(**{**RECIPES[given.recipe], **RUN_PRESETS.get(given.model, {})})  # a laptop's sizes win
    args = parser.parse_args(argv)
    args.explicit, args.given_as = given.explicit, given.given_as
    return args


def main(argv=None):
    args, parser = parse_args(argv), build_parser()  # (parser: what each flag declares)
    arguments.check_torchrun_environment(os.environ)
    master = int(os.environ.get("RANK", 0)) == 0
    say = print if master else lambda *a: None
    ckpt_path, ckpt, saved_config = None, None, None
    refuse_checkpoint_lookalikes(args.log_dir)
    if args.resume and not args.overwrite:
        ckpt_path, ckpt = resume_checkpoint(args.log_dir, master,
                                            functools.partial(check_resumable, config_class=GPTConfig, make_model=make_gpt))
        if ckpt is not None:
            saved_args = arguments.saved_arguments(ckpt, parser)  # (a flag it predates: what it declares)
            saved_config = checkpoint_config(ckpt, ckpt_path, GPTConfig)
            args = parse_args(argv, saved_args)
            arguments.check_resume_args(args, saved_args, master, saved_config, MODEL_PRESETS, RECIPES, parser.options)
        else:
            say(f"--resume: no checkpoint in {args.log_dir}, starting fresh")
    elif find_checkpoints(args.log_dir) and not args.overwrite:
        raise UserError(f"{args.log_dir} already holds checkpoints of a run; pass --resume to continue it, "
                        "--overwrite to start over in it (its checkpoints are deleted), or choose another --log_dir "
                        "(nothing was changed)")
    if ckpt is None:
        args.data_dir = laptop_data_dir(args, say)
    arguments.check_args(args, RUN_PRESETS, parser.options)
    check_tracking(args)
    arguments.check_log_dir(args.log_dir)
    config = model_config(args, saved_config)
    arguments.check_evaluations_context(args, config)
    if ckpt is not None and arguments.resumed_run_finished(ckpt["step"], args.max_steps, ckpt_path, master):
        return
    lr_schedule = resumed_schedule(ckpt, saved_args, args, say, LRSchedule) if ckpt is not None else LRSchedule.of(args)
    train(args, config, lr_schedule, ckpt, ckpt_path)


if __name__ == "__main__":
    run_cli(main)
