"""Checkpoints on disk: whole-model checkpoints for export and per-stage training checkpoints."""
