"""Help that states every option's default: `argparse.ArgumentDefaultsHelpFormatter` adds
"(default: None)" to options whose absence means something, and a second default to help texts
that already give one in words; this adds it only where the default is a value and the text
does not mention one."""

from __future__ import annotations

import argparse
from collections.abc import Iterator


class DefaultsFormatter(argparse.HelpFormatter):
    """Each option's default stated once."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        silent = silent_default(action.default)
        if silent or not action.option_strings or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def silent_default(value: object) -> bool:
    """A default that says nothing in help: none, a flag's, or help's own (by identity: the
    default 0 or 1.0 of a count or a rate is a value to state)."""
    return (
        value is None
        or value is False
        or value is True
        or value == argparse.SUPPRESS
        or (value == [])
    )


def state_defaults(parser: argparse.ArgumentParser) -> None:
    """Give `parser` and every subcommand's parser under it `DefaultsFormatter`."""
    parser.formatter_class = DefaultsFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                state_defaults(sub)


class RawDefaultsFormatter(argparse.RawDescriptionHelpFormatter, DefaultsFormatter):
    """`DefaultsFormatter` with the description as written (a script's docstring, examples)."""


def commands(
    parser: argparse.ArgumentParser, name: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of `parser` and of every subcommand under it, depth first (the docs
    site's CLI page and the help tests walk the same commands)."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from commands(sub, f"{name} {command}")
