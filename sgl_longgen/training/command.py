"""The command line a training run records with its checkpoints.

It lives with the trainers, not with ``sgl-longgen``'s command modules, because a trainer run as
its own script (``python -m sgl_longgen.training.proxy``) records the same line without
importing the command line: that would import every command, and with them this package.
"""

from __future__ import annotations

import argparse
import shlex

_NOT_FLAGS = {"run", "command", "trainer"}  # set by the subcommand parsers, not by the user


def command_line(args: argparse.Namespace, words: tuple[str, ...]) -> str:
    """The run as one canonical command (every flag given, defaults left out), recorded with
    each checkpoint so the run can be repeated; every flag here is ``--`` + its dest with dashes."""
    parts = ["sgl-longgen", *words]
    for dest, value in vars(args).items():
        if dest in _NOT_FLAGS or value is None or value is False:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)
