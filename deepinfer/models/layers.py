"""Building blocks of the decoder: RMSNorm, the rotary embedding's cos/sin cache, the gated
(SwiGLU) MLP (Linear and Embedding without random init live in ``parallel_layers``).

The torch versions of their ops (``deepinfer_kernels.reference``, the CPU backend) reproduce the
Hugging Face ops bit-for-bit in the same dtype (same order of float operations), so fp32
logits match transformers to rounding; the Triton backend fuses them (norm with the
residual add, q/k norm with RoPE) within the kernels' tolerances.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.backend import ModelBackend
from deepinfer.models.parallel_layers import Linear, row_parallel_linear
from deepinfer.models.tensor_parallel import SINGLE, TPGroup
from deepinfer_kernels import reference


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last dim, the statistics taken in fp32."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., size]`` any float dtype -> same shape and dtype."""
        return reference.rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one Linear
    (``gate_up_proj``: gate rows, then up rows). Under tensor parallelism
    ``intermediate_size`` is this rank's share: gate/up column-parallel, down
    row-parallel (one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 tp: TPGroup = SINGLE, act: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.act = act  # "silu", or Gemma's "gelu_tanh" (GeGLU)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = row_parallel_linear(intermediate_size, hidden_size, tp=tp)

    def forward(self, x: torch.Tensor, backend: ModelBackend | None = None) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``; ``backend``: the kernel provider whose
        ``silu_and_mul`` runs (None: the torch reference's). GeGLU runs as torch ops, each
        rounded to x's dtype as transformers' Gemma rounds them."""
        gate_up = self.gate_up_proj(x)
        if self.act == "gelu_tanh":
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj((backend or reference).silu_and_mul(gate_up))


def add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
             backend: ModelBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's input norm over the residual stream ``x + residual`` (``[T, hidden]``;
    ``residual`` None: ``x`` is the stream, the first layer's embeddings), the add fused
    into it: returns ``(normed, stream)``."""
    if residual is None:
        return backend.rms_norm(x, norm.weight, norm.eps), x
    return backend.add_rms_norm(x, residual, norm.weight, norm.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  freq_factors: tuple[float, ...] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32, with linear / llama3 / yarn scaling
    applied."""
    ar = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (theta ** (ar / head_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32, device="cpu")
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    return inv_freq


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN and LongRoPE multiply cos and sin by (1.0 for the other variants):
    the config's ``attention_factor``, else for YaRN ``0.1 ln(factor) + 1``, with
    DeepSeek's ``mscale`` / ``mscale_all_dim`` ratio where both are set, and for LongRoPE
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 for a factor <= 1)."""
    s = scaling or {}
    if s.get("rope_type") not in ("yarn", "longrope"):
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    if s["rope_type"] == "longrope":
        orig = float(s["original_max_position_embeddings"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))

    def gain(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return gain(float(s["mscale"])) / gain(float(s["mscale_all_dim"]))
    return gain(1.0)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float,
                   s: dict[str, Any]) -> torch.Tensor:
    """YaRN (NTK-by-parts): dimensions that turn fewer than ``beta_slow`` times over the
    original context are interpolated (divided by ``factor``), those that turn more than
    ``beta_fast`` times are kept, with a linear ramp between the two."""
    factor = float(s["factor"])
    old_len = float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_at(turns: float) -> float:  # the dimension index that turns `turns` times
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_at(fast), dim_at(slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if hi == lo:
        hi += 0.001  # a ramp of zero width would divide by zero
    ramp = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((ramp - lo) / (hi - lo)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth
    blend between ``high_freq_factor`` and ``low_freq_factor`` wavelengths."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half, as HF) RoPE with a precomputed cos/sin cache.

    The cache ``[max_positions, head_dim]`` (cos half, then sin half) is built once in
    the model dtype; the backend's ``rotary_qk`` reads the rows of a step's positions
    from it: no trig per step, and a CUDA graph can replay it.

    A partial rotary (``rotary_dim < head_dim``) fills the pairs past ``rotary_dim / 2``
    with cos 1 and sin 0, which leave their values as they are: the loader has reordered
    each head's q/k rows (:func:`deepinfer.loading.checkpoint_parts.rotary_row_order`) so
    that the rotated pairs come first, and the kernels need not know. LongRoPE's cache
    rows below ``original_max_position_embeddings`` use its short factors, the rest its
    long ones (per position: transformers switches a whole forward at that length).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None,
                 freq_factors: tuple[float, ...] | None = None,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        self._args = (theta, scaling, freq_factors)
        self.register_buffer("cos_sin_cache", self._compute(dtype, device), persistent=False)

    def _freqs(self, t: torch.Tensor) -> torch.Tensor:
        """Angles ``[positions, rotary_dim / 2]`` of positions ``t`` (fp32)."""
        theta, scaling, freq_factors = self._args
        rot = self.rotary_dim
        if (scaling or {}).get("rope_type") != "longrope":
            return torch.outer(t, rope_inv_freq(rot, theta, scaling, freq_factors))
        orig = int(scaling["original_max_position_embeddings"])
        shape = torch.arange(0, rot, 2, dtype=torch.int64, device="cpu").float() / rot
        parts = []
        for key, pos in (("short_factor", t[:orig]), ("long_factor", t[orig:])):
            ext = torch.tensor(scaling[key], dtype=torch.float32, device="cpu")
            parts.append(torch.outer(pos, 1.0 / (ext * theta ** shape)))  # as transformers
        return torch.cat(parts)

    def _compute(self, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
        # Always computed on the CPU (explicit device: the loader builds modules under a
        # "meta" default device), then moved.
        t = torch.arange(self.max_positions, dtype=torch.int64, device="cpu").float()
        freqs = self._freqs(t)
        gain = rope_attention_factor(self._args[1])
        # Computed in fp32 then cast, as HF does, so low-precision models match it.
        cos, sin = freqs.cos() * gain, freqs.sin() * gain
        if self.rotary_dim < self.head_dim:  # the pairs left as they are
            rest = (t.shape[0], (self.head_dim - self.rotary_dim) // 2)
            cos = torch.cat([cos, torch.ones(rest, device="cpu")], -1)
            sin = torch.cat([sin, torch.zeros(rest, device="cpu")], -1)
        cache = torch.cat([cos, sin], dim=-1)
        return cache.to(dtype=dtype, device=device)

    def rebuild(self, dtype: torch.dtype, device: torch.device | str) -> None:
        """Recompute the cache (after ``to_empty`` left it uninitialised)."""
        self.cos_sin_cache = self._compute(dtype, device)
