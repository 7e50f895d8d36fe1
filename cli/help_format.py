"""How every `memstep` command prints its flags."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to each flag's help, except to on/off switches, which are off (or on,
    for a --no-* flag) unless given: their help says what giving them does."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.nargs == 0:
            return action.help or ""
        return super()._get_help_string(action) or ""
