"""
FP8 matmuls (train_gpt2.py --fp8): torchao's float8 training on the layers where the matmuls are largest, the
output head and the MLPs; dynamic tensorwise scales, e4m3 forward and e5m2 gradients, the matmuls' accumulation
and everything else in bf16 as before. The layers keep their weights as plain fp32 parameters, so checkpoints,
resumes, sampling, evaluation and export are as without it. Needs torchao and a GPU with FP8 tensor cores (Ada or
Hopper: compute capability 8.9 or more); on a CPU torchao emulates it (FP8's numbers, none of its speed).
"""

import importlib.util

import torch.nn as nn

FP8_MULTIPLE = 16  # torchao's float8 matmuls need both dimensions of a weight divisible by this


def fp8_problem(device):
    """Why --fp8 cannot run on device, in words, or None."""
    if importlib.util.find_spec("torchao") is None:
        return "needs torchao (`pip install torchao`, the release made for your torch)"
    if device.startswith("cuda"):
        import torch

        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return (f"needs FP8 tensor cores (Ada or Hopper: compute capability 8.9 or more), and this GPU's is "
                    f"{capability[0]}.{capability[1]}; train in bf16 without it")
    elif device != "cpu":
        return f"runs on a CUDA GPU (or emulated on a CPU), not on {device}"
    return None


def fp8_layer(module, name):
    """Whether --fp8 converts this layer: a plain nn.Linear (not the softcapped head, which adds to its matmul) of
    the output head or an MLP, whose weight's dimensions FP8's matmuls take."""
    return (type(module) is nn.Linear and (name == "lm_head" or ".mlp." in f".{name}.")
            and module.in_features % FP8_MULTIPLE == 0 and module.out_features % FP8_MULTIPLE == 0)


def convert_to_fp8(model, emulate):
    """model's fp8_layer layers, in place, made torchao's Float8Linear (weights kept, ties kept); emulate on a CPU.
    Returns the names of those converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = [name for name, module in model.named_modules() if fp8_layer(module, name)]
    convert_to_float8_training(model, module_filter_fn=fp8_layer, config=Float8LinearConfig(emulate=emulate))
    return names
