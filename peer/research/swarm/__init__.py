"""`peer bench swarm`: the round at swarm scale, modelled (`sim`, `gather`, `voted`, `net`, `sizes`) and
calibrated against a real loopback swarm (`calib`, `run`)."""
