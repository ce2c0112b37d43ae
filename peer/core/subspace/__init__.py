"""Subspace Networks: the boundary compression (`compression`), T_S and T⊥ as stages hold them
(`state`) and the trainable basis of Table 5c/5d (`grassmann`)."""
