"""The math and the data, in-process only: model, subspace, sparseloco (with its codec in
`peer.core.sparseloco.codec`), the inner step, the commit, optim (torch), and corpus -> tokenizer -> data
(documents, sentencepiece, token shards and batches).

Imports only peer.core and peer.errors from this project (each module owns its config section;
peer.config assembles them and is never imported here); no grpc, hivemind, asyncio.
"""
