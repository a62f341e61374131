"""A run option declared once (nanogpt.cli.RunOption, in build_parser's add_argument): a flag added at run time with
its range, what it needs and its resume policy is parsed, shown by --help, refused out of range or while the flag it
needs is off, and held on --resume, also against a checkpoint written before it existed (what that run ran with:
the flag's default, or its declared before), with no other edit.

    python -m pytest -q tests/test_run_options.py
"""

import pytest

import train_gpt2
from conftest import TINY_FLAGS, assert_cli_error, make_shards, script_cli


def extend_parser(monkeypatch, add):
    """build_parser with add(group) adding flags to its "batch and schedule" group, as a researcher's edit would."""
    build = train_gpt2.build_parser

    def extended():
        parser = build()
        add(next(g for g in parser._action_groups if g.title == "batch and schedule"))
        return parser
    monkeypatch.setattr(train_gpt2, "build_parser", extended)


def packing_flags(group):
    """Two flags for packing documents into rows: --bos_align (a resume may not change it) and --pack_window (a count
    from 0, only with --bos_align)."""
    group.add_argument("--bos_align", action="store_true", resume="fixed", help="start every row at a document's start")
    group.add_argument("--pack_window", type=int, default=0, at_least=0, needs=("bos_align", None),
                       help="documents considered at once when packing")


@pytest.fixture
def with_new_flags(monkeypatch):
    extend_parser(monkeypatch, packing_flags)


def test_a_declared_flag_is_parsed_shown_and_checked(with_new_flags, tmp_path, capsys):
    data = make_shards(str(tmp_path / "data"))
    run = [*TINY_FLAGS, "--data_dir", data, "--log_dir", tmp_path / "log", "--max_steps", "1"]
    assert train_gpt2.parse_args(["--bos_align", "--pack_window", "8"]).pack_window == 8
    assert "--pack_window PACK_WINDOW" in train_gpt2.build_parser().format_help()
    assert_cli_error(script_cli(capsys, train_gpt2.main, *run, "--bos_align", "--pack_window", "-1"),
                     "--pack_window -1: must be a whole number from 0 to 2147483647")
    assert_cli_error(script_cli(capsys, train_gpt2.main, *run, "--pack_window", "4"),
                     "--pack_window does nothing while --bos_align is off; give --bos_align too, or drop --pack_window")
    assert not (tmp_path / "log").exists()


def test_a_resume_holds_a_fixed_flag_also_against_a_checkpoint_from_before_it(monkeypatch, tmp_path, capsys):
    data = make_shards(str(tmp_path / "data"))
    log_dir = str(tmp_path / "log")
    train_gpt2.main([*TINY_FLAGS, "--data_dir", data, "--log_dir", log_dir, "--max_steps", "2", "--save_every", "1"])
    extend_parser(monkeypatch, packing_flags)  # the flags arrive after the checkpoint was written
    result = script_cli(capsys, train_gpt2.main, "--log_dir", log_dir, "--resume", "--bos_align", "--max_steps", "3")
    assert_cli_error(result, "--bos_align True conflicts with the checkpoint's False")
    code, out, err = script_cli(capsys, train_gpt2.main, "--log_dir", log_dir, "--resume", "--max_steps", "3")
    assert code == 0, err
