"""
transformers' GPT-2, Llama and Qwen3: reading their weights into our GPT (GPT-2 from the Hugging Face hub
or a local folder, the others from a local folder; refused in one line when our GPT would compute
something else with them) and writing ours as such a folder (generate_tokens.py --export_hf).
transformers is imported only when used.
"""

import math
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager

from nanogpt.cli import UserError, brief
from nanogpt.config_fields import check_exportable
from nanogpt.files import clearing_new_folders, disk_advice, lock_folder, unlock_folder
from nanogpt.layers import RMS_EPS
from nanogpt.tokenizer import GPT2_VOCAB_SIZE

HF_GPT2_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
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


def is_mask_buffer(name):
    """The causal-mask buffers older transformers versions keep in a GPT-2's state dict: not weights."""
    return name.endswith((".attn.bias", ".attn.masked_bias"))


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


def reachable(url, timeout=3.0):
    """Whether a TCP connection to url's host opens within timeout seconds: an offline machine is
    told at once, instead of after a client library's minutes of retries."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url)
    try:
        socket.create_connection((parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def local_shape(folder):
    """GPTConfig's fields of the model in a local transformers folder, from its config.json alone (cheap,
    offline): a GPT-2, or a Llama or Qwen3 (our arch "llama")."""
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            hf = AutoConfig.from_pretrained(folder)
    except Exception as e:  # no config.json, broken JSON, a model type transformers does not know
        if any(name.startswith("model_") and name.endswith(".pt") for name in os.listdir(folder)):
            raise UserError(f"--init_from {folder}: it is a log folder of train_gpt2.py (model_*.pt), not a transformers "
                            f"model; continue its run with train_gpt2.py --resume --log_dir {folder}, or load it with "
                            f"--checkpoint {folder} (generate_tokens.py, hellaswag.py)") from None
        raise UserError(f"--init_from {folder}: cannot read its config.json ({brief(e)}); "
                        "give a GPT-2, Llama or Qwen3 directory saved by save_pretrained") from None
    head = untied_head(folder, hf)
    if getattr(hf, "model_type", None) in LLAMA_TYPES:
        return llama_shape(hf, folder, head)
    return gpt2_shape(hf, folder, head)


def untied_head(folder, hf):
    """Whether a folder's weights untie the output head from the token embedding: config.json says so, or (as
    transformers decides) it says tie_word_embeddings but the weight files hold an lm_head.weight that differs
    from the embedding. Reads those two tensors only (lazily); a folder whose files cannot be read is judged by
    its config, and loading it fails later with its own message."""
    if not getattr(hf, "tie_word_embeddings", True):
        return True
    embedding = "model.embed_tokens.weight" if getattr(hf, "model_type", None) in LLAMA_TYPES else "transformer.wte.weight"
    tensors = stored_tensors(folder, ("lm_head.weight", embedding))
    return len(tensors) == 2 and not bool((tensors["lm_head.weight"] == tensors[embedding]).all())


def stored_tensors(folder, names):
    """{name: tensor} of those of `names` a transformers folder's weight files hold (safetensors, one file or an
    index of shards; else pytorch_model.bin, memory-mapped), or {} where they cannot be read."""
    import json

    import torch
    from safetensors import safe_open

    try:
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index) or os.path.isfile(os.path.join(folder, "model.safetensors")):
            files = json.load(open(index))["weight_map"] if os.path.isfile(index) else {}
            found = {}
            for name in names:
                with safe_open(os.path.join(folder, files.get(name, "model.safetensors")), "pt") as f:
                    if name in f.keys():
                        found[name] = f.get_tensor(name)
            return found
        bin_file = os.path.join(folder, "pytorch_model.bin")
        state = torch.load(bin_file, map_location="cpu", weights_only=True, mmap=True) if os.path.isfile(bin_file) else {}
        return {name: state[name] for name in names if name in state}
    except Exception:  # a damaged or foreign file: the full load reports it
        return {}


def gpt2_shape(hf, source, untied=False):
    """The shape (GPTConfig's fields) of a transformers GPT-2 config, or a one-line refusal naming every setting with which
    transformers' model computes something our GPT does not (so its weights would give other logits)."""
    get = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
    if get("model_type") != "gpt2":
        raise UserError(f"--init_from {source}: it holds a {get('model_type')!r} model, not GPT-2, Llama or Qwen3; "
                        f"give such a directory or a hub name ({', '.join(HF_GPT2_MODELS)})")
    n_embd, n_head = get("n_embd"), get("n_head")
    problems = []
    if get("vocab_size") < GPT2_VOCAB_SIZE:
        problems.append(f"vocab_size {get('vocab_size')} (the GPT-2 tokenizer makes {GPT2_VOCAB_SIZE} token ids)")
    if untied:
        problems.append("an output head of its own (tie_word_embeddings false, or an lm_head.weight that differs from the "
                        "embedding, which transformers loads untied); this GPT-2 ties the head to the embedding")
    if get("activation_function") not in TANH_GELUS:
        problems.append(f"activation_function {get('activation_function')} (this GPT: gelu_new)")
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
    return dict(block_size=get("n_positions"), vocab_size=get("vocab_size"), n_layer=get("n_layer"), n_head=n_head,
                n_embd=n_embd, mlp_hidden=get("n_inner") or 4 * n_embd)


def hf_state_dict(name_or_dir, arch="gpt2"):
    """The weights of a transformers model (a GPT-2: hub name or local folder; a Llama or Qwen3: local
    folder) in our GPT's layout, its head tied as transformers loads it. Weights of another shape than
    config.json's are refused in one line naming the first; tensors the model does not use are named in a
    warning (transformers leaves them out too)."""
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    model_class = GPT2LMHeadModel if arch == "gpt2" else AutoModelForCausalLM
    try:
        with quiet_transformers():
            options = dict(output_loading_info=True, ignore_mismatched_sizes=True)  # mismatches named below
            if os.path.isdir(name_or_dir):
                hf_model, info = model_class.from_pretrained(name_or_dir, **options)
            else:
                hf_model, info = hub_gpt2(model_class, name_or_dir, **options)
    except UserError:
        raise
    except Exception as e:  # missing or broken weight files
        hint = ("give a directory saved by save_pretrained" if os.path.isdir(name_or_dir)
                else "a hub name needs network access once, or give a local directory saved by save_pretrained")
        raise UserError(f"cannot load the weights of {name_or_dir!r} ({brief(e)}); {hint}") from None
    if info.get("mismatched_keys"):
        name, stored, expected = sorted(info["mismatched_keys"])[0]
        raise UserError(f"--init_from {name_or_dir}: its weights do not fit its config.json: {name} is "
                        f"{tuple(stored)} in the weight files, {tuple(expected)} by config.json "
                        f"({len(info['mismatched_keys'])} tensors differ); give the config.json its weights were saved with")
    unused = sorted(k for k in info["unexpected_keys"] if not is_mask_buffer(k))
    if unused:
        print(f"warning: --init_from {name_or_dir}: {len(unused)} tensors of its weight files are not part of the model "
              f"its config.json describes (e.g. {unused[0]}); they are left out, as transformers leaves them",
              file=sys.stderr)
    missing = sorted(k for k in info["missing_keys"] if not is_mask_buffer(k))
    if missing:  # transformers would fill them with random numbers
        kind = "GPT-2" if arch == "gpt2" else type(hf_model).__name__.removesuffix("ForCausalLM")
        raise UserError(f"--init_from {name_or_dir}: its weights lack {len(missing)} tensors of a {kind} "
                        f"(e.g. {missing[0]}); give a directory saved by save_pretrained of a {type(hf_model).__name__}")
    if arch == "gpt2":
        return hf_to_our_state_dict(hf_model.state_dict())
    theirs = hf_model.state_dict()
    tied = hf_model.get_output_embeddings().weight is hf_model.get_input_embeddings().weight  # as it loaded
    ours = {mine: theirs[name] for mine, name in llama_names(hf_model.config, tied).items()}
    ours.setdefault("lm_head.weight", ours["transformer.wte.weight"])  # tied: one tensor under both names
    return ours


# transformers' GPT-2 stores these as Conv1D, i.e. (in, out): transpose to nn.Linear's (out, in).
_HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_to_our_state_dict(hf_sd):
    sd = {}
    for k, v in hf_sd.items():
        if is_mask_buffer(k):
            continue
        sd[k] = v.t().contiguous() if k.endswith(_HF_TRANSPOSED) else v
    return sd


# What each export computes: the GPTConfig fields whose every value its transformers class holds (arch's value picks
# the export; zero_init only chose how training began). Any other field must have the value the config gives it from
# these alone (its default): a field added to GPTConfig is refused by every export until it is declared here and
# written by the export.
EXPORTED_FIELDS = {
    "gpt2": ("block_size", "vocab_size", "mask_padding", "n_layer", "n_head", "n_embd", "mlp_hidden", "arch",
             "zero_init"),
    "llama": ("block_size", "vocab_size", "mask_padding", "n_layer", "n_head", "n_embd", "mlp_hidden", "arch",
              "zero_init", "n_kv_head", "qk_norm", "rope_theta", "tie_embeddings"),
}


def export_hf(model, out_dir, also=None):
    """Write model as a transformers directory (config.json + model.safetensors): a GPT2LMHeadModel, or for
    our llama a LlamaForCausalLM (Qwen3ForCausalLM with QK-norm); a model neither computes is refused in
    one line naming the field. The padded vocabulary rows are dropped: the tokenizer never produces them.
    also(folder), if given, adds files to the export before it takes out_dir's name. Returns (the class
    written, also's result)."""
    cfg = model.config
    if cfg.arch not in EXPORTED_FIELDS:
        raise UserError(f"--export_hf: no transformers class computes --arch {cfg.arch}; the architectures that "
                        f"export are {', '.join(EXPORTED_FIELDS)}")
    vocab = min(cfg.vocab_size, GPT2_VOCAB_SIZE)
    if cfg.arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        n_inner = None if cfg.mlp_hidden == 4 * cfg.n_embd else cfg.mlp_hidden  # None: transformers' 4 x n_embd
        hf_model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                                              n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=n_inner,
                                              activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                              attn_pdrop=0.0, tie_word_embeddings=True))
    else:
        hf_model = llama_hf_model(cfg, vocab)
    kind = type(hf_model).__name__
    check_exportable(cfg, EXPORTED_FIELDS[cfg.arch], f"transformers' {kind}")
    check_export_dir(out_dir)
    ours = {k: v.detach().float().cpu()[:vocab] if k in ("transformer.wte.weight", "lm_head.weight")
            else v.detach().float().cpu() for k, v in model.state_dict().items()}
    if cfg.arch == "gpt2":
        sd = {k: v.t().contiguous() if k.endswith(_HF_TRANSPOSED) else v for k, v in ours.items()}
    else:
        sd = {theirs: ours[mine] for mine, theirs in llama_names(cfg).items()}
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])  # tied: transformers ties on load
    missing, unexpected = hf_model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not is_mask_buffer(k)]
    if missing or unexpected:
        raise RuntimeError(f"export_hf: missing {missing}, unexpected {unexpected}")
    out_dir = os.path.abspath(out_dir)
    umask = os.umask(0)
    os.umask(umask)
    parent = os.path.dirname(out_dir)
    with clearing_new_folders(parent):  # folders made above out_dir go again if the export fails
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot write --export_hf {out_dir} ({e.strerror or e}); pick another folder") from None
        clear_abandoned_exports(out_dir)
        try:  # written beside out_dir under a new name, then renamed: never a half export under out_dir
            tmp = tempfile.mkdtemp(dir=parent, prefix=os.path.basename(out_dir) + ".", suffix=".tmp")
            lock = lock_folder(tmp, EXPORT_LOCK, "--export_hf", "another export")  # marks it as a live export's
        except OSError as e:
            raise UserError(f"cannot write --export_hf {out_dir} ({e.strerror or e}); pick another folder") from None
        try:
            with quiet_transformers():  # no "Writing model shards" bar on stderr
                hf_model.save_pretrained(tmp, safe_serialization=True)
            added = also(tmp) if also is not None else None
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private; the export is as any new folder
            unlock_folder(tmp, EXPORT_LOCK, lock)
            lock = None
            if os.path.isdir(out_dir):
                os.rmdir(out_dir)  # only an empty directory is replaced (checked above)
            os.replace(tmp, out_dir)
        except BaseException as e:
            unlock_folder(tmp, EXPORT_LOCK, lock)
            shutil.rmtree(tmp, ignore_errors=True)
            from safetensors import SafetensorError  # a full disk while safetensors writes (it reports its own way)

            if isinstance(e, (OSError, SafetensorError)):
                raise UserError(f"cannot write --export_hf {out_dir} ({getattr(e, 'strerror', None) or brief(e)}); "
                                f"{disk_advice(e)}pick another folder (nothing was left behind)") from None
            raise
    return kind, added


