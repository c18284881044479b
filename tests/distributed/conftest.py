"""DP/TP tests reuse the engine tests' tiny random checkpoints and the default model
(session-scoped)."""

from tests.engine.conftest import smollm2_path, tiny_checkpoints  # noqa: F401
