"""`peer export`: the trained model out of checkpoints (`checkpoints`) or a live swarm (`live`), as
a Hugging Face model (`model`), byte-identical three ways (`command`)."""
