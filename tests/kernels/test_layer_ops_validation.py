"""Argument checks of the decoder layer's elementwise ops (``rms_norm``, ``add_rms_norm``,
``rotary_qk``, ``silu_and_mul``): each bad argument is a ValueError that starts with its
name; and the backend contract: every backend exports the four with one signature.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import deepinfer_kernels
from deepinfer_kernels import activation, cpu_backend, cpu_layer_ops, reference, rotary
from tests.kernels.helpers import DEVICE

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# --- bad input ---------------------------------------------------------------------------

def _t(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.full(shape, 0.5, device=DEVICE).to(dtype)


def _rotary(**changes: object) -> None:
    """rotary_qk on valid arguments (T 3, Hq 4, Hkv 2, D 8), with ``changes`` applied."""
    args: dict[str, object] = dict(
        q=_t(3, 4, 8), k=_t(3, 2, 8), cos_sin_cache=_t(16, 8),
        positions=torch.zeros(3, dtype=torch.int64, device=DEVICE),
        q_norm_weight=None, k_norm_weight=None, eps=1e-6)
    args.update(changes)
    deepinfer_kernels.rotary_qk(**args)


BAD_INPUTS = {
    # rms_norm / add_rms_norm
    "rms_x_ndim": ("x", lambda: deepinfer_kernels.rms_norm(_t(2, 3, 8), _t(8), 1e-6)),
    "rms_x_int": ("x", lambda: deepinfer_kernels.rms_norm(_t(2, 8, dtype=torch.int32), _t(8),
                                                          1e-6)),
    "rms_x_strided_cols": ("x", lambda: deepinfer_kernels.rms_norm(_t(8, 2).t(), _t(8), 1e-6)),
    "rms_weight_shape": ("weight", lambda: deepinfer_kernels.rms_norm(_t(2, 8), _t(9), 1e-6)),
    "rms_weight_ndim": ("weight", lambda: deepinfer_kernels.rms_norm(_t(2, 8), _t(1, 8), 1e-6)),
    "rms_weight_int": ("weight", lambda: deepinfer_kernels.rms_norm(
        _t(2, 8), _t(8, dtype=torch.int64), 1e-6)),
    "rms_eps_zero": ("eps", lambda: deepinfer_kernels.rms_norm(_t(2, 8), _t(8), 0.0)),
    "rms_eps_negative": ("eps", lambda: deepinfer_kernels.rms_norm(_t(2, 8), _t(8), -1e-6)),
    "rms_eps_nan": ("eps", lambda: deepinfer_kernels.rms_norm(_t(2, 8), _t(8), float("nan"))),
    "rms_eps_none": ("eps", lambda: deepinfer_kernels.rms_norm(_t(2, 8), _t(8), None)),
    "rms_eps_str": ("eps", lambda: deepinfer_kernels.rms_norm(_t(2, 8), _t(8), "1e-6")),
    "add_x_ndim": ("x", lambda: deepinfer_kernels.add_rms_norm(_t(8), _t(8), _t(8), 1e-6)),
    "add_residual_shape": ("residual", lambda: deepinfer_kernels.add_rms_norm(
        _t(2, 8), _t(3, 8), _t(8), 1e-6)),
    "add_residual_dtype": ("residual", lambda: deepinfer_kernels.add_rms_norm(
        _t(2, 8), _t(2, 8, dtype=BF16), _t(8), 1e-6)),
    "add_residual_ndim": ("residual", lambda: deepinfer_kernels.add_rms_norm(
        _t(2, 8), _t(1, 2, 8), _t(8), 1e-6)),
    "add_weight_shape": ("weight", lambda: deepinfer_kernels.add_rms_norm(
        _t(2, 8), _t(2, 8), _t(4), 1e-6)),
    "add_eps_zero": ("eps", lambda: deepinfer_kernels.add_rms_norm(_t(2, 8), _t(2, 8), _t(8), 0)),
    # rotary_qk
    "rot_q_ndim": ("q", lambda: _rotary(q=_t(3, 32))),
    "rot_q_int": ("q", lambda: _rotary(q=_t(3, 4, 8, dtype=torch.int32))),
    "rot_q_odd_head_dim": ("q", lambda: _rotary(q=_t(3, 4, 7), k=_t(3, 2, 7),
                                                 cos_sin_cache=_t(16, 7))),
    "rot_k_head_dim": ("k", lambda: _rotary(k=_t(3, 2, 16))),
    "rot_k_tokens": ("k", lambda: _rotary(k=_t(4, 2, 8))),
    "rot_k_dtype": ("k", lambda: _rotary(k=_t(3, 2, 8, dtype=F16))),
    "rot_k_ndim": ("k", lambda: _rotary(k=_t(3, 16))),
    "rot_cache_width": ("cos_sin_cache", lambda: _rotary(cos_sin_cache=_t(16, 4))),
    # No row: the kernel would still read row 0 for an out-of-range position.
    "rot_cache_empty": ("cos_sin_cache", lambda: _rotary(cos_sin_cache=_t(0, 8))),
    "rot_cache_dtype": ("cos_sin_cache", lambda: _rotary(cos_sin_cache=_t(16, 8, dtype=BF16))),
    "rot_positions_int32": ("positions", lambda: _rotary(
        positions=torch.zeros(3, dtype=torch.int32, device=DEVICE))),
    "rot_positions_float": ("positions", lambda: _rotary(positions=_t(3))),
    "rot_positions_length": ("positions", lambda: _rotary(
        positions=torch.zeros(4, dtype=torch.int64, device=DEVICE))),
    "rot_only_q_norm": ("q_norm_weight, k_norm_weight", lambda: _rotary(q_norm_weight=_t(8))),
    "rot_only_k_norm": ("q_norm_weight, k_norm_weight", lambda: _rotary(k_norm_weight=_t(8))),
    "rot_q_norm_shape": ("q_norm_weight", lambda: _rotary(q_norm_weight=_t(4),
                                                           k_norm_weight=_t(8))),
    "rot_k_norm_shape": ("k_norm_weight", lambda: _rotary(q_norm_weight=_t(8),
                                                           k_norm_weight=_t(16))),
    "rot_norm_eps_zero": ("eps", lambda: _rotary(q_norm_weight=_t(8), k_norm_weight=_t(8),
                                                 eps=0.0)),
    "rot_norm_eps_none": ("eps", lambda: _rotary(q_norm_weight=_t(8), k_norm_weight=_t(8),
                                                 eps=None)),
    # silu_and_mul
    "silu_ndim": ("gate_up", lambda: deepinfer_kernels.silu_and_mul(_t(8))),
    "silu_int": ("gate_up", lambda: deepinfer_kernels.silu_and_mul(_t(2, 8, dtype=torch.int64))),
    "silu_odd_width": ("gate_up", lambda: deepinfer_kernels.silu_and_mul(_t(2, 7))),
    "silu_strided_cols": ("gate_up", lambda: deepinfer_kernels.silu_and_mul(_t(8, 2).t())),
}


@pytest.mark.parametrize("name, call", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_value_error_naming_the_argument(name, call):
    # Messages start with the argument's name: "x: expected ..." (a bare "x" would match
    # almost any message).
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        call()


# --- backend contract --------------------------------------------------------------------

LAYER_OPS = ("rms_norm", "add_rms_norm", "rotary_qk", "silu_and_mul")


def test_layer_ops_exported_by_every_backend():
    """``deepinfer_kernels`` (Triton), its ``cpu_backend`` and its ``reference`` all export
    the four ops with the reference's signature; the CPU backend runs its C ones
    (``cpu_layer_ops``, same signature)."""
    # kernels.rms_norm is the function (it shadows its module's name in the package).
    rms_norm_module = importlib.import_module("deepinfer_kernels.rms_norm")
    triton_impl = {"rms_norm": rms_norm_module.rms_norm,
                   "add_rms_norm": rms_norm_module.add_rms_norm,
                   "rotary_qk": rotary.rotary_qk, "silu_and_mul": activation.silu_and_mul}
    for name in LAYER_OPS:
        assert name in deepinfer_kernels.__all__ and name in cpu_backend.__all__, name
        assert getattr(deepinfer_kernels, name) is triton_impl[name]
        assert getattr(cpu_backend, name) is getattr(cpu_layer_ops, name)
        ref = inspect.signature(getattr(reference, name))
        for impl in (deepinfer_kernels, cpu_layer_ops):
            ours = inspect.signature(getattr(impl, name))
            assert [(p.name, p.default) for p in ours.parameters.values()] == [
                (p.name, p.default) for p in ref.parameters.values()], name
