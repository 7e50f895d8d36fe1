"""The user's mistakes that every command reports the same way: one line on stderr, exit 2."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input from the user (a flag value, a malformed file); the message says what and where."""
