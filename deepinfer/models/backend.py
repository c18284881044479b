"""The kernel ops deepinfer calls, declared on the consumer's side.

A backend is any object with these ops; the three that ship are modules of the
``deepinfer_kernels`` package (which never imports deepinfer): the package itself (Triton:
compiled on CUDA, interpreted on CPU), ``deepinfer_kernels.cpu_backend`` (the reference's
signatures, decode attention in C) and ``deepinfer_kernels.reference`` (plain torch, the
test oracle). A module satisfies a ``Protocol`` structurally, so nothing registers itself:
tests/models/test_backend_protocol.py checks each of the three against these declarations,
op by op and parameter by parameter.

- ``ModelBackend``: what the decoder (attention, norms, RoPE, MLP, MoE) calls per layer,
  and the fused decode stack a backend may offer in place of those calls.
- ``KernelBackend``: that, plus what the runner and the sampler call around the forward
  (cache and state copies, token sampling). ``deepinfer.worker.resolve_backend`` picks one.

Shapes: KV cache per layer ``[num_blocks, block_size, Hkv, D]``; a slot is
``block_id * block_size + offset``; ``T`` tokens in a step, ``B`` sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from deepinfer_kernels.decoder_spec import DecoderStackFn, DecoderStackSpec


class ModelBackend(Protocol):
    """The ops a model's forward calls. Parameter names and defaults are the
    implementations' own (callers pass the optional ones by keyword)."""

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write token t's K/V (``[T, Hkv, D]``) at ``slot_mapping[t]`` (``[T]`` int64);
        a negative slot is padding and skipped."""
        ...

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float | None = None,
                               out: torch.Tensor | None = None, num_splits: int | None = None,
                               max_seq_len: int | None = None,
                               window: int | None = None,
                               softcap: float | None = None) -> torch.Tensor:
        """One query per sequence (q ``[B, Hq, D]``) over its ``seq_lens[b]`` cached keys
        (block_tables ``[B, W]`` int32), its last ``window`` of them with a sliding
        window, each scaled score ``s`` taken as ``softcap * tanh(s / softcap)`` with a
        soft cap; returns ``[B, Hq, D]``. ``num_splits`` and ``max_seq_len`` are hints
        only a kernel may use."""
        ...

    def paged_prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                scale: float | None = None, out: torch.Tensor | None = None,
                                max_query_len: int | None = None,
                                window: int | None = None,
                                softcap: float | None = None) -> torch.Tensor:
        """Causal attention of packed new tokens (q ``[T, Hq, D]``, query_start_loc
        ``[B+1]`` int32) over the cached prefix and themselves (seq_lens ``[B]`` int32 =
        prefix + new tokens), position ``p`` over keys ``p - window + 1 .. p`` with a
        sliding window, scores soft-capped as in decode; returns ``[T, Hq, D]``."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / rms(x)`` over the last dim, statistics in fp32; x's dtype."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + residual``; returns ``(rms_norm(s, weight, eps), s)``."""
        ...

    def rotary_qk(self, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                  positions: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                  k_norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox RoPE of q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` at ``positions`` (``[T]``
        int64) from the ``[max_positions, D]`` cos/sin table; with the norm weights, a
        per-head RMSNorm of q and k first (Qwen3)."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2I]`` (gate, then up) -> ``silu(gate) * up`` ``[T, I]``."""
        ...

    def moe_route(self, router_logits: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over ``[T, E]`` router logits, the ``top_k`` largest: ``(weights
        [T, top_k] fp32, expert ids [T, top_k] int32)``, renormalized to sum 1 if asked."""
        ...

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU mixture-of-experts MLP of x ``[T, H]`` with experts' w13 ``[E, 2I, H]``
        and w2 ``[E, H, I]``, weighted by the routing; returns ``[T, H]``."""
        ...

    def fused_moe_gguf(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       qtype13: int, qtype2: int, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """``fused_moe`` with the experts held as GGUF blocks: w13 uint8 ``[E, 2I,
        row_bytes(H)]`` of ggml type ``qtype13``, w2 uint8 ``[E, H, row_bytes(I)]`` of
        type ``qtype2``; returns ``[T, H]``."""
        ...

    def bind_decoder_stack(self, spec: DecoderStackSpec) -> DecoderStackFn | None:
        """A decode step's whole stack of layers as one fused call, bound once to the
        model's weights (``deepinfer_kernels.decoder_spec``); None where this backend has
        none for them, and the model runs layer by layer."""
        ...


class KernelBackend(ModelBackend, Protocol):
    """``ModelBackend`` plus the ops the runner and the sampler call around a forward."""

    def clone_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        """Copy KV block src to dst (pairs ``[N, 2]``) in every layer, K and V, of the
        whole cache ``[num_layers, 2, num_blocks, block_size, Hkv, D]``."""
        ...

    def zero_states(self, states: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
        """Zero rows ``slots`` (``[M]``) of every tensor in ``states`` (slot is dim 0)."""
        ...

    def clone_states(self, states: Sequence[torch.Tensor], pairs: torch.Tensor) -> None:
        """Copy row src to row dst (pairs ``[P, 2]``) in every tensor of ``states``."""
        ...

    def sample_tokens(self, logits: torch.Tensor, temperatures: torch.Tensor,
                      uniforms: torch.Tensor) -> torch.Tensor:
        """One draw per row of ``softmax(logits / temperature)`` (logits ``[N, V]``) by
        inverting the CDF at ``uniforms`` (``[N]`` fp32); returns ``[N]`` int64."""
        ...

    def sample_tokens_filtered(self, logits: torch.Tensor, temperatures: torch.Tensor,
                               uniforms: torch.Tensor, top_k: torch.Tensor | None = None,
                               top_p: torch.Tensor | None = None,
                               min_p: torch.Tensor | None = None,
                               max_top_k: int | None = None) -> torch.Tensor:
        """``sample_tokens`` after top-k (``[N]`` int64), top-p and min-p (``[N]`` fp32
        each; None: off for every row), in that order (``reference.filter_logits``);
        ``logits`` not modified; ``max_top_k``: a host bound on the rows' ``top_k``."""
        ...
