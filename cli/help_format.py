"""How every `memstep` command prints its flags and its usage mistakes.

Flags sit in four groups, by how often a user needs them: common, performance, distributed and
debugging.  `--help` leaves the debugging group out; `--help-all` prints every group.  A usage
mistake is one line and a pointer to `--help`, not the whole usage text.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

GROUPS = ("common", "performance", "distributed", "debugging")
HIDDEN = ("debugging",)  # shown by --help-all only


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default once ("(default: X)" unless its help already says it; none for on/off
    switches, whose help says what giving them does); sections in HIDDEN left out."""

    show_all = False

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=100)
        self._hiding = False

    def start_section(self, heading: str | None) -> None:
        self._hiding = heading in HIDDEN and not self.show_all
        super().start_section(heading)

    def add_argument(self, action: argparse.Action) -> None:
        if not self._hiding:
            super().add_argument(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class AllHelpFormatter(HelpFormatter):
    show_all = True


class HelpAllAction(argparse.Action):
    """`--help-all`: the help with every group, the debugging flags included."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: object):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        parser.formatter_class = AllHelpFormatter
        parser.print_help()
        parser.exit()


def add_help_all(p: argparse.ArgumentParser) -> None:
    p.add_argument("--help-all", action=HelpAllAction, help="show every flag, and exit")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one line on stderr (exit 2) and a pointer to --help."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(f"(see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)


def groups(p: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """The parser's flag groups by name (GROUPS), made on first use, in GROUPS' order."""
    made = {g.title: g for g in p._action_groups if g.title in GROUPS}
    if len(made) < len(GROUPS):
        for name in GROUPS:
            made.setdefault(name, p.add_argument_group(name))
    return {name: made[name] for name in GROUPS}
