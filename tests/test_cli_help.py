"""Every command and every option of the `pipeline` CLI says what it is in --help."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from pipeline.commands.cli import build_parser


def undocumented(parser: argparse.ArgumentParser, name: str) -> Iterator[str]:
    """`COMMAND: OPTION` for each argument (and subcommand) of `parser` without a help text."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for command, subparser in action.choices.items():
                if not helps.get(command):
                    yield f"{name} {command}"
                yield from undocumented(subparser, f"{name} {command}")
        elif not action.help:
            yield f"{name}: {'/'.join(action.option_strings) or action.dest}"


def test_every_command_and_option_has_a_help_text():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"prepare", "inspect", "bench", "maxtext"} <= set(commands.choices)  # the walk works
    assert list(undocumented(parser, "pipeline")) == []
