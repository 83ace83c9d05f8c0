"""The flags of `d3d train`, made from TrainConfig, and `--config FILE.yaml`.

Each flag records that it was given, so a config file can fill every setting the command
line leaves out while the command line still wins, even where it repeats a default.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from sglang_d3d.training.config_file import ConfigError, read_config_file
from sglang_d3d.training.train_config import CHOICES, HELP, TrainConfig

GIVEN = "_train_flags_given"
ALIASES = {"target": "target_path"}  # --target, as d3d datagen and d3d serve spell it


def _mark(namespace: argparse.Namespace, dest: str) -> None:
    given = set(getattr(namespace, GIVEN, set()))
    given.add(dest)
    setattr(namespace, GIVEN, given)


class Store(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        _mark(namespace, self.dest)


class StoreBool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _mark(namespace, self.dest)


def parse_layers(text: str | list | tuple) -> tuple[int, ...]:
    if isinstance(text, (list, tuple)):
        return tuple(int(x) for x in text)
    return tuple(int(x) for x in str(text).split(",") if x.strip())


def _kind(name: str, default):
    """The type one setting's value converts with (from a flag's text or a YAML value)."""
    if name == "layers":
        return parse_layers
    if default is None:
        return {"max_minutes": float, "stop_at_step": int, "max_seq_len": int}.get(name, str)
    return type(default)


def add_train_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="settings from a YAML file whose keys are these flags (dashes or "
                        "underscores); flags on the command line override it")
    for f in fields(TrainConfig):
        flag, default = "--" + f.name.replace("_", "-"), getattr(d, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action=StoreBool, default=default, help=HELP[f.name])
        elif f.name in CHOICES:
            p.add_argument(flag, action=Store, choices=CHOICES[f.name], default=default,
                           help=HELP[f.name])
        else:
            names = (flag, *(f"--{a}" for a, n in ALIASES.items() if n == f.name))
            p.add_argument(*names, action=Store, type=_kind(f.name, default), default=default,
                           help=HELP[f.name])


def _from_file(name: str, value):
    """A config file's value as the setting's type (YAML reads 1e-3 as text, for one)."""
    default = getattr(TrainConfig(), name)
    if value is None or isinstance(default, bool):
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"config key {name!r} must be true or false, not {value!r}")
        return value
    try:
        return _kind(name, default)(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config key {name!r}: cannot read {value!r}") from None


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed flags, over the values of --config FILE where one is given."""
    names = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    path = getattr(args, "config", None)
    if path:
        given = getattr(args, GIVEN, set())
        for name, value in read_config_file(path, names, ALIASES).items():
            if name not in given:
                values[name] = _from_file(name, value)
    return TrainConfig(**values)
