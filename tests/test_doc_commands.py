"""The command blocks of README.md and docs/*.md run as written, or say why not.

A command block is a fenced block whose language is bash, sh, shell or console (its `$ ` lines), or none.
Each runs with bash (`set -e -o pipefail`), with `python` this test's interpreter, from the root of a copy of
the project (the files git lists) that has the real ../shared beside it, as a clone has; a document's blocks
run in order in one copy, so a block may use what an earlier block of its document made. A block that cannot
run on a CPU within a minute (it needs a GPU, the internet, or minutes) has on the line before its fence

    <!-- not run by tests: the reason -->

    python -m pytest -q tests/test_doc_commands.py
"""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT

DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
COMMAND_LANGUAGES = ("", "bash", "sh", "shell", "console")
FENCE = re.compile(r"^( *)(`{3,}|~{3,})\s*([^\s`]*)")
MARKER = re.compile(r"^<!-- not run by tests:(.*)-->$")
SHARED = os.path.join(ROOT, "..", "shared")
BLOCK_TIMEOUT = 120  # seconds: a block meant to take under a minute, on a busy machine


def command_blocks(text):
    """(blocks, problems) of a Markdown text. blocks: (line number of the fence, the commands, the reason it is
    not run or None) for each command block; problems: markers that are malformed, have no reason, or stand
    before no command block."""
    lines = text.splitlines()
    blocks, problems, marked = [], [], {}
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.search(r"<!--.*not\s+run", line, re.IGNORECASE):
            match = MARKER.match(line.strip())
            reason = match and match.group(1).strip()
            if not reason:
                problems.append(f"line {i + 1}: a marker is `<!-- not run by tests: the reason -->`: {line.strip()}")
            fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if not fence or fence.group(3) not in COMMAND_LANGUAGES:
                problems.append(f"line {i + 1}: the marker is not on the line before a command block's fence")
            marked[i + 2] = reason
        fence = FENCE.match(line)
        if not fence:
            i += 1
            continue
        indent, mark, language = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(mark)
                    and not lines[j].strip().strip(mark[0])), len(lines))
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
        if language == "console":
            body = [ln[2:] for ln in body if ln.startswith("$ ")]
        if language in COMMAND_LANGUAGES:
            blocks.append((i + 1, "\n".join(body) + "\n", marked.get(i + 1)))
        i = end + 1
    return blocks, problems


