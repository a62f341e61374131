"""A torchrun worker for tests/test_gpu_ready.py and tests/test_fitting.py: train_gpt2.main with what each test
watches or fakes, chosen by environment variables.

    COUNT_GRAPHS=1 torchrun --standalone --nproc_per_node=1 tests/torchrun_worker.py TRAIN_GPT2_FLAGS...

COUNT_GRAPHS=1: torch.compile's graphs of the training module are counted with a recording backend (AOTAutograd's
eager one behind it); Dynamo's DDP optimizer splits the training graph at DDP's gradient buckets, so that each
bucket's all-reduce starts while the backward of the pieces before it runs, and hands the backend one graph a
piece. Rank 0 prints `training graphs N`.
AVAILABLE_BYTES=a,b,...: the memory rank r sees as available is the r-th number; every rank prints `rank R trains
micro-batch B`.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_gpt2  # noqa: E402
from nanogpt import arguments  # noqa: E402


def main():
    rank, graphs = int(os.environ["RANK"]), []
    if os.environ.get("COUNT_GRAPHS"):
        compile_ = torch.compile

        def recording_compile(target, **kwargs):
            training = isinstance(target, train_gpt2.GPT)  # (the evaluations compile a module of their own)

            def record(gm, example_inputs):
                graphs.append(training)
                return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
            kwargs.pop("backend", None)
            return compile_(target, backend=record, **kwargs)
        torch.compile = recording_compile
    if os.environ.get("AVAILABLE_BYTES"):
        arguments.available_memory_bytes = lambda: int(os.environ["AVAILABLE_BYTES"].split(",")[rank])
        make_loaders = train_gpt2.make_loaders

        def said_loaders(args, *rest, **kwargs):
            os.write(1, f"rank {rank} trains micro-batch {args.batch_size}\n".encode())
            return make_loaders(args, *rest, **kwargs)
        train_gpt2.make_loaders = said_loaders
    train_gpt2.main(sys.argv[1:])
    if graphs and rank == 0:
        os.write(1, f"training graphs {sum(graphs)}\n".encode())
    os._exit(0)  # as run_cli ends a DDP run (nanogpt.runtime.KEPT_UNTIL_EXIT)


if __name__ == "__main__":
    main()