EXPORT_LOCK = "export.lock"  # in an export's temporary folder while it is written


def clear_abandoned_exports(out_dir):
    """Remove the temporary folders that exports to out_dir killed before their rename left beside it
    (SIGKILL, a power cut): those holding an export.lock that no live process holds. A folder of the same
    kind of name without one is the user's, and an export writing now holds its lock: both are left."""
    parent, prefix = os.path.dirname(out_dir), os.path.basename(out_dir) + "."
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if not (name.startswith(prefix) and name.endswith(".tmp") and os.path.isdir(path) and not os.path.islink(path)
                and os.path.isfile(os.path.join(path, EXPORT_LOCK))):
            continue
        try:
            lock = lock_folder(path, EXPORT_LOCK, "--export_hf", "another export")
        except UserError:  # an export writing it now
            continue
        unlock_folder(path, EXPORT_LOCK, lock)
        shutil.rmtree(path, ignore_errors=True)


def check_export_dir(out_dir):
    """export_hf replaces out_dir: never do that to something the user already has."""
    if os.path.islink(out_dir):
        raise UserError(f"--export_hf {out_dir} is a link; give the path of a new folder (nothing was changed)")
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise UserError(f"--export_hf {out_dir} already exists; "
                        "remove it or give a new directory (nothing was changed)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.lexists(parent):  # folders that do not exist yet are made (export_hf)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f"--export_hf {out_dir}: {parent} is not a folder; give a path under a folder "
                        "(nothing was changed)")


