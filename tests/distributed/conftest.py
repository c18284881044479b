"""DP tests reuse the engine tests' tiny random checkpoints (session-scoped)."""

from tests.engine.conftest import tiny_checkpoints  # noqa: F401
