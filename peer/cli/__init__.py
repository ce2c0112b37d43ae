"""The `peer` command line: the only room that prints, draws or reads flags.

`main.py` holds the typer app and its commands (`peer join`, `bootstrap`, `status`, `plan`,
`simulate`, `export`, `demo`, `data prepare`); `bench.py` the `peer bench …` sub-app; `flags*.py`
every flag's name and help; `render.py` the tables and banners, `plots.py` every PNG; `simulate.py`,
`status.py`, `data_prepare.py` and `join_setup.py` the bodies of the commands that need more than a
few lines. The rooms below it (`peer.research`, `peer.export`, `peer.demo`, `peer.bootstrap`,
`peer.node`) never import it.
"""
