"""
The model's options, one place for each: a field of GPTConfig (train_gpt2.py) declared with option() is, with
no further code, a flag of train_gpt2.py (type, choices and help from the field), read back into the config by
its name, stored in every checkpoint and read back from it, compared by one check with the model a --resume or
--init_from already has, and refused by an exporter that does not compute it. Imports no torch.
"""

import math
from dataclasses import field, fields

from nanogpt.cli import INT_MAX, UserError


def option(default, help_text, flag=None, choices=None, archs=None):
    """A field of GPTConfig: its default (None: the config works it out from its other fields), the help of its
    flag, and where they apply: flag, the run flag that sets the field instead of --<name> (block_size:
    --seq_len, which that flag's own checks hold on --resume and --init_from); choices, its only values; archs,
    the architectures it is an option of (given with another, refused)."""
    return field(default=default, metadata=dict(help=help_text, flag=flag, choices=choices, archs=archs))


def flag_fields(config_class):
    """The fields that are flags of their own name (not block_size, which --seq_len sets)."""
    return [f for f in fields(config_class) if not f.metadata.get("flag")]


def add_config_flags(group, config_class):
    """A flag for each field: --<name> VALUE, or --<name> / --no_<name> for a bool. Every default is None (not
    given): the field then takes the value of the --model preset, the --recipe, or the config's own default."""
    for f in flag_fields(config_class):
        said = "" if f.default is None or "default" in f.metadata["help"] else (
            f" (default: {'on' if f.default else 'off'})" if f.type is bool else f" (default: {f.default})")
        text = f.metadata["help"] + said
        if f.metadata["archs"]:
            text = f"{'/'.join(f.metadata['archs'])}: {text}"
        if f.type is bool:
            group.add_argument(f"--{f.name}", dest=f.name, action="store_true", default=None, help=text)
            group.add_argument(f"--no_{f.name}", dest=f.name, action="store_false", help=f"the opposite of --{f.name}")
        else:
            group.add_argument(f"--{f.name}", type=f.type, default=None, choices=f.metadata["choices"], help=text)


def spelt(f, args):
    """A config flag as the command line gave it: `--n_layer 8`, `--no_qk_norm`."""
    name = f.metadata["flag"] or f.name
    flag = args.given_as.get(name, f"--{name}")
    return flag if f.type is bool else f"{flag} {getattr(args, name)}"


def refuse_foreign_options(config_class, args, arch):
    """A config flag given on the command line for an architecture it is not an option of: one line."""
    for f in fields(config_class):
        archs = f.metadata["archs"]
        if archs and arch not in archs and (f.metadata["flag"] or f.name) in args.explicit:
            raise UserError(f"{spelt(f, args).split()[0]} is an option of --arch {' or '.join(archs)}; --arch {arch} "
                            f"has no such setting: add --arch {archs[0]}, or drop it")


def config_from_flags(config_class, args, base):
    """The config the flags ask for: base ({field: value}, a --model preset's shape) with every flag that has a
    value over it, each field from the flag of its name (block_size from its `flag`). A flag given on the
    command line for an architecture it is not an option of is refused; one a --recipe implies for another
    architecture is passed over. Values out of range: one line naming the flag."""
    refuse_foreign_options(config_class, args, args.arch)
    values = dict(base)
    for f in fields(config_class):
        value = getattr(args, f.metadata["flag"] or f.name, None)
        if value is None or (f.metadata["archs"] and args.arch not in f.metadata["archs"]):
            continue
        check_value(f, value)
        values[f.name] = value
    return make_config(config_class, values, "the flags")


def lowest_count(f):
    """The smallest value of an int field: 0 where its default is 0 (off), else 1."""
    return 0 if f.default == 0 else 1


def check_value(f, value):
    """Counts from 1 to INT_MAX (from 0 where the default is 0: off), finite floats: anything else is a typo, or
    overflows torch's C integers."""
    name = f.metadata["flag"] or f.name
    lowest = lowest_count(f)
    if f.type is int and not lowest <= value <= INT_MAX:
        raise UserError(f"--{name} {value}: must be a whole number from {lowest} to {INT_MAX}")
    if f.type is float and not math.isfinite(value):
        raise UserError(f"--{name} {value}: must be a finite number")


