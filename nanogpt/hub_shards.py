"""
fineweb.py --download: ready-made llm.c token shards fetched from a Hugging Face dataset repo, and a
manifest.json of them that train_gpt2.py --verify_data checks. Imports no torch.
"""

import json
import os

from nanogpt.cli import UserError, brief
from nanogpt.files import sha256_file
from nanogpt.shard_manifest import save_json
from nanogpt.shards import list_shards, read_shard


def download(repo_id, out, max_shards):
    """The *.bin shards at the top of the hub dataset repo `repo_id` (val first, `max_shards` of them, 0: all)
    into folder `out`, sizes checked against the hub's, and a manifest.json for --verify_data. A rerun resumes:
    huggingface_hub skips the files already complete."""
    import huggingface_hub as hub
    from huggingface_hub.utils import logging as hub_logging  # the package loads .utils lazily: import it by name

    hub_logging.set_verbosity_error()  # not a line per retry
    source = f"hub: {repo_id}"
    try:  # never over the shards of another manifest.json (tokenized, another repo's, not fineweb.py's)
        with open(os.path.join(out, "manifest.json")) as f:
            was = json.load(f)["source"]
    except FileNotFoundError:
        was = source
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise UserError(f"{out}/manifest.json is not one of fineweb.py ({brief(e)}); --download would replace it: "
                        "choose another --output_dir") from None
    if was != source:
        raise UserError(f"{out} holds shards of {str(was)[:100]}; --download would replace them: "
                        "choose another --output_dir")
    try:
        files = hub.HfApi().list_repo_tree(repo_id, repo_type="dataset")
        sizes = {f.path: f.size for f in files if f.path.endswith(".bin")}
        names = sorted(sizes, key=lambda n: ("_val_" not in n, n))[: max_shards or None]
        if not names:
            raise UserError(f"{repo_id} holds no .bin token shards at its top level; name a repo of llm.c shards")
        if others := {os.path.basename(p) for p in list_shards(out, "val") + list_shards(out, "train")} - set(sizes):
            raise UserError(f"{out} holds other shards ({min(others)}, ...) that train_gpt2.py would read too; "
                            "choose another --output_dir")
        hub.snapshot_download(repo_id, repo_type="dataset", local_dir=out, allow_patterns=names)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot download {repo_id} from the Hugging Face hub ({brief(e)}); check the network "
                        "and the repo name (rerunning resumes)") from None
    shards = []
    try:
        for path, size in ((os.path.join(out, n), sizes[n]) for n in names):
            if (got := os.path.getsize(path) if os.path.isfile(path) else 0) != size:
                raise UserError(f"{path}: {got} bytes where the hub has {size}; "
                                "delete it and run the same command again")
            name = os.path.basename(path)
            shards.append({"name": name, "tokens": len(read_shard(path)), "sha256": sha256_file(path)})
        manifest = {"source": source, "tokenizer": "gpt2 (as published)", "shards": shards,
                    "complete": True, "tokens": sum(s["tokens"] for s in shards)}
        save_json(os.path.join(out, "manifest.json"), manifest)
    except OSError as e:
        raise UserError(f"cannot write {out}/manifest.json ({brief(e)}); "
                        "free space and run the same command again") from None
    print(f"done: {len(shards)} shards, {sum(s['tokens'] for s in shards):,} tokens of {repo_id} in {out}")
