"""The two flags `peer bench pipeline` shares with `peer plan`, as `Annotated` aliases for its signature.

`peer plan`'s flags are the fields of `peer.cli.args.PlanArgs`; these aliases take their help from
those fields (`--microbatches`) and from the config field (`--wire-dtype`), so the words are written
once. Invariants: nothing here parses, validates or runs anything.
"""

from __future__ import annotations

from typing import Annotated

import typer

from peer.cli import options as o
from peer.cli.args import PlanArgs

Microbatches = Annotated[int, typer.Option(help=o.help_of(PlanArgs, "microbatches"))]
PlanWireDtype = Annotated[str, typer.Option("--wire-dtype", help=o.config_help("subspace.wire_dtype"))]