# -----------------------------------------------------------------------------
# Llama and Qwen3: our arch "llama" (Qwen3 when it has QK-norm)

LLAMA_TYPES = ("llama", "qwen3")
# our per-block names -> transformers' (under model.layers.<i>.)
LLAMA_BLOCK_NAMES = {"ln_1.weight": "input_layernorm.weight", "attn.c_q.weight": "self_attn.q_proj.weight",
                     "attn.c_k.weight": "self_attn.k_proj.weight", "attn.c_v.weight": "self_attn.v_proj.weight",
                     "attn.c_proj.weight": "self_attn.o_proj.weight", "attn.q_norm.weight": "self_attn.q_norm.weight",
                     "attn.k_norm.weight": "self_attn.k_norm.weight", "ln_2.weight": "post_attention_layernorm.weight",
                     "mlp.c_gate.weight": "mlp.gate_proj.weight", "mlp.c_fc.weight": "mlp.up_proj.weight",
                     "mlp.c_proj.weight": "mlp.down_proj.weight"}


def rope_of(hf):
    """(theta, type) of a transformers config's rotary embedding (transformers 5: rope_parameters; 4: rope_theta
    and rope_scaling)."""
    params = getattr(hf, "rope_parameters", None) or {}
    scaling = getattr(hf, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return theta, params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))


