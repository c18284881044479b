"""Tiny llama GGUF files whose weights are GGUF blocks of one chosen type, written by the
tests: quantized by the ``gguf`` package where it can quantize the type (the 32-weight
formats), random blocks with finite fp16 scales where it cannot (the K-quants)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GQ
from gguf import GGUFWriter
from gguf.quants import quantize as gguf_quantize

from deepinfer_kernels.gguf_blocks import block_format
from tests.kernels.gguf_helpers import GGUF_QUANTIZES, make_blocks, rng_for

# Every size a multiple of 256, so the K-quants (blocks of 256 weights) fit each row.
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 320
HEAD_DIM = HIDDEN // HEADS


def _blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    fmt = block_format(int(GQ[name]))
    if name in GGUF_QUANTIZES:
        w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        return gguf_quantize(w, GQ[name])
    return make_blocks(fmt, rows, cols, rng)


def write_quantized_gguf(path: str, qtype: str, *, tied: bool = True,
                         types: dict[str, str] | None = None, seed: int = 0) -> str:
    """A 2-layer llama GGUF at ``path``: every matrix (embedding, q/k/v/o, gate/up/down,
    the output head when not ``tied``) as ``qtype`` blocks, except the tensors named in
    ``types`` (GGUF name suffix such as ``"attn_v"`` -> type name); norms F32."""
    rng = rng_for("tiny-gguf", qtype, tied, sorted((types or {}).items()), seed)
    w = GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)

    def matrix(gname: str, rows: int, cols: int) -> None:
        kind = gname.split(".")[-2]
        name = (types or {}).get(kind, qtype)
        w.add_tensor(gname, _blocks(name, rows, cols, rng), raw_dtype=GQ[name])

    def norm(gname: str) -> None:
        w.add_tensor(gname, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", INTER, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, INTER)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
