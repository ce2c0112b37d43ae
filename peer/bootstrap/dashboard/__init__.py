"""The live dashboard of a run (`peer bootstrap --dashboard-port`, `peer dashboard`): a web page and a
JSON API built from the DHT records the bootstrap already reads (docs/monitoring.md)."""