def llama_shape(hf, source, untied=False):
    """The shape (GPTConfig's fields) of a transformers Llama or Qwen3 config, or a one-line refusal naming
    every setting with which it computes something our llama does not. untied: its weights untie the head."""
    get = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
    heads, width, kv_heads = get("num_attention_heads"), get("hidden_size"), get("num_key_value_heads")
    theta, rope_type = rope_of(hf)
    problems = []
    if not GPT2_VOCAB_SIZE <= get("vocab_size") <= 50304:
        problems.append(f"vocab_size {get('vocab_size')} (not the GPT-2 tokenizer's {GPT2_VOCAB_SIZE} token ids, "
                        "which this program's data and scripts use)")
    if get("hidden_act") not in ("silu", "swish"):  # transformers' names of one function
        problems.append(f"hidden_act {get('hidden_act')} (ours: silu)")
    if get("attention_bias", False) or get("mlp_bias", False):
        problems.append("biases (ours has none)")
    if width % heads or get("head_dim", width // heads) != width // heads:
        problems.append(f"head_dim {get('head_dim')} (ours: hidden_size / num_attention_heads)")
    if not kv_heads or heads % kv_heads:
        problems.append(f"num_key_value_heads {kv_heads} (must divide num_attention_heads {heads})")
    if rope_type != "default":
        problems.append(f"rope_type {rope_type} (ours: default)")
    if not math.isclose(get("rms_norm_eps", RMS_EPS), RMS_EPS):
        problems.append(f"rms_norm_eps {get('rms_norm_eps')} (ours: {RMS_EPS})")
    if get("use_sliding_window", False):
        problems.append("use_sliding_window true")
    try:
        theta = float(theta)
        if not theta >= 1 or not math.isfinite(theta):
            raise ValueError
    except (TypeError, ValueError):
        problems.append(f"rope_theta {theta!r} (a finite number >= 1)")
    if problems:
        raise UserError(f"--init_from {source}: a {get('model_type')} this program's llama cannot compute: "
                        f"{'; '.join(problems)}; give one exported by generate_tokens.py --export_hf")
    return dict(block_size=get("max_position_embeddings"), vocab_size=get("vocab_size"), n_layer=get("num_hidden_layers"),
                n_head=heads, n_embd=width, arch="llama", n_kv_head=kv_heads, qk_norm=get("model_type") == "qwen3",
                rope_theta=theta, mlp_hidden=get("intermediate_size"), tie_embeddings=not untied,
                mask_padding=False)  # (what transformers computes: a probability for every row)


def llama_names(config, tied=None):
    """{our name: transformers' name} of every weight of a llama (config: ours or transformers'; tied: whether the
    head is the embedding, when not the config's word)."""
    n_layer = getattr(config, "n_layer", None) or config.num_hidden_layers
    qk_norm = getattr(config, "qk_norm", None)
    qk_norm = config.model_type == "qwen3" if qk_norm is None else qk_norm
    if tied is None:
        tied = getattr(config, "tie_embeddings", None)
        tied = config.tie_word_embeddings if tied is None else tied
    names = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight"}
    for i in range(n_layer):
        names.update({f"transformer.h.{i}.{ours}": f"model.layers.{i}.{theirs}"
                      for ours, theirs in LLAMA_BLOCK_NAMES.items() if qk_norm or "_norm." not in ours})
    if not tied:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def llama_hf_model(cfg, vocab):
    """An empty transformers LlamaForCausalLM (Qwen3ForCausalLM with QK-norm) of our llama's config."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.mlp_hidden, num_hidden_layers=cfg.n_layer,
                  num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head, head_dim=cfg.n_embd // cfg.n_head,
                  max_position_embeddings=cfg.block_size, rms_norm_eps=RMS_EPS, rope_theta=cfg.rope_theta,
                  hidden_act="silu", attention_bias=False, tie_word_embeddings=cfg.tie_embeddings,
                  bos_token_id=GPT2_VOCAB_SIZE - 1, eos_token_id=GPT2_VOCAB_SIZE - 1)
    if cfg.qk_norm:
        return Qwen3ForCausalLM(Qwen3Config(**common, use_sliding_window=False))
    return LlamaForCausalLM(LlamaConfig(**common, mlp_bias=False))
