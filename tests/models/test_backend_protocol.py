"""The declared backend interface (``deepinfer.models.backend``) against the three kernel
implementations that ship: every declared op is present in each, with the Protocol's
parameter names, order, kinds and defaults; and every op the models call is declared."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from deepinfer.models import backend as backend_module
from deepinfer.models.backend import KernelBackend, ModelBackend

MODELS_DIR = Path(backend_module.__file__).parent


def declared_ops(protocol: type) -> dict[str, inspect.Signature]:
    """The methods a Protocol declares (its own and its protocol bases'), each signature
    without ``self``."""
    ops: dict[str, inspect.Signature] = {}
    for cls in reversed(protocol.__mro__):
        if cls.__module__ != backend_module.__name__:
            continue  # object, Protocol, Generic
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and not name.startswith("_"):
                sig = inspect.signature(value)
                ops[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return ops


def _params(sig: inspect.Signature) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def mismatches(impl: Any, protocol: type) -> list[str]:
    """What ``impl`` lacks or declares differently from ``protocol``, one line each."""
    problems = []
    for name, want in declared_ops(protocol).items():
        op = getattr(impl, name, None)
        if op is None or not callable(op):
            problems.append(f"{name}: missing")
            continue
        got = inspect.signature(op)
        if _params(got) != _params(want):
            problems.append(f"{name}{got} differs from the Protocol's {name}{want}")
    return problems


def _implementation(name: str) -> ModuleType:
    if name == "triton":
        pytest.importorskip("triton")  # without it the package's ops are stand-ins
        import deepinfer_kernels

        return deepinfer_kernels
    if name == "cpu_backend":
        from deepinfer_kernels import cpu_backend

        return cpu_backend
    from deepinfer_kernels import reference

    return reference


@pytest.mark.parametrize("name", ["triton", "cpu_backend", "reference"])
def test_implementation_provides_every_declared_op(name: str) -> None:
    impl = _implementation(name)
    assert mismatches(impl, KernelBackend) == [], name


def test_kernel_backend_extends_the_model_backend() -> None:
    model_ops, kernel_ops = declared_ops(ModelBackend), declared_ops(KernelBackend)
    assert set(model_ops) < set(kernel_ops)
    assert {"store_kv", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
            "add_rms_norm", "rotary_qk", "silu_and_mul", "moe_route",
            "fused_moe", "fused_moe_gguf", "bind_decoder_stack"} == set(model_ops)
    assert set(kernel_ops) - set(model_ops) == {"clone_blocks", "zero_states",
                                                "clone_states", "sample_tokens",
                                                "sample_tokens_filtered"}


def _copy_of_reference(**replace: Any) -> SimpleNamespace:
    from deepinfer_kernels import reference

    ops = {name: getattr(reference, name) for name in declared_ops(KernelBackend)}
    ops.update(replace)
    return SimpleNamespace(**{k: v for k, v in ops.items() if v is not None})


def test_check_catches_a_missing_op() -> None:
    impl = _copy_of_reference(clone_states=None)
    assert mismatches(impl, KernelBackend) == ["clone_states: missing"]


def test_check_catches_a_renamed_parameter_and_a_changed_default() -> None:
    def rms_norm(x, w, eps):  # "weight" renamed
        return x

    def rotary_qk(q, k, cos_sin_cache, positions, q_norm_weight=None, k_norm_weight=None,
                  eps=1e-5):
        return q, k

    impl = _copy_of_reference(rms_norm=rms_norm, rotary_qk=rotary_qk)
    found = mismatches(impl, KernelBackend)
    assert [line.split("(")[0] for line in found] == ["rms_norm", "rotary_qk"]


def _backend_calls(path: Path) -> set[str]:
    """Attributes the module at ``path`` reads off a name or attribute called ``backend``
    (``backend.op(...)``, ``self.backend.op(...)``)."""
    called = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute):
            base = node.value
            base_name = (base.id if isinstance(base, ast.Name)
                         else base.attr if isinstance(base, ast.Attribute) else None)
            if base_name == "backend":
                called.add(node.attr)
    return called


def test_every_op_the_models_call_is_declared() -> None:
    called = {op for path in MODELS_DIR.glob("*.py") for op in _backend_calls(path)}
    assert {"store_kv", "rotary_qk", "add_rms_norm", "moe_route"} <= called  # the scan works
    assert called <= set(declared_ops(ModelBackend)), called - set(declared_ops(ModelBackend))
