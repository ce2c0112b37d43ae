"""`peer demo`: a whole swarm on this machine (`run`), its summary (`summary`), and the process
handling every command that starts or stops processes uses (`processes`)."""
