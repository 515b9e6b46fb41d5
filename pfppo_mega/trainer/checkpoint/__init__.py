"""Checkpoints: the on-disk store (store.py: atomic, verified, data only) and the trainer's save and
resume of a Run (resume.py)."""
