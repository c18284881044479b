"""Tiny GGUF files written from in-memory transformers models, as llama.cpp's converter
writes them (shared by the GGUF model tests and the tensor-parallel tests)."""

from __future__ import annotations

import torch

GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    # Phi-3's fused projections (llama.cpp's ffn_up holds gate then up there)
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
#: Gemma 2's and 3's four norms, as llama.cpp's converter names them.
GGUF_GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}


def expert_tensors(c, i: str, rest: str, t: torch.Tensor,
                    per_expert: bool) -> list[tuple[str, torch.Tensor]]:
    """GGUF tensors of a transformers 5 stacked expert tensor (``gate_up_proj [E, 2I, H]``
    or ``down_proj [E, H, I]``): llama.cpp's ``ffn_*_exps`` stacks, or with ``per_expert``
    the older Mixtral files' ``ffn_*.{e}`` tensors."""
    if rest == "mlp.experts.gate_up_proj":
        inter = t.shape[1] // 2
        parts = [("gate", t[:, :inter]), ("up", t[:, inter:])]
    else:
        parts = [("down", t)]
    if per_expert:
        return [(f"blk.{i}.ffn_{p}.{e}.weight", x[e]) for p, x in parts
                for e in range(x.shape[0])]
    return [(f"blk.{i}.ffn_{p}_exps.weight", x) for p, x in parts]


def write_tiny_gguf(hf_model, arch: str, path: str, per_expert: bool = False,
                     expert_type: str | None = None, linear_type: str | None = None,
                     pooling_type: int | None = None,
                     spm_tokens: list[str] | None = None,
                     float_keys: dict[str, float] | None = None) -> None:
    """What llama.cpp's converter does, in miniature: F32 tensors, llama q/k permuted,
    experts stacked (or one tensor each, ``per_expert``), MoE keys, Phi-3's keys and
    LongRoPE factor tensors; ``expert_type``: the experts quantized to that block type by
    ``gguf`` (a 32-weight type); ``linear_type``: the layers' projections too;
    ``pooling_type``: an embedding model's ``{arch}.pooling_type`` (llama.cpp's enum).
    Gemma 2 / 3 (``gemma2``, ``gemma3``): the norms renamed and stored plus 1, the window
    (and Gemma 2's soft caps), nothing of what llama.cpp hard-codes (the sliding layers'
    RoPE base, their pattern).
    ``spm_tokens``: a sentencepiece vocabulary (``tokenizer.ggml.model`` "llama", as
    Gemma's files have: ids 0-3 pad, eos, bos, unk, then 256 ``<0xNN>`` byte tokens);
    ``float_keys``: more float32 keys, ``{arch}.`` prefixed."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    def add_expert(gname: str, x: torch.Tensor) -> None:
        arr = np.ascontiguousarray(x.numpy())
        if expert_type is None:
            w.add_tensor(gname, arr)
            return
        qtype = GGMLQuantizationType[expert_type]
        w.add_tensor(gname, quantize(arr, qtype), raw_dtype=qtype)

    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    if pooling_type is not None:
        from gguf import PoolingType

        w.add_pooling_type(PoolingType(pooling_type))
    if spm_tokens is not None:
        _add_spm_vocab(w, spm_tokens)
    for key, value in (float_keys or {}).items():
        w.add_float32(f"{arch}.{key}", value)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    if arch in ("gemma2", "gemma3"):
        rope = rope.get("full_attention", rope)
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        if getattr(c, "norm_topk_prob", None) is not None:
            w.add_expert_weights_norm(c.norm_topk_prob)
        if getattr(c, "clip_qkv", None):
            w.add_clamp_kqv(c.clip_qkv)
    if arch == "phi3":  # as llama.cpp's converter writes Phi-3's RoPE and window
        rope = c.rope_parameters
        rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(rot)
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        w.add_sliding_window(c.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            for kind in ("long", "short"):
                w.add_tensor(f"rope_factors_{kind}.weight",
                             np.array(rope[f"{kind}_factor"], dtype=np.float32))
    if arch == "granite":  # as llama.cpp's converter writes Granite's scalars
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if rope.get("rope_type") == "llama3":
        # llama.cpp stores Llama 3.1 scaling as per-frequency divisors, rope_freqs.weight.
        import math

        base, f = rope["rope_theta"], rope["factor"]
        lo, hi = rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        factors = []
        for k in range(0, head_dim, 2):
            wavelen = 2 * math.pi * base ** (k / head_dim)
            if wavelen < old / hi:
                factors.append(1.0)
            elif wavelen > old / lo:
                factors.append(f)
            else:
                s = (old / wavelen - lo) / (hi - lo)
                factors.append(1 / ((1 - s) / f + s))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    for name, t in hf_model.state_dict().items():
        t = t.float()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            if rest.startswith("mlp.experts."):
                for gname, x in expert_tensors(c, i, rest, t, per_expert):
                    add_expert(gname, x)
                continue
            mod, kind = rest.rsplit(".", 1)
            if arch in ("gemma2", "gemma3") and "norm" in mod:
                t = t + 1.0  # llama.cpp stores Gemma's norm factors, not their offsets
            if mod == "mlp.shared_expert_gate":
                t = t.reshape(-1)  # llama.cpp stores it as a vector
            if arch in ("llama", "granite", "smollm3") and mod in (
                    "self_attn.q_proj", "self_attn.k_proj"):
                h = c.num_attention_heads if "q_proj" in mod else c.num_key_value_heads
                t = t.reshape(h, 2, t.shape[0] // h // 2, *t.shape[1:]).transpose(1, 2)
                t = t.reshape(-1, *hf_model.state_dict()[name].shape[1:])
            layer_names = {**GGUF_LAYER, **GGUF_GEMMA_NORMS} if arch.startswith("gemma") \
                or arch == "olmo2" else GGUF_LAYER
            gname = f"blk.{i}.{layer_names[mod]}.{kind}"
            if linear_type is not None and t.dim() == 2:
                qtype = GGMLQuantizationType[linear_type]
                arr = np.ascontiguousarray(t.numpy())
                w.add_tensor(gname, quantize(arr, qtype), raw_dtype=qtype)
                continue
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
            if gname == "output.weight" and c.tie_word_embeddings:
                continue
            if arch.startswith("gemma") and gname == "output_norm.weight":
                t = t + 1.0
        w.add_tensor(gname, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_spm_vocab(w, tokens: list[str]) -> None:
    """A sentencepiece vocabulary's keys as llama.cpp's converter writes them: pieces,
    scores, types (control, unknown, byte, normal), the special ids, BOS added."""
    kinds = [3, 1, 3, 2] + [6] * 256  # pad, eos, bos: control; unk; the byte pieces
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(kinds + [1] * (len(tokens) - len(kinds)))
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
