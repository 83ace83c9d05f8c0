"""docs/cli.md, generated from the argparse definitions of every `d3d` command.

    python -m sglang_d3d.cli_docs > docs/cli.md

tests/test_cli_docs.py fails when the page and the parsers disagree, or when an option has no
help text, so the reference cannot go stale.
"""

from __future__ import annotations

import argparse
import enum
import sys

HEADER = """# Command-line reference

Every `d3d` command and flag: its default and its effect. Generated from the parsers
(`python -m sglang_d3d.cli_docs > docs/cli.md`); `tests/test_cli_docs.py` checks it.
`d3d COMMAND --help` prints the same.
"""


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each `d3d` subcommand's own parser, in the order `d3d --help` lists them."""
    from sglang_d3d.benchmarks.bench_serving import build_parser as bench_serving_parser
    from sglang_d3d.cli import build_parser
    from sglang_d3d.server.args import build_parser as serve_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = dict(sub.choices)
    for choice in sub._choices_actions:  # a subcommand's one-line help is its description here
        if out[choice.dest].description is None:
            out[choice.dest].description = choice.help
    # These two own their option sets (sglang_d3d/cli.py hands their argv over whole).
    out["serve"] = serve_parser()
    out["bench-serving"] = bench_serving_parser()
    return out


def documented_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options and positionals a user passes: not --help, not hidden ones."""
    return [
        a for a in parser._actions
        if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS
    ]


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own substitutions, e.g. %(default)s
        text = text % {**vars(action), "prog": parser.prog}
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        choices = ", ".join(f"`{_show(c)}`" for c in action.choices)
        text = f"{text} (one of {choices})" if text else f"one of {choices}"
    return text


def _flag(action: argparse.Action) -> str:
    names = ", ".join(action.option_strings) or action.dest
    if action.nargs == 0:
        return f"`{names}`"
    meta = action.metavar or (action.dest.upper() if action.option_strings else "")
    if isinstance(meta, tuple):
        meta = " ".join(meta)
    if action.nargs in ("+", "*"):
        meta = f"{meta} ..."
    return f"`{names} {meta}`" if meta else f"`{names}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default is None or action.default == argparse.SUPPRESS:
        return ""
    if action.required:
        return "required"
    d = action.default
    if isinstance(d, (list, tuple)) and not d:
        return ""
    if isinstance(d, (list, tuple)):
        d = " ".join(str(_show(x)) for x in d)
    d = _show(d)
    return f"`{d}`" if str(d) != "" else "`''`"


def _show(value):
    """An enum as the value a user types."""
    return value.value if isinstance(value, enum.Enum) else value


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render_parser(name: str, parser: argparse.ArgumentParser) -> str:
    desc = (parser.description or "").strip().splitlines()
    lines = [f"## `d3d {name}`", ""]
    if desc:
        lines += [_cell(desc[0]), ""]
    lines += ["| flag | default | effect |", "|---|---|---|"]
    for a in documented_actions(parser):
        if a.required and a.option_strings:
            default = "required"
        else:
            default = _default(a)
        lines.append(f"| {_cell(_flag(a))} | {_cell(default)} | {_cell(help_text(parser, a))} |")
    return "\n".join(lines) + "\n"


def render() -> str:
    parts = [HEADER]
    for name, parser in command_parsers().items():
        parts.append(render_parser(name, parser))
    return "\n".join(parts)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
