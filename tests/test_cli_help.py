"""--help of hellaswag.py, evaluate.py, generate_tokens.py and plot_log.py: every flag says what it does and states
its default once (the formatter adds '(default: X)' for real values; None and switches say theirs in
words or not at all); and the scripts that run a model agree on --dtype and --compile/--no_compile."""

import argparse

import pytest

import evaluate
import generate_tokens
import hellaswag
import plot_log
import train_gpt2
from nanogpt.runtime import DTYPES

PARSERS = {"hellaswag.py": hellaswag.build_parser, "evaluate.py": evaluate.build_parser,
           "generate_tokens.py": generate_tokens.build_parser, "plot_log.py": plot_log.build_parser}


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


@pytest.mark.parametrize("script", ["train_gpt2.py", *sorted(set(PARSERS) - {"plot_log.py"})])
def test_the_scripts_agree_on_dtype_and_compile(script):
    """The model-running scripts take the same --dtype values and the same --compile/--no_compile switch
    (the last one given wins), so a flag learnt on one works on the others."""
    parser = (train_gpt2.build_parser if script == "train_gpt2.py" else PARSERS[script])()
    assert set(parser._option_string_actions["--dtype"].choices) == set(DTYPES) | {"auto"}
    assert parser._option_string_actions["--compile"].dest == parser._option_string_actions["--no_compile"].dest
    assert parser.parse_args(["--compile", "--no_compile"]).compile is False
    assert parser.parse_args(["--no_compile", "--compile"]).compile is True


def test_parse_marked_names_the_flags_given_even_at_their_defaults():
    """args.explicit is what the command line gives, whatever the values: a flag given at its default
    value counts, a flag left out does not, and so do flags that accumulate (extend, store_true, a
    --no_ switch sharing its dest)."""
    from nanogpt.cli import CLIParser

    parser = CLIParser()
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--name", default="x")
    parser.add_argument("--input", nargs="+", action="extend")
    parser.add_argument("--fast", dest="fast", action="store_true")
    parser.add_argument("--no_fast", dest="fast", action="store_false")
    cases = [([], set(), {"size": 3, "name": "x", "input": None, "fast": False}),
             (["--size", "3", "--name", "x"], {"size", "name"}, {"size": 3, "name": "x"}),
             (["--input", "a", "--input", "b", "c"], {"input"}, {"input": ["a", "b", "c"]}),
             (["--no_fast"], {"fast"}, {"fast": False}),
             (["--fast"], {"fast"}, {"fast": True})]
    for argv, given, values in cases:
        args = parser.parse_marked(argv)
        assert args.explicit == given, argv
        assert {k: getattr(args, k) for k in values} == values, argv
    assert parser.parse_marked(["--no_fast", "--size=4"]).given_as == {"fast": "--no_fast", "size": "--size"}
    assert parser.parse_marked(["--no_f"]).given_as == {"fast": "--fast"}  # abbreviated: the flag's first name
    # a count flag and a positional: counted, and not marked
    parser.add_argument("-v", action="count", default=0)
    parser.add_argument("path", nargs="?", default="x")
    assert parser.parse_marked([]).explicit == set() and parser.parse_marked(["-vv", "p"]).explicit == {"v"}
    assert parser.parse_marked(["-vv", "p"]).v == 2


def test_the_help_names_every_recipe_and_every_model_init_from_reads():
    """--recipe's help describes each recipe train_gpt2.py has, and --init_from's each kind of transformers model
    the import reads (nanogpt.hf)."""
    import nanogpt.hf

    parser = train_gpt2.build_parser()
    helps = {a.dest: a.help for a in parser._actions}
    assert all(f"{name}:" in helps["recipe"] for name in train_gpt2.RECIPES), helps["recipe"]
    for kind in ("GPT-2", "Llama", "Qwen3"):
        assert kind.lower().replace("-", "") in open(nanogpt.hf.__file__).read().lower()  # the import reads it
        assert kind in helps["init_from"], helps["init_from"]
