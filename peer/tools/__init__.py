"""Research and operator tools: simulator, planner, benchmarks, demo, export, status, plots."""
