"""Command-line flags built from dataclass fields: a flag's name, default and help live in one field.

A command's flags are one frozen dataclass (`peer.cli.args`). Each field is either `flag(default,
help)`, a flag of the command itself, or `setting("train.inner_steps")`, a flag that overrides one
field of a config dataclass (`RunConfig`, `LinkConfig`): its help is that field's `help` metadata, its
default None ("not given": TOML, `PEER_*` and the config's default decide, defaults < TOML < `PEER_*`
env < flags) and the help ends with the value it falls back to. A flag's name is its field's,
hyphenated (`inner_steps`: `--inner-steps`), unless the field names others. `command(app)` registers
`def cmd(a: Args)` as a typer command whose options are the dataclass's fields; `overrides(a)` is the
dotted keys the given settings set.

Hand-written plumbing, not tyro: typer is the CLI library already, and typer builds a command from
a signature, so one `inspect.Signature` made from the fields is all it takes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, get_type_hints

import typer

FLAG = "peer.cli.flag"  # the field metadata key of a flag's FlagSpec
REQUIRED: Any = dataclasses.MISSING  # `flag(REQUIRED, …)`: a flag (or argument) without a default


@dataclass(frozen=True)
class FlagSpec:
    """How one dataclass field becomes a typer parameter."""

    help: str | None
    names: tuple[str, ...] = ()  # e.g. ("--json",); () gives --field-name
    setting: str | None = None  # the dotted config key it overrides ("train.inner_steps"), if any
    argument: bool = False  # a positional typer.Argument instead of an option
    option: Mapping[str, Any] = field(default_factory=dict)  # more typer.Option / Argument keywords


def flag(default: Any, help: str | None, *names: str, argument: bool = False, **option: Any) -> Any:
    """A field that is a flag of the command itself (`dataclasses.field` with its FlagSpec)."""
    return field(default=default, metadata={FLAG: FlagSpec(help, names, None, argument, option)})


def setting(key: str, *names: str, defaults: Mapping[str, Any] | None = None, **option: Any) -> Any:
    """A field that overrides the config field `key` ("seed", "train.lr", "link.relay"): help from
    that field's metadata, default None, the fallback value (the config's default, or the
    command's own `defaults`, dotted keys as `build_config` takes them) at the end of the help."""
    help_text = config_help(key)
    fallback = _fallback(key, tuple(sorted((defaults or {}).items())))
    if fallback is not None:
        help_text = f"{help_text.rstrip('.')} (default {fallback})."
    return field(default=None, metadata={FLAG: FlagSpec(help_text, names, key, False, option)})


def config_help(key: str) -> str:
    """The help metadata of the config field `key`: for a command's own flag that means the same thing."""
    help_text: str = _config_field(key).metadata["help"]
    return help_text


def help_of(cls: type, name: str) -> str | None:
    """The help of the flag `name` of the flags dataclass `cls` (for an `Annotated` alias that shares it)."""
    return spec({f.name: f for f in dataclasses.fields(cls)}[name]).help


def _config_field(key: str) -> dataclasses.Field[Any]:
    """The dataclass field behind a dotted key: a RunConfig section's, RunConfig's own, or LinkConfig's."""
    from peer.config import RunConfig
    from peer.node.link_config import LinkConfig

    section, _, name = key.rpartition(".")
    owner: Any = LinkConfig if section == "link" else RunConfig
    if section and section != "link":
        owner = get_type_hints(RunConfig)[section]
    found = {f.name: f for f in dataclasses.fields(owner)}.get(name)
    if found is None or "help" not in found.metadata:
        raise KeyError(f"{key}: no such config field with help metadata")
    return found


@functools.cache
def _fallback(key: str, defaults: tuple[tuple[str, Any], ...]) -> Any:
    """The value a setting takes when no layer sets it (the command's defaults applied)."""
    from peer.config import build_config
    from peer.config import setting as value_of
    from peer.node.link_config import LinkConfig

    if key.startswith("link."):
        return getattr(LinkConfig(), key.split(".", 1)[1]) or None  # 0: no cap, said by the help itself
    return value_of(build_config(environ={}, defaults=dict(defaults)), key)


def spec(f: dataclasses.Field[Any]) -> FlagSpec:
    spec: FlagSpec = f.metadata[FLAG]
    return spec


def overrides(args: Any, section: str | None = None) -> dict[str, Any]:
    """{dotted RunConfig key: value} of the `setting` fields of `args` (None: not given); with
    `section` ("link"), that section's fields by name instead."""
    out = {}
    for f in dataclasses.fields(args):
        key = spec(f).setting
        if key is None or (key.split(".")[0] == "link") != (section == "link"):
            continue
        out[key.split(".", 1)[1] if section else key] = getattr(args, f.name)
    return out


def parameters(cls: type) -> list[inspect.Parameter]:
    """The typer parameters of a flags dataclass, in field order."""
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        s = spec(f)
        kind = typer.Argument if s.argument else typer.Option
        info = kind(*s.names, help=s.help, **dict(s.option))  # type: ignore[operator]
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        out.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[hints[f.name], info]
            )
        )
    return out


def command(app: typer.Typer, name: str | None = None) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Register `fn(a: Args)` as the typer command `name` (default fn's name) with Args's fields as flags."""

    def register(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        cls = get_type_hints(fn)[next(iter(inspect.signature(fn).parameters))]
        params = parameters(cls)

        def run(**values: Any) -> Any:
            return fn(cls(**values))

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        run.__name__, run.__doc__ = fn.__name__, fn.__doc__
        app.command(name)(run)
        return fn

    return register
