"""--fsdp with a tensor of fewer rows than ranks: FSDP2 shards dim 0, so a rank's shard of it is empty, and the
weights' health check after each step must look at the shards that hold something (CPU, gloo, 2 processes)."""

import os

import pytest

import train_gpt2
from conftest import ROOT, TINY_FLAGS, make_shards, read_log, run_script, torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["gpt2", "llama", "speedrun"])
def test_fsdp_trains_with_an_empty_shard(arch, tmp_path):
    # --mlp_hidden 1: the MLP's input projection has 1 row (the speedrun's skip_weights at n_layer 2 too), so rank
    # 1 of 2 holds none of it
    extra = ["--arch", arch, "--optimizer", "adamw", "--mlp_hidden", "1"]
    model = train_gpt2.make_gpt(train_gpt2.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, arch=arch,
                                                     mlp_hidden=1))
    assert any(p.shape[0] == 1 for p in model.parameters())
    data, log_dir = make_shards(str(tmp_path / "data")), str(tmp_path / "log")
    result = torchrun(2, *TINY_FLAGS, *extra, "--fsdp", "--data_dir", data, "--log_dir", log_dir, "--max_steps", "2",
                      "--eval_every", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(read_log(log_dir)["train"]) == [0, 1]
    assert os.path.exists(os.path.join(log_dir, "model_00001.pt"))


def test_the_health_check_with_empty_shards_still_finds_a_nan_on_another_rank():
    result = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                         os.path.join(ROOT, "tests", "fsdp_health_worker.py")], timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(ln for ln in result.stdout.splitlines() if ln.startswith("rank "))
    assert lines == ["rank 0: empty shards 0, healthy True, after a NaN on rank 0: False",
                     "rank 1: empty shards 1, healthy True, after a NaN on rank 0: False"], result.stdout
