"""
The command line every script shares: user errors and the runner that prints them as one line, the
argument parser, and the flags several scripts take (--device, --dtype, --compile, --checkpoint,
--init_from), defined once. Imports neither torch nor any script.
"""

import argparse
import os
import sys
from dataclasses import dataclass


INT_MAX = 2**31 - 1  # counts beyond this are typos, and overflow C integers in torch


class UserError(Exception):
    """A problem the user can fix (bad flag, missing data, broken file). run_cli prints it as one line."""

class ReportedByRankZero(UserError):
    """The failure of a step only torchrun's rank 0 takes (its log folder, a checkpoint), raised on the
    other ranks too so that every rank leaves at the same point: rank 0 reports it, and run_cli ends the
    others with exit code 2 and no second copy of it."""

def brief(e):
    """An exception as a short single line, for error messages."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:  # "Error(s) in loading state_dict for GPT:" names nothing yet
        text += " " + lines[1]
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__

def run_cli(main_fn):
    """Run a script's main(): a UserError becomes one line on stderr and exit code 2, not a traceback.
    A stdout that cannot be written (a full disk, /dev/full) is one line too, with exit code 1, and no
    second error when the interpreter exits."""
    code = None
    guard = sys.stdout = StdoutGuard(sys.stdout) if sys.stdout is not None else None
    try:
        main_fn()
    except UserError as e:
        if guard is not None and guard.failed is not None and caused_by(e, guard.failed):
            code = stdout_failed(guard.failed, code)  # a script's message for its other files would blame them
        else:
            if not isinstance(e, ReportedByRankZero):
                print(f"error: {e}", file=sys.stderr)
            code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError as e:  # the reader left (`| head`): stop quietly, as Unix tools do
        code = stdout_failed(e, code)  # no second error when Python flushes stdout
    except OSError as e:  # stdout's own (a write the guard saw fail, or output a flush still cannot write), or another
        error = guard.failed if guard is not None and caused_by(e, guard.failed) else stdout_error()
        if error is None:
            raise  # another file's: the script's own handling (or a traceback) says which
        code = stdout_failed(error, code)
    except SystemExit as e:  # argparse: --help, or a bad flag
        code = e.code
    finally:
        if guard is not None and sys.stdout is guard:
            sys.stdout = guard.stream
    error = stdout_error()  # the output still buffered: a full disk shows here, not in the interpreter's exit
    passed_over = guard.failed if guard is not None else None  # argparse's --help passes over a failed write
    if error is None and passed_over is not None and not isinstance(passed_over, BrokenPipeError):
        error = passed_over  # (a closed pipe passed over is train_gpt2's console: the run goes on, on purpose)
    if error is not None:
        code = stdout_failed(error, code)
    if "RANK" in os.environ:  # one process of torchrun (or another launcher that sets RANK)
        leave_torchrun_worker(code)
    if code is not None:
        sys.exit(code)

def caused_by(e, error):
    """Whether exception e is error, or was raised while handling it (directly or further down the chain)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if e is error:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False

def stdout_failed(error, code):
    """The exit code once writing stdout failed with error: 1 and a line saying so, unless the script
    already failed (and said why); 141 and no word if the reader left (a closed pipe: `| head`). stdout
    then writes to /dev/null, so nothing fails again at exit."""
    if code in (None, 0):
        if isinstance(error, BrokenPipeError):
            code = 141
        else:
            print(f"error: cannot write to standard output ({error.strerror or brief(error)})", file=sys.stderr)
            code = 1
    silence_stdout()
    return code

class StdoutGuard:
    """sys.stdout while run_cli runs a script: the same stream, but a write or flush that fails is
    remembered, so run_cli tells a full stdout from the script's other OSErrors (unbuffered output,
    PYTHONUNBUFFERED=1, keeps nothing back that a later flush could fail on)."""

    def __init__(self, stream):
        self.stream = stream
        self.failed = None

    def _call(self, name, *args):
        try:
            return getattr(self.stream, name)(*args)
        except OSError as e:
            self.failed = e
            raise

    def write(self, text):
        return self._call("write", text)

    def writelines(self, lines):
        return self._call("writelines", lines)

    def flush(self):
        return self._call("flush")

    def __getattr__(self, name):
        return getattr(self.stream, name)

