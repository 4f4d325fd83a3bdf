"""Every command and every option of the `pipeline` CLI says what it is in --help."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from pipeline.commands.cli import build_parser
from pipeline.commands.help_format import commands, silent_default


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
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"prepare", "inspect", "bench", "maxtext"} <= set(subcommands.choices)  # the walk works
    assert list(undocumented(parser, "pipeline")) == []


def unstated_defaults(parser: argparse.ArgumentParser, name: str) -> Iterator[str]:
    """`COMMAND: OPTION` for each option whose default is a value its help does not state."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if silent_default(action.default) or not action.option_strings:
            continue
        if "default" not in formatter._get_help_string(action):
            yield f"{name}: {'/'.join(action.option_strings)}"


def test_every_command_says_what_it_does_names_positionals_alike_and_states_defaults():
    found = list(commands(build_parser(), "pipeline"))
    assert {"pipeline verify-store", "pipeline plot", "pipeline maxtext install"} <= dict(
        found
    ).keys()
    assert [name for name, p in found if not p.description] == []
    positionals = {
        f"{name}: {action.metavar or action.dest}"
        for name, p in found
        for action in p._actions
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction)
    }
    assert positionals and all(p.split(": ")[1].isupper() for p in positionals), positionals
    assert [line for name, p in found for line in unstated_defaults(p, name)] == []


def test_the_trainer_and_the_benchmark_explain_every_option():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("train", root / "scripts" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    trainer = train.build_parser()
    assert list(undocumented(trainer, "train.py")) == []
    assert list(unstated_defaults(trainer, "train.py")) == []
    from pipeline.commands import bench

    module = bench.load()
    parser = argparse.ArgumentParser(formatter_class=bench.DefaultsFormatter)
    module.add_arguments(parser)
    assert list(undocumented(parser, "bench")) == []
    assert list(unstated_defaults(parser, "bench")) == []
