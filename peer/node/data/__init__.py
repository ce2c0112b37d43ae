"""The run's dataset on a peer: shards fetched by sha256 from whoever serves them (`fetch`) and
served to others (`serve`)."""