def read_blocks(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return command_blocks(f.read())


def copy_of_project(tmp_path):
    """The project's files as git lists them (tracked, and new ones not ignored) in tmp_path/<its folder's name>,
    with tmp_path/shared the real ../shared: nothing a block writes reaches the checkout."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    project = tmp_path / os.path.basename(ROOT)
    for name in filter(None, listed):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):  # a file deleted in the checkout is listed until the deletion is committed
            os.makedirs(project / os.path.dirname(name), exist_ok=True)
            shutil.copy2(source, project / name)
    os.symlink(os.path.realpath(SHARED), tmp_path / "shared")
    return project


def shell_env(tmp_path):
    """The environment of a reader's shell: `python` is this interpreter, nothing of the checkout on PYTHONPATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    return env


def run_block(commands, cwd, env):
    """(exit code, output) of bash running the commands; a block still running after BLOCK_TIMEOUT is killed
    with all it started, and its exit code is None."""
    process = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", commands], cwd=cwd, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output


def test_every_marker_has_a_reason_and_a_block():
    for doc in DOCS:
        blocks, problems = read_blocks(doc)
        assert not problems, (doc, problems)
    assert any(reason is None for doc in DOCS for _, _, reason in read_blocks(doc)[0])


def test_the_reading_of_blocks_and_markers():
    text = "\n".join([
        "```bash", "echo run", "```",
        "<!-- not run by tests: needs a GPU -->", "```", "nvidia-smi", "```",
        "```python", "print('not a command')", "```",
        "- a list item:", "  ```sh", "  echo indented", "  ```",
        "```console", "$ echo prompt", "prompt", "```",
        "<!-- not run by tests: -->", "```bash", "echo no reason", "```",
        "<!-- not run by tests: no block after it -->", "", "```bash", "echo unmarked", "```",
        "<!-- not run by test: misspelt -->", "```bash", "echo misspelt", "```",
    ])
    blocks, problems = command_blocks(text)
    assert [(line, commands) for line, commands, _ in blocks] == [
        (1, "echo run\n"), (5, "nvidia-smi\n"), (12, "echo indented\n"), (15, "echo prompt\n"),
        (20, "echo no reason\n"), (25, "echo unmarked\n"), (29, "echo misspelt\n")]
    assert [reason for _, _, reason in blocks] == [None, "needs a GPU", None, None, "", None, None]
    assert len(problems) == 3 and "line 19" in problems[0] and "line 23" in problems[1] and "line 28" in problems[2]


def test_a_block_runs_with_this_python_and_fails_on_an_error_or_a_hang(tmp_path, monkeypatch):
    env = shell_env(tmp_path)
    assert run_block("python -c 'import sys; print(sys.executable)'", tmp_path, env) == (0, sys.executable + "\n")
    assert run_block("false\necho went on", tmp_path, env) == (1, "")
    assert run_block("false | cat\necho went on", tmp_path, env) == (1, "")
    monkeypatch.setattr(sys.modules[__name__], "BLOCK_TIMEOUT", 1)
    start = time.monotonic()
    code, output = run_block("echo started\nsleep 60 &\nwait", tmp_path, env)
    assert (code, output) == (None, "started\n")
    assert time.monotonic() - start < 30  # the output ended: the sleep, which holds it open, was killed too


RUN = [doc for doc in DOCS if any(reason is None for _, _, reason in read_blocks(doc)[0])]


@pytest.mark.slow
@pytest.mark.parametrize("doc", RUN)
def test_the_commands_of(doc, tmp_path):
    if not os.path.isdir(SHARED) and any(reason is None and "../shared" in commands
                                         for _, commands, reason in read_blocks(doc)[0]):
        pytest.skip(f"{doc} copies from ../shared (the benchmark shards, build-nanogpt), not beside this clone")
    project = copy_of_project(tmp_path)
    env = shell_env(tmp_path)
    for line, commands, reason in read_blocks(doc)[0]:
        if reason is None:
            code, output = run_block(commands, project, env)
            said = f"ran past {BLOCK_TIMEOUT} s" if code is None else f"exit code {code}"
            assert code == 0, f"{doc}:{line}: {said}\n{commands}\n{output[-4000:]}"


@pytest.mark.slow
def test_the_fine_tuning_commands_with_a_small_random_gpt2(tmp_path, monkeypatch):
    """docs/training.md's fine-tuning block needs GPT-2's weights in gpt2-local/ (500 MB, brought from a machine with
    the internet): it runs as written with a random transformers GPT-2 of two layers saved there in their place, and
    the run trains that model (the parameters its log gives are transformers' count of it)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    blocks = [commands for _, commands, reason in read_blocks("docs/training.md")[0]
              if reason and "a small random GPT-2" in reason]
    assert len(blocks) == 1
    project = copy_of_project(tmp_path)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=256))
    model.save_pretrained(project / "gpt2-local")
    # four scripts, the tokenizing of a 1.8 MB text and 20 steps: more than one block's minute on a busy machine
    monkeypatch.setattr(sys.modules[__name__], "BLOCK_TIMEOUT", 3 * BLOCK_TIMEOUT)
    code, output = run_block(blocks[0], project, shell_env(tmp_path))
    assert code == 0, f"{'ran past the limit' if code is None else code}\n{blocks[0]}\n{output[-4000:]}"
    log = (project / "log" / "mine" / "log.txt").read_text().splitlines()
    assert f"0 params {model.num_parameters()}" in log
    assert (project / "log" / "mine" / "plot.png").is_file()
