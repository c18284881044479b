"""Checkpoint readers: each yields ``(hf_name, tensor)`` pairs for ``load_weights``."""
