"""A run option declared once (nanogpt.cli.RunOption, in build_parser's add_argument): a flag added at run time with
its range, what it needs and its resume policy is parsed, shown by --help, refused out of range or while the flag it
needs is off, and held on --resume, also against a checkpoint written before it existed (what that run ran with:
the flag's default, or its declared before), with no other edit.

    python -m pytest -q tests/test_run_options.py
"""

import pytest
import torch

import train_gpt2
from conftest import TINY_FLAGS, assert_cli_error, make_shards, read_log, script_cli


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


def z_loss_flag(group):
    group.add_argument("--z_loss", type=float, default=0.0, at_least=0, refused_with=("loss_impl", "fused"),
                       help="PaLM's z-loss coefficient")


def test_an_objectives_own_setting_reaches_batch_loss_wherever_it_is_called(monkeypatch, tmp_path, capsys):
    """A flag of the objective (a z-loss coefficient) declared once and read in batch_loss from the run's flags: the
    loop, the --batch_size auto trial and validation all hand them over; the term reaches log.txt; with a head that
    cannot take it, refused before any work."""
    extend_parser(monkeypatch, z_loss_flag)
    seen = []

    def z_objective(model, x, y, args=None):
        seen.append(args.z_loss if args is not None else None)
        if args is None or not args.z_loss or not torch.is_grad_enabled():  # validation: the next-token loss
            return model(x, y)[1], {}
        _, loss, terms = model(x, y, row_losses=lambda lse, target_logit, targets: {
            "next_loss": lse - target_logit, "z_loss": args.z_loss * lse.square()})
        return loss, terms
    monkeypatch.setattr(train_gpt2, "batch_loss", z_objective)
    data = make_shards(str(tmp_path / "data"))
    at = TINY_FLAGS.index("--batch_size")
    flags = [*TINY_FLAGS[:at], *TINY_FLAGS[at + 2:], "--batch_size", "auto", "--data_dir", data, "--max_steps", "2",
             "--eval_every", "1", "--z_loss", "1e-4"]
    train_gpt2.main([*flags, "--log_dir", str(tmp_path / "log")])
    assert seen and set(seen) == {1e-4}  # (the trial's, each micro-step's and validation's calls)
    log = read_log(str(tmp_path / "log"))
    assert log["z_loss"].keys() == log["train"].keys() == {0, 1}
    # (numbers are written to 6 significant digits: a loss near 10 to 4 decimals, 5e-5 either way)
    assert all(abs(log["next_loss"][s] + log["z_loss"][s] - log["train"][s]) <= 1e-4 for s in (0, 1))
    assert_cli_error(script_cli(capsys, train_gpt2.main, *flags, "--log_dir", tmp_path / "fused", "--loss_impl",
                                "fused"), "--z_loss 0.0001 does not work with --loss_impl fused")
    assert not (tmp_path / "fused").exists()
