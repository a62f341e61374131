"""
The model's options, one place for each: a field of GPTConfig (train_gpt2.py) declared with option() is, with
no further code, a flag of train_gpt2.py (type, choices and help from the field), read back into the config by
its name, stored in every checkpoint and read back from it, compared by one check with the model a --resume or
--init_from already has, and refused by an exporter that does not compute it. Imports no torch.
"""

import math
from dataclasses import field, fields

from nanogpt.cli import INT_MAX, UserError

TYPES = {"int": int, "float": float, "str": str, "bool": bool}  # a field's type, were it written as a string


def option(default, help, flag=None, choices=None, archs=None):
    """A field of GPTConfig: its default (None: the config works it out from its other fields), the help of its
    flag, and where they apply: flag, the flag that sets the field instead of --<name> (block_size: --seq_len);
    choices, its only values; archs, the architectures it is an option of (given with another, refused)."""
    return field(default=default, metadata=dict(help=help, flag=flag, choices=choices, archs=archs))


def field_type(f):
    return TYPES.get(f.type, f.type) if isinstance(f.type, str) else f.type


def flag_fields(config_class):
    """The fields that are flags by their own name (not block_size, which --seq_len sets)."""
    return [f for f in fields(config_class) if not f.metadata.get("flag")]


def add_config_flags(group, config_class):
    """A flag for each field: --<name> VALUE, or --<name> / --no_<name> for a bool. Every default is None (not
    given): the field then takes the value of the --model preset, the --recipe, or the config's own default."""
    for f in flag_fields(config_class):
        kind, default = field_type(f), f.default
        said = "" if default is None or "default" in f.metadata["help"] else (
            f" (default: {'on' if default else 'off'})" if kind is bool else f" (default: {default})")
        help = f.metadata["help"] + said
        if f.metadata.get("archs"):
            help = f"{'/'.join(f.metadata['archs'])}: {help}"
        if kind is bool:
            group.add_argument(f"--{f.name}", dest=f.name, action="store_true", default=None, help=help)
            group.add_argument(f"--no_{f.name}", dest=f.name, action="store_false", help=f"the opposite of --{f.name}")
        else:
            group.add_argument(f"--{f.name}", type=kind, default=None, choices=f.metadata.get("choices"), help=help)


def config_from_flags(config_class, args, base):
    """The config the flags ask for: base ({field: value}, a --model preset's shape) with every flag that has a
    value over it, each field from the flag of its name (block_size from its `flag`). A flag given on the
    command line for an architecture it is not an option of is refused; one a --recipe implies for another
    architecture is passed over. Values out of range: one line naming the flag."""
    values = dict(base)
    arch = getattr(args, "arch", None)
    for f in fields(config_class):
        value = getattr(args, f.metadata.get("flag") or f.name, None)
        if value is None:
            continue
        archs = f.metadata.get("archs")
        if archs and arch not in archs:
            if f.name in args.explicit:
                spelt = args.given_as.get(f.name, f"--{f.name}")
                raise UserError(f"{spelt} is an option of --arch {' or '.join(archs)}; --arch {arch} has no such "
                                f"setting: add --arch {archs[0]}, or drop it")
            continue
        check_value(f, value)
        values[f.name] = value
    return make_config(config_class, values, "the flags")


def check_value(f, value):
    """Counts from 1 to INT_MAX, finite floats: anything else is a typo, or overflows torch's C integers."""
    name = f.metadata.get("flag") or f.name
    kind = field_type(f)
    if kind is int and not 1 <= value <= INT_MAX:
        raise UserError(f"--{name} {value}: must be a whole number from 1 to {INT_MAX}")
    if kind is float and not math.isfinite(value):
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
    too), the `required` ones present; a field it lacks (a checkpoint from before the field) takes its default.
    A dict that is not such a config is refused in one line naming the source, its unknown fields named."""
    known = {f.name: field_type(f) for f in fields(config_class)}
    if not isinstance(stored_config, dict):
        raise UserError(f"{source}: its config ({str(stored_config)[:120]}) is not a GPT shape this program can build")
    unknown = sorted(map(str, set(stored_config) - set(known)))
    if unknown:
        raise UserError(f"{source}: its config has fields this program does not know: {', '.join(unknown)}; it was "
                        "written by another version of the program, whose model this one cannot build")
    choices = {f.name: f.metadata.get("choices") for f in fields(config_class)}
    wrong = [k for k, v in stored_config.items()
             if not (type(v) is known[k] or (known[k] is float and type(v) is int) or v is None)
             or (choices[k] and v not in choices[k])]
    missing = [k for k in required if stored_config.get(k) is None]
    if wrong or missing:
        what = f"{wrong[0]} {stored_config[wrong[0]]!r}" if wrong else f"no {missing[0]}"
        raise UserError(f"{source}: its config ({what}) is not a GPT shape this program can build")
    config = make_config(config_class, stored_config, source)
    for f in fields(config_class):  # an option of another architecture has the value the config gives it alone
        archs = f.metadata.get("archs")
        if archs and config.arch not in archs and getattr(config, f.name) != getattr(without(config, f.name), f.name):
            raise UserError(f"{source}: its config has {f.name} {getattr(config, f.name)!r}, an option of --arch "
                            f"{' or '.join(archs)}, on a model of --arch {config.arch}; it is not a checkpoint this "
                            "program wrote")
    return config


def without(config, name):
    """config with the field `name` at its default (worked out from the other fields)."""
    return type(config)(**{f.name: getattr(config, f.name) for f in fields(config) if f.name != name})


def refuse_another_model(config, args, source, fix):
    """The one check of a command line against the model a run already has (a checkpoint's, or --init_from's
    weights'): every config flag the command line gives (args.explicit) must ask for the value config has.
    A refusal names each such flag and what config has, and ends with `fix`."""
    asked = [f.name for f in flag_fields(type(config))
             if f.name in args.explicit and getattr(args, f.name) != getattr(config, f.name)]
    if asked:
        flags = " ".join(f"--{name} {getattr(args, name)}" for name in asked)
        shown = [f.name for f in fields(config) if f.name in ("n_layer", "n_head", "n_embd", "arch") or f.name in asked]
        raise UserError(f"{flags} conflicts with {source}, which has "
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
