"""--help of hellaswag.py, generate_tokens.py and plot_log.py: every flag says what it does and states
its default once (the formatter adds '(default: X)' for real values; None and switches say theirs in
words or not at all), and the stated value is the one the code uses."""

import argparse

import pytest

import generate_tokens
import hellaswag
import plot_log

PARSERS = {"hellaswag.py": hellaswag.build_parser, "generate_tokens.py": generate_tokens.build_parser,
           "plot_log.py": plot_log.build_parser}


@pytest.mark.parametrize("script", sorted(PARSERS))
def test_every_flag_has_help_and_one_default(script):
    parser = PARSERS[script]()
    formatter = parser._get_formatter()
    checked = 0
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and len(action.help) > 10, f"{script} {name}: no help text"
        shown = formatter._expand_help(action)  # the text --help prints for this flag
        assert shown.lower().count("default") <= 1, f"{script} {name}: the default is stated twice: {shown!r}"
        if action.default is not None and not isinstance(action.default, bool) and action.nargs != 0:
            assert shown.endswith(f"(default: {action.default})"), f"{script} {name}: {shown!r}"
        assert "None" not in shown, f"{script} {name}: {shown!r}"
        checked += 1
    assert checked >= 3
    text = parser.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: True)" not in text


def test_stated_defaults_are_the_parsed_ones():
    args = generate_tokens.build_parser().parse_args([])
    assert (args.num_samples, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed) == (4, 100, 1.0, 50, 1.0, 1337)
    assert (args.device, args.dtype, args.int8, args.compile, args.no_stop) == ("auto", "auto", False, False, False)
    assert generate_tokens.build_parser().parse_args(["--compile", "--no_compile"]).compile is False
    args = hellaswag.build_parser().parse_args([])
    assert (args.dtype, args.device, args.style, args.batch_size, args.limit) == ("fp32", "auto", "nanogpt", None, None)
    assert args.compile is None  # None: main() turns it on for CUDA only
    assert hellaswag.build_parser().parse_args(["--no_compile"]).compile is False
    assert "auto" in hellaswag.build_parser()._option_string_actions["--dtype"].choices
    args = plot_log.build_parser().parse_args(["log.txt"])
    assert (args.out, args.smooth) == (None, 0)
