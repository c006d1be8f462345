"""What the compose and Kubernetes checks share: a `tabloop …` command line and TABLOOP_* variables are checked
against the CLI and the Settings themselves, not against a list kept by hand."""

from __future__ import annotations

import re

import click

from infra.settings import ENV_PREFIX, Settings, load_settings

# Commands built on other branches, run by the supervisor and named in the deployment files before they land.
# Once registered they are checked like every other command; remove a name here when its branch is merged.

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|\$\$")


def service_env(service: dict) -> dict[str, str]:
    """A compose service's environment as a dict (compose takes a list of KEY=VALUE too); a bare key is ""."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation on every string of a parsed file: ${X}, ${X:-default}, ${X-default}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.groups()
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env[name] if name in env else default
        return env.get(name, "")

    return _VAR.sub(one, value)


def variables(text: str) -> set[str]:
    return {m.group(1) for m in _VAR.finditer(text) if m.group(1)}


def check_tabloop_command(argv: list[str]) -> str:
    """Parse ``argv`` (what follows `tabloop`) with the real CLI; return the command's path, or fail."""
    from tabloop.cli import main

    cmd: click.Command = main
    path: list[str] = []
    args = list(argv)
    while isinstance(cmd, click.Group):
        if cmd.invoke_without_command and (not args or args[0].startswith("-")):
            break  # a group that runs by itself too (`tabloop history`)
        assert args, f"`tabloop {' '.join(path)}` needs a subcommand"
        name = args.pop(0)
        sub = cmd.get_command(click.Context(cmd), name)  # a registry group imports the command it names
        assert sub is not None, f"`tabloop {' '.join(path + [name])}` is not a tabloop command"
        path.append(name)
        cmd = sub
    try:
        cmd.make_context(" ".join(path), args)
    except click.ClickException as exc:
        raise AssertionError(f"`tabloop {' '.join(argv)}`: {exc.format_message()}") from None
    return " ".join(path)


def check_settings_env(env: dict[str, str]) -> Settings:
    """Every TABLOOP_* variable is a setting and its value is valid."""
    tabloop = {k: str(v) for k, v in env.items() if k.startswith(ENV_PREFIX)}
    for name in tabloop:
        assert name[len(ENV_PREFIX):].lower() in Settings.model_fields, f"{name} is not a tabloop setting"
    return load_settings(environ=tabloop)
