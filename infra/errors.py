"""The one error type for a person, at the bottom so every area's commands can raise it."""

from __future__ import annotations

import click


class TabloopError(click.ClickException):
    """An error for a person: printed without a traceback, exit code 1."""
