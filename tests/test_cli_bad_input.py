"""Bad input, systematically: every flag of hellaswag.py, generate_tokens.py and plot_log.py walked
through bad values (0, negative, nan, inf, huge, not a number, empty, missing files, folders where a
file belongs, broken checkpoints, unwritable outputs). Each must end as a user error: one line, exit
2, no traceback, nothing of the user's changed. The tables run in process (main() raising UserError,
or argparse's SystemExit(2) with one line on stderr); a few subprocesses check the same end to end.
Run: python -m pytest -q tests/test_cli_bad_input.py"""

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import torch

import generate_tokens
import hellaswag
import plot_log
from conftest import assert_one_line_error, run_script
from nanogpt import hellaswag_eval
from nanogpt.cli import UserError
from train_gpt2 import GPT, GPTConfig

NUMBERS = ["0", "-1", "nan", "inf", "-inf", "1e30", "abc", "", "1.5"]  # bad for a count of at least 1
HUGE = str(2**63)
DEVICES = ["", "nan", "gpu", "tpu:0", "/tmp"]


pytestmark = pytest.mark.usefixtures("one_thread")


def replace_flag(argv, flag, value):
    """argv with flag set to value: replaced where it is given, appended where not."""
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


def snapshot(root):
    """Every file under root with its bytes: what 'nothing changed' compares."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                with open(path, "rb") as f:
                    out[path] = f.read()
    return out


def refusal(main, argv, capsys):
    """main(argv) as a user error: returns its one line, or raises AssertionError saying what went wrong.
    Any other exception propagates, with its traceback: that is the bug the table looks for."""
    capsys.readouterr()
    try:
        main(argv)
    except UserError as e:
        line = f"error: {e}"
    except SystemExit as e:  # argparse, through CLIParser.error
        assert e.code == 2, f"exit code {e.code}"
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1, f"stderr has {len(lines)} lines: {lines}"
        line = lines[0]
    else:
        raise AssertionError("accepted")
    assert "\n" not in line and line.startswith("error: ") and len(line) > 20, repr(line)
    return line


def run_table(main, cases, capsys, root):
    """cases: (argv, words the line must contain). Every case runs; the failures are listed together."""
    before = snapshot(root)
    problems = []
    for argv, *words in cases:
        try:
            line = refusal(main, argv, capsys)
            missing = [w for w in words if w not in line]
            assert not missing, f"{missing} not in {line!r}"
        except AssertionError as e:
            problems.append(f"{argv}: {e}")
    assert not problems, f"{len(problems)} of {len(cases)} cases:\n" + "\n".join(problems)
    assert snapshot(root) == before, "a refused command changed files"
    return len(cases)


# -----------------------------------------------------------------------------
# broken checkpoints, for both model-loading scripts


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_input")
    model = tiny_gpt()
    good = {"model": model.state_dict(), "config": asdict(model.config), "step": 0}
    paths = {"dir": str(d)}

    def save(name, obj):
        paths[name] = str(d / f"{name}.pt")
        torch.save(obj, paths[name])

    save("good", good)
    with open(paths["good"], "rb") as f:
        data = f.read()
    raw = {"truncated": data[: len(data) // 2], "empty": b"", "json": json.dumps({"model": {}, "config": {}}).encode(),
           "text": b"hello\n"}
    for name, content in raw.items():
        paths[name] = str(d / f"{name}.pt")
        with open(paths[name], "wb") as f:
            f.write(content)
    save("list", [1, 2, 3])
    save("no_model", {"config": good["config"]})
    save("no_config", {"model": good["model"]})
    save("model_list", {"model": [1, 2], "config": good["config"]})
    save("model_numbers", {"model": {k: 1 for k in good["model"]}, "config": good["config"]})
    save("config_str", {"model": good["model"], "config": "d12"})
    save("config_missing_keys", {"model": good["model"], "config": {k: v for k, v in good["config"].items() if k != "n_layer"}})
    save("config_unknown_key", {"model": good["model"], "config": dict(good["config"], dropout=0.1)})
    save("n_head_0", {"model": good["model"], "config": dict(good["config"], n_head=0)})
    save("n_head_3", {"model": good["model"], "config": dict(good["config"], n_head=3)})  # 32 % 3 != 0
    save("n_layer_neg", {"model": good["model"], "config": dict(good["config"], n_layer=-1)})
    save("block_neg", {"model": good["model"], "config": dict(good["config"], block_size=-5)})
    save("other_arch", {"model": good["model"], "config": dict(good["config"], n_embd=64)})
    save("nan_weights", {"model": {k: torch.full_like(v, float("nan")) for k, v in good["model"].items()}, "config": good["config"]})
    # folders: one without checkpoints, one whose newest "checkpoint" is a folder, one whose newest is truncated
    for name in ("no_ckpts", "ckpt_is_dir", "newest_truncated", "hf_folder"):
        os.mkdir(d / name)
        paths[name] = str(d / name)
    os.mkdir(d / "ckpt_is_dir" / "model_00005.pt")
    (d / "hf_folder" / "config.json").write_text('{"model_type": "gpt2"}')  # what save_pretrained writes first
    with open(d / "newest_truncated" / "model_00009.pt", "wb") as f:
        f.write(raw["truncated"])
    torch.save(good, d / "newest_truncated" / "model_00001.pt")
    # HellaSwag data
    example = {"ctx": "A man", "ctx_a": "A man", "ctx_b": "", "activity_label": "x", "endings": ["a", "b", "c", "d"], "label": 1}
    lines = {"data": "".join(json.dumps(dict(example, label=i)) + "\n" for i in range(3)),
             "data_not_json": "{oops\n", "data_empty": "\n\n", "data_bad_label": json.dumps(dict(example, label=7)) + "\n"}
    for name, text in lines.items():
        paths[name] = str(d / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.write(text)
    paths["data_binary"] = str(d / "data_binary.jsonl")
    with open(paths["data_binary"], "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n\xff\xfe")
    paths["missing"] = str(d / "missing.pt")
    return paths


def checkpoint_cases(f):
    """(--checkpoint value, words of the error) for every broken checkpoint."""
    return [
        ("", "--checkpoint"),
        (f["missing"], "does not exist"),
        (f["no_ckpts"], "no model_*.pt"),
        (f["hf_folder"], "no model_*.pt", "--init_from"),
        (f["ckpt_is_dir"], "no model_*.pt"),  # a folder named model_00005.pt is not a checkpoint
        (f["newest_truncated"], "model_00009.pt", "truncated"),
        (f["truncated"], "truncated"),
        (f["empty"], "truncated"),
        (f["json"], "not a checkpoint"),
        (f["text"], "not a checkpoint"),
        (f["list"], "not a checkpoint"),
        (f["no_model"], "no model"),
        (f["no_config"], "config"),
        (f["model_list"], "model_list.pt"),
        (f["model_numbers"], "do not fit"),
        (f["config_str"], "config_str.pt"),
        (f["config_missing_keys"], "not a GPT shape"),
        (f["config_unknown_key"], "dropout"),
        (f["n_head_0"], "n_head_0.pt"),
        (f["n_head_3"], "n_head_3.pt"),
        (f["n_layer_neg"], "not a GPT shape"),
        (f["block_neg"], "block_neg.pt"),
        (f["other_arch"], "do not fit", "size mismatch"),  # the first mismatch is named
        (f["nan_weights"], "NaN"),
    ]


def init_from_cases(f):
    return [("", "--init_from"), ("gpt5", "gpt5"), (f["missing"], "missing.pt"), (f["data"], "data.jsonl"), (f["no_ckpts"], "no_ckpts")]


# -----------------------------------------------------------------------------
# hellaswag.py


def test_hellaswag_bad_input_table(files, capsys, monkeypatch):
    f = files
    # offline: no download
    monkeypatch.setattr(hellaswag_eval, "DATA_URL", "http://127.0.0.1:9/hellaswag_{split}.jsonl")
    good = ["--checkpoint", f["good"], "--data", f["data"], "--device", "cpu"]

    def with_flag(flag, value, base=good):
        return replace_flag(base, flag, value)

    cases = []
    for flag in ("--batch_size", "--limit"):
        cases += [(with_flag(flag, v), flag) for v in NUMBERS]
    for flag, values in (("--dtype", ["", "nan", "FP32", "int8"]), ("--style", ["", "nan", "NANOGPT"])):
        cases += [(with_flag(flag, v), flag) for v in values]
    cases += [(with_flag("--device", v), "--device") for v in DEVICES]
    cases += [(with_flag("--checkpoint", path), *words) for path, *words in checkpoint_cases(f)]
    no_ckpt = good[2:]
    cases += [(no_ckpt + ["--init_from", path], *words) for path, *words in init_from_cases(f)]
    cases += [
        (with_flag("--data", ""), "--data"),
        (with_flag("--data", f["missing"]), "missing.pt does not exist"),
        (with_flag("--data", f["dir"]), "is a folder"),
        (with_flag("--data", f["data_not_json"]), "data_not_json.jsonl:1", "not valid JSON"),
        (with_flag("--data", f["data_binary"]), "not UTF-8"),
        (with_flag("--data", f["data_empty"]), "no HellaSwag examples"),
        (with_flag("--data", f["data_bad_label"]), "'label'"),
        (with_flag("--data", f["data"]) + ["--style", "harness", "--data", f["data_not_json"]], "not valid JSON"),
        # the download cache, with no --data (and no network)
        (["--checkpoint", f["good"], "--device", "cpu", "--cache_dir", ""], "--cache_dir"),
        (["--checkpoint", f["good"], "--device", "cpu", "--cache_dir", f["good"]], "--cache_dir"),
        (["--checkpoint", f["good"], "--device", "cpu", "--cache_dir", os.path.join(f["dir"], "new", "cache")], "cannot download"),
        # which model
        (good + ["--init_from", "gpt2"], "exactly one"),
        (good[2:], "exactly one"),
        (good + ["--bogus", "1"], "unrecognized"),
    ]
    n = run_table(hellaswag.main, cases, capsys, f["dir"])
    assert n >= 70
    # huge but meaningful numbers are accepted: a limit past the data is all of it, a batch past it is one pass
    capsys.readouterr()
    result = hellaswag.main(good + ["--limit", HUGE, "--batch_size", HUGE, "--dtype", "auto"])
    assert result["total"] == 3
    assert "dtype fp32 | compile False" in capsys.readouterr().out  # auto on a CPU: fp32, and no compiling


def test_hellaswag_out_of_memory_is_a_user_error(files, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(hellaswag, "evaluate", oom)
    with pytest.raises(UserError, match="out of memory on cpu scoring 3 examples per pass; lower --batch_size"):
        hellaswag.main(["--checkpoint", files["good"], "--data", files["data"], "--device", "cpu", "--batch_size", "64"])


# -----------------------------------------------------------------------------
# generate_tokens.py


def test_generate_bad_input_table(files, capsys, tmp_path):
    f = files
    good = ["--checkpoint", f["good"], "--device", "cpu", "--prompt", "Hi", "--max_new_tokens", "2", "--num_samples", "1"]
    export = good[:4]  # no sampling flags: --export_hf refuses those

    def with_flag(flag, value, base=good):
        return replace_flag(base, flag, value)

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "mine.txt").write_text("mine")
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("mine")
    (tmp_path / "empty").mkdir()
    link_to_empty = tmp_path / "link"
    link_to_empty.symlink_to(tmp_path / "empty")
    cases = []
    for flag in ("--num_samples", "--max_new_tokens"):
        cases += [(with_flag(flag, v), flag) for v in NUMBERS + [HUGE]]
    cases += [(with_flag("--temperature", v), "--temperature") for v in ["-1", "nan", "inf", "-inf", "1e-45", "1e-7", "abc", ""]]
    cases += [(with_flag("--top_k", v), "--top_k") for v in ["-1", "nan", "inf", "1e30", "abc", "", "1.5"]]
    cases += [(with_flag("--top_p", v), "--top_p") for v in ["0", "-0.1", "1.5", "nan", "inf", "1e30", "abc", ""]]
    cases += [(with_flag("--seed", v), "--seed") for v in ["-1", str(2**64), str(-(2**63) - 1), "nan", "1e30", "abc", ""]]
    cases += [(with_flag("--device", v), "--device") for v in DEVICES]
    cases += [(with_flag("--dtype", v), "--dtype") for v in ["", "nan", "int8", "FP32"]]
    cases += [(with_flag("--checkpoint", path), *words) for path, *words in checkpoint_cases(f)]
    cases += [(good[2:] + ["--init_from", path], *words) for path, *words in init_from_cases(f)]
    cases += [
        (with_flag("--prompt", "word " * 100), "longer than the model's context of 64"),
        (with_flag("--prompt", b"Hi \xff".decode("utf-8", "surrogateescape")), "--prompt is not valid UTF-8"),
        (export + ["--export_hf", ""], "--export_hf"),
        (export + ["--export_hf", str(a_file)], "already exists"),
        (export + ["--export_hf", str(occupied)], "already exists"),
        (export + ["--export_hf", str(a_file / "sub")], "a_file.txt is not a folder"),
        (export + ["--export_hf", str(a_file / "sub" / "deeper")], "a_file.txt is not a folder"),
        (export + ["--export_hf", str(link_to_empty)], "is a link"),
        (good + ["--export_hf", str(tmp_path / "new")], "drop --prompt"),  # sampling flags would be ignored
        # given, even at its default value, it would be ignored as silently
        (export + ["--export_hf", str(tmp_path / "new"), "--temperature", "1.0"], "drop --temperature"),
        (export + ["--export_hf", str(tmp_path / "new"), "--no_compile"], "drop --no_compile"),
        (export + ["--export_hf", str(tmp_path / "new"), "--int8"], "--int8"),
        (good + ["--int8", "--dtype", "bf16"], "--int8"),
        (good + ["--int8", "--compile"], "--int8"),
        (good + ["--init_from", "gpt2"], "exactly one"),
        (good + ["--bogus"], "unrecognized"),
    ]
    n = run_table(generate_tokens.main, cases, capsys, str(tmp_path))
    assert n >= 90
    assert sorted(os.listdir(tmp_path)) == ["a_file.txt", "empty", "link", "occupied"]  # no export was started


# -----------------------------------------------------------------------------
# plot_log.py


def test_plot_log_bad_input_table(tmp_path, capsys):
    log = tmp_path / "log.txt"
    log.write_text("0 train 11.0\n1 train 10.5\n1 val 10.9\n")
    texts = {"binary.txt": b"\x89PNG\r\n\x1a\n\x00\x01", "json.txt": b'{"step": 1, "loss": 3.2}\n', "empty.txt": b"",
             "blank.txt": b"\n \n", "latin1.txt": "0 tr\xe4in 3.2\n".encode("latin-1"), "notes.txt": b"my notes",
             "fake.png": b"not a png"}
    for name, content in texts.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / "no_log").mkdir()
    os.symlink(log, tmp_path / "link.png")
    L = str(log)
    cases = [
        ([""], "does not exist"),
        ([str(tmp_path / "missing.txt")], "does not exist"),
        ([str(tmp_path / "no_log")], "does not exist"),
        ([str(tmp_path / "binary.txt")], "binary.txt:1"),
        ([str(tmp_path / "json.txt")], "json.txt:1"),
        ([str(tmp_path / "latin1.txt")], "latin1.txt:1"),
        ([str(tmp_path / "empty.txt")], "no log lines"),
        ([str(tmp_path / "blank.txt")], "no log lines"),
        ([], "required"),
        ([L, L], "two runs are named"),  # the same log twice: the legend could not tell them apart
        ([L, "--out", L], "is the log"),
        ([L, "--out", str(tmp_path / "link.png")], "is the log"),
        ([L, "--out", str(tmp_path / "notes.txt")], "ending in .png"),
        ([L, "--out", str(tmp_path / "fake.png")], "not a PNG"),
        ([L, "--out", str(tmp_path / "empty.txt")], "ending in .png"),
        ([L, "--out", str(tmp_path)], "is a folder"),
        ([L, "--out", ""], "--out is empty"),
        ([L, "--out", str(tmp_path / "no" / "plot.png")], "does not exist"),
        ([L, "--out", str(tmp_path / "notes.txt" / "plot.png")], "does not exist"),
        ([L, "--out", str(tmp_path / ("x" * 300 + ".png"))], "cannot write"),  # a name too long for the file system
    ]
    for value in ["-1", "nan", "inf", "1e30", "abc", "", "1.5"]:
        cases.append(([L, "--smooth", value], "--smooth"))
    for i, line in enumerate(["5 train", "x val 3.2", "5 val abc", "5 val 3.2 extra", "-1 val 3.2", "5 val 3.2 skipped", "5 7up 3.2"]):
        (tmp_path / f"bad{i}.txt").write_text("0 train 11.0\n" + line + "\n")
        cases.append(([str(tmp_path / f"bad{i}.txt")], f"bad{i}.txt:2"))
    n = run_table(plot_log.main, cases, capsys, str(tmp_path))
    assert n >= 25
    # a window past the log's length is the mean of everything so far: accepted
    assert plot_log.main([L, "--smooth", HUGE, "--out", str(tmp_path / "ok.png")]) == str(tmp_path / "ok.png")


# -----------------------------------------------------------------------------
# end to end: the real command line prints one line and no traceback


@pytest.mark.slow
def test_end_to_end_one_line(files, tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("0 train 11.0\n")
    runs = [
        (["plot_log.py", str(log), "--out", str(log)], "is the log"),
        (["hellaswag.py", "--checkpoint", files["n_head_3"], "--data", files["data"], "--device", "cpu"], "n_head_3.pt"),
        (["generate_tokens.py", "--checkpoint", files["model_list"], "--prompt", "Hi"], "model_list.pt"),
    ]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda r: run_script(r[0]), runs))
    for (argv, needle), r in zip(runs, results):
        assert_one_line_error(r, "error: ", needle)
        assert r.returncode == 2 and r.stdout == "", argv
    assert log.read_text() == "0 train 11.0\n"