def make_config(config_class, values, source):
    """config_class(**values), its own checks (a ValueError naming the flags) as one line naming the source."""
    try:
        return config_class(**values)
    except ValueError as e:
        raise UserError(str(e) if source == "the flags" else f"{source}: its config is not a GPT shape this program can "
                        f"build ({e})") from None


def config_from_checkpoint(config_class, stored_config, source, required=()):
    """The config of a checkpoint's stored dict: its fields of the right types (ints where a float is expected
    too; None only where the field's default is None), the `required` ones present; a field it lacks (a
    checkpoint from before the field) takes its default. A dict that is not such a config is refused in one
    line naming the source, its unknown fields named."""
    known = {f.name: f for f in fields(config_class)}
    if not isinstance(stored_config, dict):
        raise UserError(f"{source}: its config ({str(stored_config)[:120]}) is not a GPT shape this program can build")
    unknown = sorted(map(str, set(stored_config) - set(known)))
    if unknown:
        raise UserError(f"{source}: its config has fields this program does not know: {', '.join(unknown)}; it was "
                        "written by another version of the program, whose model this one cannot build")

    def fits(f, v):
        if v is None:
            return f.default is None
        return (type(v) is f.type or (f.type is float and type(v) is int)) and v in (f.metadata["choices"] or (v,))

    wrong = [k for k, v in stored_config.items() if not fits(known[k], v)]
    missing = [k for k in required if stored_config.get(k) is None]
    if wrong or missing:
        what = f"{wrong[0]} {stored_config[wrong[0]]!r}" if wrong else f"no {missing[0]}"
        raise UserError(f"{source}: its config ({what}) is not a GPT shape this program can build")
    config = make_config(config_class, stored_config, source)
    for f in fields(config_class):  # an option of another architecture has the value the config gives it alone
        archs = f.metadata["archs"]
        if archs and config.arch not in archs and getattr(config, f.name) != getattr(with_default(config, f.name), f.name):
            raise UserError(f"{source}: its config has {f.name} {getattr(config, f.name)!r}, an option of --arch "
                            f"{' or '.join(archs)}, on a model of --arch {config.arch}; it is not a checkpoint this "
                            "program wrote")
    return config


def with_default(config, name):
    """config with the field `name` at its default (worked out from the other fields)."""
    return type(config)(**{f.name: getattr(config, f.name) for f in fields(config) if f.name != name})


def refuse_another_model(config, args, source, fix):
    """The one check of a command line against the model a run already has (a checkpoint's, or --init_from's
    weights'): every config flag the command line gives (args.explicit) must be an option of its architecture
    and ask for the value config has. A refusal names each such flag and what config has, and ends with `fix`."""
    refuse_foreign_options(type(config), args, config.arch)
    asked = [f for f in flag_fields(type(config)) if f.name in args.explicit and getattr(args, f.name) != getattr(config, f.name)]
    if asked:
        names = {f.name for f in asked}
        shown = [f.name for f in fields(config) if f.name in ("n_layer", "n_head", "n_embd", "arch") or f.name in names]
        raise UserError(f"{' '.join(spelt(f, args) for f in asked)} conflicts with {source}, which has "
                        f"{', '.join(f'{name} {getattr(config, name)}' for name in shown)}; {fix}")


def check_exportable(config, computes, what):
    """An exporter's declaration: `computes` names the fields whose every value the target class computes (arch
    among them, whose value picks the exporter). Every other field must hold what the config has with those
    alone (its default, worked out as the config works it out); else one line naming the field, the values
    and `what` (the target class)."""
    reference = type(config)(**{name: getattr(config, name) for name in computes})
    for f in fields(config):
        if getattr(config, f.name) != getattr(reference, f.name):
            raise UserError(f"--export_hf: {what} computes {f.name} {getattr(reference, f.name)!r} only, and this model "
                            f"has {f.name} {getattr(config, f.name)!r}; sample and evaluate it with this program's "
                            "scripts instead")
