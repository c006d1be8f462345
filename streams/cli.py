"""`tabloop streams`: the streams worker."""

from __future__ import annotations

import sys

import click

from infra.settings import settings_of
from streams.app import run_worker



@click.command()
@click.option("--guarantee", type=click.Choice(["exactly_once", "at_least_once"]), default="exactly_once",
              show_default=True)
@click.pass_context
def streams(ctx: click.Context, guarantee: str) -> None:
    """The streams worker: joins completions and feedback into reward-labelled episodes."""
    sys.argv = sys.argv[:1]  # the Faust worker parses the command line itself
    run_worker(settings_of(ctx), guarantee=guarantee)
