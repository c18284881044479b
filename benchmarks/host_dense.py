"""The dense floor of ``bench_host.py``: the tiny model's decode step as plain torch over a
dense ``[B, ctx]`` KV cache (embed, RMSNorm, qkv, RoPE, SDPA, o_proj, MLP, norm, lm head,
argmax) with the loaded model's own layers (weights as loaded, GGUF blocks included), the
least any CPU forward can cost."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from host_fixtures import PROMPT_LEN


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def dense_step(model, kc: list[torch.Tensor], vc: list[torch.Tensor], pos: int,
               tok: torch.Tensor) -> torch.Tensor:
    """One decode step of ``model`` as plain torch: tokens ``[B]`` at position ``pos``,
    dense caches ``[B, Hkv, ctx, D]`` per layer (this step's K/V written at ``pos``) ->
    greedy next tokens ``[B]``. Uses the model's own weights."""
    cfg = model.config
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = model.model.embed_tokens(tok)
    cos, sin = model.rotary.cos_sin_cache[pos].chunk(2, dim=-1)
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        y = _rms(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        q, k, v = a.qkv_proj(y).split(
            [h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(-1, h, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        if a.q_norm is not None:
            q = _rms(q, a.q_norm.weight, a.q_norm.eps)
            k = _rms(k, a.k_norm.weight, a.k_norm.eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        kc[i][:, :, pos] = k
        vc[i][:, :, pos] = v
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kc[i][:, :, :pos + 1], vc[i][:, :, :pos + 1],
            scale=a.attn.scale, enable_gqa=h != hkv)
        x = x + a.o_proj(o.reshape(-1, h * d))
        y = _rms(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        gate, up = layer.mlp.gate_up_proj(y).chunk(2, dim=-1)
        x = x + layer.mlp.down_proj(F.silu(gate) * up)
    x = _rms(x, model.model.norm.weight, model.model.norm.eps)
    return model.compute_logits(x).argmax(-1)


def dense_runner(model, num_seqs: int, steps: int, seed: int) -> Callable[[], None]:
    """A callable running one ``dense_step`` of ``num_seqs`` sequences per call, all at the
    same position, from PROMPT_LEN on (the cache before it holds random K/V); the position
    wraps back after ``steps + 2`` calls."""
    cfg = model.config
    dtype = model.activation_dtype
    ctx = PROMPT_LEN + steps + 4
    g = torch.Generator().manual_seed(seed)
    shape = (num_seqs, cfg.num_kv_heads, ctx, cfg.head_dim)
    kc = [torch.randn(shape, generator=g, dtype=dtype) for _ in model.model.layers]
    vc = [torch.randn(shape, generator=g, dtype=dtype) for _ in model.model.layers]
    state = {"tok": torch.randint(3, cfg.vocab_size, (num_seqs,), generator=g), "s": 0}

    @torch.inference_mode()
    def run() -> None:
        state["tok"] = dense_step(model, kc, vc, PROMPT_LEN + state["s"], state["tok"])
        state["s"] = (state["s"] + 1) % (steps + 2)

    return run


def time_dense(model, num_seqs: int, steps: int, seed: int) -> float:
    """Seconds per ``dense_step`` with ``num_seqs`` sequences (see ``dense_runner``)."""
    run = dense_runner(model, num_seqs, steps, seed)
    for _ in range(2):
        run()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - t0) / steps
