"""--fp8 (nanogpt/float8.py: torchao's float8 training on the head and the MLPs) on the CPU in torchao's emulation:
a converted layer computes FP8's numbers (against a simulation written here with torch's float8 dtypes); a tiny run
trains to within a stated bound of the fp32 run, its checkpoints are plain weights (the layers' names and shapes,
loadable without torchao's layers) and it resumes exactly; the refusals where it cannot run. Skipped without
torchao (.ci/run installs it).

    python -m pytest -q tests/test_fp8.py
"""

import importlib.util
import os

import pytest
import torch

import train_gpt2
from conftest import TINY_FLAGS, assert_cli_error, load_weights, make_shards, optional_package, read_log, script_cli
from nanogpt.float8 import convert_to_fp8, fp8_problem

pytestmark = pytest.mark.skipif(not optional_package("torchao"), reason="torchao is not installed (.ci/run puts it in "
                                                                          ".optional/)")

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def fp8_simulated(t):
    """t rounded as FP8's forward rounds it: scaled so that its largest magnitude is e4m3's largest (one scale a
    tensor, from its current values), cast to e4m3 and back, unscaled."""
    scale = E4M3_MAX / t.abs().max().clamp(min=1e-12)
    return (t * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / scale


def test_a_converted_layer_computes_fp8s_numbers():
    """The MLP's first layer and the head, converted: their outputs are those of the e4m3-rounded input and weight
    multiplied in fp32 (to fp32 rounding of a sum of 32 products), and far from the unrounded product."""
    torch.manual_seed(0)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    converted = convert_to_fp8(model, emulate=True)
    assert converted == ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj", "lm_head"]
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives
    x = torch.randn(8, 32)
    for layer in (model.transformer.h[0].mlp.c_fc, model.lm_head):
        with torch.no_grad():
            ours = layer(x)
            simulated = fp8_simulated(x) @ fp8_simulated(layer.weight).T + (layer.bias if layer.bias is not None else 0)
            exact = torch.nn.functional.linear(x, layer.weight, layer.bias)
        scale = (x.abs() @ layer.weight.abs().T).max().item()
        assert (ours - simulated).abs().max().item() <= 64 * 2**-24 * scale
        assert (ours - exact).abs().max().item() > 1e3 * 2**-24 * scale  # FP8's rounding shows


def fp8_run(data, log_dir, *extra):
    train_gpt2.main([*TINY_FLAGS, "--data_dir", data, "--log_dir", log_dir, "--max_steps", "6", "--eval_every", "0",
                     "--max_lr", "1e-2", *extra])
    return read_log(log_dir)["train"]


@pytest.mark.slow
def test_an_fp8_run_trains_as_fp32_does_saves_plain_weights_and_resumes_exactly(tmp_path):
    data = make_shards(str(tmp_path / "data"))
    plain = fp8_run(data, str(tmp_path / "fp32"), "--save_every", "0")
    fp8 = fp8_run(data, str(tmp_path / "fp8"), "--fp8", "--save_every", "3")
    # the stated bound: FP8's rounding (e4m3: 3 bits) moves each step's loss by at most 5% of fp32's here, and the
    # run learns as much (its last loss at most 5% above)
    assert all(abs(fp8[s] - plain[s]) <= 0.05 * plain[s] for s in plain), (plain, fp8)
    assert fp8[5] < 0.9 * fp8[0]  # it learns (from ln(50304) = 10.8)
    # plain weights: the fp32 run's names and shapes, loaded by every script without torchao's layers
    ours, theirs = load_weights(str(tmp_path / "fp8" / "model_00005.pt")), load_weights(str(tmp_path / "fp32" /
                                                                                              "model_00005.pt"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert all(type(v) is torch.Tensor for v in ours.values())
    train_gpt2.load_model(str(tmp_path / "fp8" / "model_00005.pt"))
    # resumed from step 2: the uninterrupted run's losses and weights, bit for bit
    os.remove(str(tmp_path / "fp8" / "model_00005.pt"))
    fp8_run(data, str(tmp_path / "fp8"), "--fp8", "--save_every", "3", "--resume")
    assert read_log(str(tmp_path / "fp8"))["train"] == fp8
    assert all(torch.equal(ours[k], v) for k, v in load_weights(str(tmp_path / "fp8" / "model_00005.pt")).items())


def test_where_fp8_cannot_run_it_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability 8.9 or more), and this GPU's is 8.0" in fp8_problem("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_problem("cuda:0") is None and fp8_problem("cpu") is None
    assert "not on mps" in fp8_problem("mps")
    data = make_shards(str(tmp_path / "data"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real_find_spec(name, *a))
    result = script_cli(capsys, train_gpt2.main, *TINY_FLAGS, "--data_dir", data, "--log_dir", tmp_path / "log", "--fp8")
    assert_cli_error(result, "--fp8 needs torchao", "pip install torchao")
    assert not (tmp_path / "log").exists()
