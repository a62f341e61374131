"""
The layers of train_gpt2.py's GPT beyond the lecture's GPT-2 ones: causal attention over a key/value cache (every
architecture's, generation's too), and the pieces of --arch llama and --arch speedrun, which train_gpt2.pieces_of
picks from a GPTConfig: the RMSNorm epsilon, rotary positions, llama's attention (separate q, k, v; fewer
key/value heads; QK-norm; the speedrun's value embeddings), SwiGLU, ReLU², the softcapped head. docs/recipes.md.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

RMS_EPS = 1e-6  # the RMSNorm epsilon of llama and the speedrun (Llama 3's and Qwen3's)
VE_GATE_CHANNELS = 12  # the input channels a value embedding's gate reads (nanochat's)


class KVCache:
    """Keys and values of the positions seen so far, so generation feeds one new token per step."""

    def __init__(self, config, batch_size, max_len, device, dtype):
        head_dim = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.pos = 0  # positions filled; GPT.hidden_states advances it


def attend(q, k, v, config, kv_cache=None, layer_idx=0):
    """Causal attention of the queries q (B, heads, T, head_dim) over the keys and values k, v (B, kv_heads, T,
    head_dim); each key/value head serves heads // kv_heads query heads in a row (grouped-query attention).
    With kv_cache, k and v are appended to the layer's cache and q attends over all of it. Every architecture's
    attention comes here with its GPTConfig, so an option of how queries see keys is one edit."""
    T = q.size(2)
    p = 0 if kv_cache is None else kv_cache.pos
    if kv_cache is not None:
        kv_cache.k[layer_idx, :, :, p : p + T] = k
        kv_cache.v[layer_idx, :, :, p : p + T] = v
        k, v = kv_cache.k[layer_idx, :, :, : p + T], kv_cache.v[layer_idx, :, :, : p + T]
    if q.size(1) != k.size(1):
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    if kv_cache is not None and T == 1:  # one new query sees every cached position
        return F.scaled_dot_product_attention(q, k, v)
    if p == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(T, p + T, dtype=torch.bool, device=q.device).tril(diagonal=p)  # a chunk after a prefix
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Rotary(nn.Module):
    """Rotary position embeddings (RoPE, as Llama and Qwen3 apply them): the two halves of each head's
    vector rotated by position x theta**(-2i/head_dim); attention then sees only relative positions. The angles
    of the positions at hand are computed at each call (T x head_dim/2 products, the very numbers a table would
    hold), so no table of the whole context is kept: a long context costs nothing until it is used."""

    def __init__(self, head_dim, theta):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, start):
        """x (B, heads, T, head_dim) at positions start .. start + T - 1."""
        positions = torch.arange(start, start + x.size(2), dtype=torch.float32, device=x.device)
        angles = torch.outer(positions, self.inv_freq).repeat(1, 2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    """q, k and v from matrices of their own (fewer key/value heads; Muon orthogonalises each on its own),
    QK-norm where asked (norm: size -> the architecture's RMSNorm), rotary positions, no biases."""

    def __init__(self, config, layer_idx, norm):
        super().__init__()
        self.config, self.layer_idx, self.n_head, self.n_kv_head = config, layer_idx, config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.q_norm = norm(self.head_dim) if config.qk_norm else nn.Identity()
        self.k_norm = norm(self.head_dim) if config.qk_norm else nn.Identity()
        self.rotary = Rotary(self.head_dim, config.rope_theta)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        # speedrun: the gate of each key/value head's share of a value embedding, from the input's first channels
        with_ve = config.value_embeds and layer_idx in value_embed_layers(config)
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, self.n_kv_head, bias=False) if with_ve else None

    def forward(self, x, kv_cache=None, ve=None):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if ve is not None:  # speedrun: a value embedding (B, T, kv_heads * head_dim) mixed in, gated in (0, 2)
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS])).transpose(1, 2)[..., None]
            v = v + gate * ve.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        start = 0 if kv_cache is None else kv_cache.pos
        q, k = self.rotary(self.q_norm(q), start), self.rotary(self.k_norm(k), start)  # after QK-norm, as Qwen3
        y = attend(q, k, v, self.config, kv_cache, self.layer_idx)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class SwiGLU(nn.Module):
    """silu(x W_gate) * (x W_fc), of mlp_hidden units, then back down; no biases."""

    def __init__(self, config):
        super().__init__()
        self.c_gate = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.c_fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x):
        return self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))


class ReLUSquared(nn.Module):
    def forward(self, x):
        return F.relu(x).square()


class SoftcappedLinear(nn.Linear):
    """The output head with its logits squashed into (-cap, cap): cap * tanh(logits / cap) (--logit_softcap)."""

    def __init__(self, in_features, out_features, cap):
        super().__init__(in_features, out_features, bias=False)
        self.cap = cap

    def forward(self, x):
        return self.cap * torch.tanh(super().forward(x) / self.cap)


def value_embed_layers(config):
    """The layers with a value embedding: every other one, the last included (as nanochat)."""
    return [i for i in range(config.n_layer) if i % 2 == (config.n_layer - 1) % 2]