def stdout_error():
    """The OSError that flushing stdout raises now (it holds output that the disk or pipe behind it
    refused), or None."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except OSError as e:
        return e
    except ValueError:  # closed
        pass
    return None

def silence_stdout():
    """Point stdout's file descriptor at /dev/null: what is still buffered goes nowhere, without an error."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):  # no real file descriptor (a test's captured stdout)
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)

def leave_torchrun_worker(code):
    """End a torchrun worker without Python's interpreter teardown. gloo's worker threads may still be
    releasing the tensors of the last collective when the main thread finishes; taking the GIL during
    teardown then aborts the process (SIGABRT, "terminate called without an active exception", exit -6),
    once in ~10 runs on a busy 2-core machine (pytorch/pytorch#190489). Every file the scripts write is
    closed by now, so flushing stdout and stderr is all the teardown that matters."""
    if code is not None and not isinstance(code, int):  # sys.exit("message") prints it, as Python's teardown would
        print(code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach the reader
            pass
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it says something: not for switches, nor for None."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool) or action.nargs == 0:
            return action.help or ""
        return super()._get_help_string(action)

UNSET = object()  # RunOption.before's default: the flag's own default


@dataclass(frozen=True)
class RunOption:
    """What a flag declares beside argparse's keywords, in the same add_argument call of a CLIParser's group (a run
    option, as a model option is a GPTConfig field: declared once). nanogpt.arguments reads it to refuse a value, a
    flag that would do nothing, a --resume that changes what a run cannot change, and to know what a checkpoint
    written before the flag existed ran with.
    at_least, above, at_most: its range (a whole number from at_least to at_most, else to INT_MAX; a finite number
    >= at_least or > above, and at most at_most); usual: the words on its usual size, said beside at_most;
    needs: (switch, value): it acts only while --switch is on (--switch value turns it on; value None: a switch);
    refused_with: (flag, value): off its default, it does not work while --flag is value (a head that cannot take it);
    not_empty: an empty string is refused ("$UNSET_VARIABLE");
    resume: "change" (a --resume may change it, said and made), "fixed" (refused), "local" (today's command line's
    only, never the checkpoint's);
    before: what a checkpoint that predates the flag ran with (default: its default)."""
    name: str
    default: object = None  # (argparse's, recorded beside)
    at_least: float = None
    above: float = None
    at_most: float = None
    usual: str = None
    needs: tuple = None
    refused_with: tuple = None
    not_empty: bool = False
    resume: str = "change"
    before: object = UNSET


class DeclaringGroup(argparse._ArgumentGroup):
    """A CLIParser's group: add_argument takes RunOption's keywords beside argparse's and records them."""

    def __init__(self, parser, *args, **kwargs):
        super().__init__(parser, *args, **kwargs)
        self.parser = parser

    def add_argument(self, *args, **kwargs):
        declared = {name: kwargs.pop(name) for name in list(kwargs)
                    if name in RunOption.__dataclass_fields__ and name not in ("name", "default")}
        action = super().add_argument(*args, **kwargs)
        if declared or action.dest not in self.parser.options:  # (--no_x, x's second flag, declares nothing new)
            self.parser.options[action.dest] = RunOption(action.dest, action.default, **declared)
        return action


class CLIParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr, like every other user error here; its groups record each flag's
    RunOption (options: {dest: RunOption})."""

    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kwargs)
        self.options = {}

    def add_argument_group(self, *args, **kwargs):
        group = DeclaringGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

    def parse_marked(self, argv=None):
        """parse_args, with args.explicit: the names (dests) of the flags the command line gives, even
        where it gives a flag's default value; and args.given_as: each one's flag as the command line
        spelt it (--no_compile for the dest compile). Optional flags only: positionals are not marked."""
        # a stand-in for each flag's default: one the command line gives replaces it (a store action) or
        # a copy of it (append, extend: a fresh list), so identity tells; a count action starts from None
        unset = {a.dest: None if isinstance(a, argparse._CountAction) else []
                 for a in self._actions if a.option_strings and a.dest != "help"}
        marked = self.parse_args(argv, namespace=argparse.Namespace(**unset))
        args = self.parse_args(argv)
        args.explicit = {name for name in unset if getattr(marked, name) is not unset[name]}
        spelt = {word.split("=")[0] for word in (sys.argv[1:] if argv is None else argv) if isinstance(word, str)}
        args.given_as = {a.dest: option for a in self._actions for option in a.option_strings
                         if a.dest in args.explicit and option in spelt}
        for name in args.explicit - args.given_as.keys():  # an abbreviation (--no_comp): the flag's first name
            args.given_as[name] = next(a.option_strings[0] for a in self._actions if a.dest == name)
        return args


# -----------------------------------------------------------------------------
# The flags several scripts share

DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")


def add_system_flags(group, dtype_default="auto", compile_default=None, device_help="", dtype_help="",
                     compile_help="default: on for CUDA"):
    """--device, --dtype and --compile/--no_compile, with each script's defaults."""
    group.add_argument("--device", default="auto", help="auto, cuda, cuda:N, mps or cpu" + device_help)
    group.add_argument("--dtype", default=dtype_default, choices=DTYPE_CHOICES,
                       help=dtype_help or "autocast dtype; auto = bf16 on CUDA GPUs that have it, else fp16; fp32 on "
                                          "cpu/mps")
    group.add_argument("--compile", dest="compile", action="store_true", default=compile_default,
                       help=f"torch.compile the model ({compile_help})")
    group.add_argument("--no_compile", dest="compile", action="store_false", help="run eagerly")


def add_weights_flags(group, checkpoint=True, init_from_default=None, **declared):
    """--checkpoint (ours) and --init_from (GPT-2 weights): where a script's model comes from. declared: RunOption's
    keywords of --init_from (train_gpt2.py's)."""
    if checkpoint:
        group.add_argument("--checkpoint", default=None, help="our model_<step>.pt, or a log folder (its newest checkpoint)")
    scratch = "scratch (a new model), " if init_from_default == "scratch" else ""
    group.add_argument("--init_from", default=init_from_default,
                       help=f"{scratch}gpt2, gpt2-medium, gpt2-large, gpt2-xl (the Hugging Face hub), or a local "
                            "transformers folder of a GPT-2, Llama or Qwen3 model", **declared)


def name_settings_in_help(parser, presets, recipes):
    """--model's and --recipe's help list what each preset and recipe sets ({"--model tiny": {name: value}}), and
    each flag they set says so after its own help (`--batch_size ... [--model tiny: 8]`), since --help's defaults
    are the parser's."""
    def flags(settings):
        return " ".join(f"--{name} {value}" for name, value in settings.items())

    actions = {a.dest: a for a in parser._actions}
    actions["model"].help += "; " + "; ".join(f"{name.split()[1]} sets {flags(s)}" for name, s in presets.items())
    actions["recipe"].help += "; they set: " + "; ".join(f"{name.split()[1]}: {flags(s)}" for name, s in recipes.items())
    sources = [*presets.items(), *recipes.items()]
    for dest, action in actions.items():
        given = [f"{source}: {settings[dest]}" for source, settings in sources
                 if dest in settings and settings[dest] != action.default]
        if given:
            action.help += f" [{'; '.join(given)}]"


def borrowed_settings(args, parser, run_presets, recipes):
    """[(source, {name: value})]: the settings a fresh run took from its --model preset's run settings and from its
    --recipe (where it differs from the default recipe's), the flags the command line gave left out; for the
    run header. parser: the one that parsed args (its defaults)."""
    baseline = {**{k: parser.get_default(k) for k in recipes[args.recipe]}, **recipes[parser.get_default("recipe")]}
    preset = {k: v for k, v in run_presets.get(args.model, {}).items() if k not in args.explicit}
    recipe = {k: v for k, v in recipes[args.recipe].items()
              if k not in args.explicit and k not in run_presets.get(args.model, {}) and v != baseline[k]}
    return [(f"--model {args.model}", preset), (f"--recipe {args.recipe}", recipe)]
