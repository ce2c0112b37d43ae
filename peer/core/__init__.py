"""The math and the data, in-process only: model, subspace, sparseloco, outer, optim (torch), and
corpus -> tokenizer -> data (documents, sentencepiece, token shards and batches).

Imports only peer.core, peer.config and peer.errors from this project; no grpc, hivemind, asyncio.
"""
