"""`tabloop serve`: the front door."""

from __future__ import annotations

import asyncio

import click

from infra.errors import TabloopError
from infra.settings import settings_of
from policy.models import ModelLoadError
from serving.server import Server
from trainer.build_models import build_named_model



@click.command()
@click.pass_context
def serve(ctx: click.Context) -> None:
    """The front door: completions on TABLOOP_COMPLETIONS_PORT (8081), feedback on TABLOOP_FEEDBACK_PORT (8082)."""
    try:
        settings = settings_of(ctx)
        build_named_model(settings)  # the demo model is pretrained by the trainer's code, before the door finds it
        server = Server(settings)
    except (ModelLoadError, ValueError, OSError) as exc:
        raise TabloopError(str(exc)) from None
    click.echo(f"tabloop serve: completions http://{server.settings.serve_host}:{server.ports[0]}/v1 "
               f"feedback http://{server.settings.serve_host}:{server.ports[1]} "
               f"(engine {server.engine.name}, model {server.engine.model_name}, auth {server.settings.auth})")
    try:
        asyncio.run(server.serve())
    except KeyboardInterrupt:
        pass


# -- vllm ---------------------------------------------------------------------------
