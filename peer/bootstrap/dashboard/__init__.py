"""The live dashboard of a run: a web page and a JSON API built from the DHT records (docs/monitoring.md).

Served beside the bootstrap (`peer bootstrap --dashboard-port`) or alone (`peer dashboard`); it reads
what the bootstrap already reads, and sends nothing to any peer."""
