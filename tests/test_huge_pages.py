"""generate_tokens.py asks torch for huge pages before its first tensor (use_huge_pages): torch reads
THP_MEM_ALLOC_ENABLE once, at a process's first CPU tensor, so importing the scripts must create none and its
main() must set it first; train_gpt2.py leaves the choice to the user. Seen from outside as page faults: a fresh
64 MB tensor costs ~16,000 of them on 4 KB pages and ~32 on 2 MB pages. Measured against torch's own switch set
in the environment, in fresh processes."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import os, resource, sys
sys.path.insert(0, {root!r})
import evaluate, generate_tokens, hellaswag, train_gpt2
script = {script!r}
if script:
    try:
        sys.modules[script].main(["--help"])  # main's first lines, then argparse's exit
    except SystemExit:
        pass
import torch
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 << 20).fill_(1.0)  # 64 MB, a new block each time (torch returns it to the system)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del x
print(sorted(faults)[1])
"""
PAGES = (64 << 20) // 4096
# The full suite's: fresh processes of every script, and no model in them.
pytestmark = pytest.mark.slow


def page_faults(script, switch=None):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if switch is not None:
        env["THP_MEM_ALLOC_ENABLE"] = switch
    done = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, script=script)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


@pytest.fixture(scope="module")
def huge_pages_work_here():
    off, on = page_faults("", "0"), page_faults("", "1")
    if off < PAGES / 2:
        pytest.skip(f"this machine gives big blocks huge pages unasked (transparent huge pages 'always'): "
                    f"{off:.0f} page faults per 64 MB with the switch off")
    if on > off / 8:
        pytest.skip(f"transparent huge pages are off on this machine (THP_MEM_ALLOC_ENABLE=1: {on:.0f} page faults "
                    f"per 64 MB, {off:.0f} without)")
    return off


def test_sampling_asks_for_huge_pages_before_its_first_tensor(huge_pages_work_here):
    assert page_faults("generate_tokens") < huge_pages_work_here / 8


@pytest.mark.parametrize("script", ["train_gpt2", "hellaswag", "evaluate"])
def test_training_and_scoring_leave_the_choice_to_the_user(script, huge_pages_work_here):
    assert page_faults(script) > huge_pages_work_here / 2
    assert page_faults(script, "1") < huge_pages_work_here / 8


def test_a_users_choice_is_kept(huge_pages_work_here):
    assert page_faults("generate_tokens", "0") > huge_pages_work_here / 2
