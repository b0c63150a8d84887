"""Every command's ``--help`` reads as text: no Python object reprs leak into it.

An option whose default is a callable (a knob's ``get``, read when the command runs)
made click print ``<bound method Knob.get of Knob(...)>`` as the default; any command
added later is rendered here too, since the walk starts at the top-level group.
"""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from ckptd.cli import main

#: What a repr looks like in help text: ``<bound method ...>``, ``<function f at 0x...>``,
#: ``<Foo object at 0x...>``, a dataclass repr of a knob, or click's "(dynamic)".
REPR = re.compile(r"<(bound method|function|built-in|lambda)\b|object at 0x|\bat 0x[0-9a-f]+"
                  r"|Knob\(|\(dynamic\)")


def commands(group: click.Group, prefix: tuple = ()) -> list[tuple]:
    """Every command path under ``group`` (the group itself included)."""
    found = [prefix]
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            found += commands(command, prefix + (name,))
        else:
            found.append(prefix + (name,))
    return found


def test_the_walk_finds_every_command():
    names = {path[-1] for path in commands(main) if path}
    assert {"serve", "status", "verify", "trace"} <= names, names


@pytest.mark.parametrize("path", commands(main), ids=lambda p: " ".join(p) or "ckptd")
def test_help_shows_no_object_reprs(path):
    result = CliRunner().invoke(main, [*path, "--help"], prog_name="ckptd")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    found = REPR.findall(result.output)
    assert not found, f"ckptd {' '.join(path)} --help shows object reprs:\n{result.output}"
    # click prints help text as written: a %-format escape shows up doubled
    assert "%%" not in result.output, f"ckptd {' '.join(path)} --help shows '%%'"


def test_knob_backed_defaults_show_their_values():
    result = CliRunner().invoke(main, ["serve", "--help"], prog_name="ckptd")
    text = " ".join(result.output.split())  # help wraps lines anywhere
    assert "[default: (2, or $CKPTD_WRITERS)" in text, text
    assert "[default: (60.0, or $CKPTD_DRAIN_TIMEOUT)]" in text, text
