"""`peer bench …`: measurements that return data for the CLI to render — commit, fetch, data,
memory, pipeline, replica, simulate, swarm, sybil, link caps — the chaos harness (`chaos`,
`chaos_report`), network namespaces (`netns`), the userspace delay relay and pipeline peers in
one process (`pipeline_peers`). `common` holds what they share."""
