"""Research and operator tools behind the `peer` commands; they may import core, net and node, never the CLI.

simulate/sim_replica (`peer simulate`), plan (`peer plan`), bench (`peer bench`), export
(`peer export`), status (`peer status`), demo/demo_summary/processes (`peer demo`), plots (every
PNG), render (the tables the CLI prints) and flags (every CLI flag's name and help).
"""
