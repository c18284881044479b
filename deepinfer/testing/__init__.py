"""Fixtures for tests, benchmarks and GPU CI, shipped with the package so that they run
from an installed wheel too; nothing in the engine imports them.

``deepinfer.testing.random_model`` makes random-weight Hugging Face checkpoints locally.
"""
