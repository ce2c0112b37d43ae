"""One peer: where the math meets the network (stage workers, service, pipeline, rounds, session, trainer)."""
