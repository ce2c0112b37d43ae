"""peer: peer-to-peer pre-training of LLMs with subspace-compressed pipelines and SparseLoCo rounds."""

__version__ = "0.1.0"
