"""One decoder for every supported architecture (``hf_config.SUPPORTED_ARCHITECTURES``).

Laid out for inference: q/k/v are one fused Linear (split after), gate/up another, the
attention goes through the paged KV cache via a pluggable kernel backend. The variants
differ only in switches read from :class:`~deepinfer.config.ModelConfig`: attention
biases, per-head q/k RMSNorm before RoPE (Qwen3, Gemma 3, Exaone 4) or over the whole
projection (OLMoE, OLMo 2; qkv clipping), RoPE scaling and its layers, tied embeddings,
Granite's and Gemma's scalars, norms after (:mod:`.gemma`), and which layers have a
sparse MoE block (:mod:`deepinfer.models.moe`) instead of the dense MLP.

Module names mirror the HF checkpoint names (``model.layers.N.self_attn.o_proj``...), so
weight loading only has to handle the fused projections.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.gemma_config import GEMMA_ARCHITECTURES
from deepinfer.models import gemma
from deepinfer.models.attention import AttentionMetadata
from deepinfer.models.backend import ModelBackend
from deepinfer.models.decoder_stack import DecoderStackBinding
from deepinfer.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, add_norm
from deepinfer.models.llama_attention import LlamaAttention
from deepinfer.models.moe import (
    SparseMoeBlock,
    canonical_moe_name,
    expert_stack,
    expert_weight_keys,
    is_absent_shared_expert_tensor,
    is_expert_tensor,
    load_expert_tensor,
)
from deepinfer.models.parallel_layers import (
    Linear,
    VocabParallelEmbedding,
)
from deepinfer.models.quantized import keep_quantized, keep_quantized_parts, part_blocks
from deepinfer.models.tensor_parallel import SINGLE, TPGroup, local_sizes


@functools.cache
def _rounded_to(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (once per pair: the forward asks every step)."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``mlp`` is the
    dense gated MLP or, on the config's sparse layers, a :class:`SparseMoeBlock`.

    The residual stream is carried beside the block's output so that each add is fused
    into the norm after it (``backend.add_rms_norm``): the same sums in the same dtype,
    one kernel instead of nine."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp, layer)
        self.mlp: nn.Module = (
            SparseMoeBlock(cfg, tp) if cfg.is_moe_layer(layer)
            else GatedMLP(cfg.hidden_size, local_sizes(cfg, tp).intermediate_size, tp,
                          act=cfg.hidden_act))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1.0 elsewhere
        # Gemma's block, and OLMo 2's (norms after only): deepinfer.models.gemma
        self.sandwich, self.post_norms = cfg.sandwich_norms, cfg.post_norms
        gemma.add_sandwich_norms(self, cfg)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None, layer_cache: torch.Tensor,
                meta: AttentionMetadata,
                backend: ModelBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, hidden]``: the previous block's output (the embeddings for the first
        layer, with ``residual`` None), residual ``[T, hidden]``: the stream before it.
        Returns ``(mlp output, residual)``; the stream after this layer is their sum
        (each block's output scaled by ``residual_multiplier`` first, where not 1)."""
        if self.sandwich or self.post_norms:
            block = gemma.sandwich_forward if self.sandwich else gemma.post_norm_forward
            return block(self, rope, x, residual, layer_cache, meta, backend)
        h, residual = add_norm(self.input_layernorm, x, residual, backend)
        a = self.self_attn(rope, h, layer_cache, meta, backend)
        r = self.residual_multiplier
        if r != 1.0:
            a = a * r
        norm = self.post_attention_layernorm
        h, residual = backend.add_rms_norm(a, residual, norm.weight, norm.eps)
        out = self.mlp(h, backend)
        return (out if r == 1.0 else out * r), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's ``model.*`` submodule)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        sizes = local_sizes(cfg, tp)
        self.embed_tokens = VocabParallelEmbedding(sizes.vocab_size, cfg.hidden_size,
                                                   sizes.vocab_start, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The full causal LM: ``forward`` gives final hidden states, ``compute_logits`` the
    vocabulary scores of the rows the caller selects (usually one per sequence).

    ``tp``: this rank's TP group; the layers then hold this rank's shard
    (:mod:`deepinfer.models.tensor_parallel`), ``forward`` must run on every rank of the
    group with the same inputs, and ``compute_logits`` returns the whole vocabulary on
    the group's leader only."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, tp)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, local_sizes(cfg, tp).vocab_size, bias=False)
        # Explicit device: the loader builds the layers on "meta", the cache must be real.
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling,
            cfg.rope_freq_factors, dtype=dtype, device=device, rotary_dim=cfg.rotary_dim)
        # Gemma 3's sliding layers rotate with their own base.
        self.rotary_local = None if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_positions, cfg.local_rope_theta, None, None, dtype=dtype,
            device=device)
        # A backend's fused decode step over all the layers, where it has one.
        self.decoder_stack = DecoderStackBinding()
        # Set per step by deepinfer.lora: the step's tokens get adapter deltas, which the
        # fused decode step (it reads the base weights only) does not add.
        self.lora_active = False

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the hidden states (a layer's weight may be GGUF blocks, uint8)."""
        return self.model.norm.weight.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[vocab, hidden]``: the embedding matrix when the embeddings are tied."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: ModelBackend) -> torch.Tensor:
        """One step over ``T`` packed tokens.

        Args:
            input_ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 absolute positions (indexes the RoPE cache).
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
                in the model dtype; this step's K/V are written into it.
            meta: the step's :class:`AttentionMetadata`.
            backend: the kernel ops (a ``ModelBackend``: ``deepinfer_kernels``,
                its ``cpu_backend`` or its torch ``reference``).

        Returns:
            ``[T, hidden_size]`` final-normed hidden states, model dtype.
        """
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self._embedding_scale(x.dtype)
        if not meta.is_prompt and not self.lora_active:
            hidden = self.decoder_stack.run(self, backend, x, positions, kv_cache,
                                            meta.slot_mapping, meta.block_tables,
                                            meta.seq_lens)
            if hidden is not None:
                return hidden
        rope = (self.rotary.cos_sin_cache, positions)
        local = rope if self.rotary_local is None else (self.rotary_local.cos_sin_cache,
                                                         positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            r = rope if layer.self_attn.attn.window is None else local
            x, residual = layer(r, x, residual, kv_cache[i], meta, backend)
        norm = self.model.norm
        if residual is None:  # no layers
            return backend.rms_norm(x, norm.weight, norm.eps)
        return backend.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def _embedding_scale(self, dtype: torch.dtype) -> float:
        """``embedding_multiplier``; Gemma's rounded to the activations' dtype first, as
        transformers stores it."""
        mult = self.config.embedding_multiplier
        if self.config.architecture in GEMMA_ARCHITECTURES:
            return _rounded_to(mult, dtype)
        return mult

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, hidden_size]`` -> this rank's block of the vocabulary's logits
        ``[N, vocab_size / tp]`` (rows ``tp.rank * vocab_size / tp`` on), hidden's dtype
        (divided by ``logits_scaling`` where not 1; Gemma 2's soft cap applied)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = self.model.embed_tokens.attend(hidden)
        scaling, cap = self.config.logits_scaling, self.config.final_logit_softcapping
        logits = logits if scaling == 1.0 else logits / scaling
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden ``[N, hidden_size]`` -> logits ``[N, vocab_size]`` float32 (None on a
        TP rank other than the leader: the vocabulary shards are gathered there)."""
        logits = self.tp.gather_to_leader(self.shard_logits(hidden))
        return None if logits is None else logits.float()

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     adopt: bool = False) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the parameter names
        that were written. Unknown names raise ``ValueError`` naming the tensor.

        ``adopt``: the tensors own their memory (dequantized GGUF weights), so one that
        fits a parameter exactly becomes it instead of being copied. Never for tensors
        over a memory-mapped file: adopting one keeps the whole file mapped (and every
        page read from it resident) for the model's life."""
        self.decoder_stack.reset()
        params = dict(self.named_parameters())
        mixed = {f"{n}.weight": m for n, m in self.named_modules()
                 if isinstance(m, Linear) and m.block_parts is not None}
        loaded: set[str] = set()
        stored_head = None
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, not a weight
            if name == "lm_head.weight" and self.lm_head is None:
                stored_head = tensor  # tied: usually a copy of the embedding (checked below)
                continue
            name = canonical_moe_name(name)
            if is_absent_shared_expert_tensor(name, tensor, self.config, params):
                continue
            if is_expert_tensor(name):
                loaded.update(load_expert_tensor(params, name, tensor, self.tp))
                continue
            target, offset, rows = self.fused_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{self.config.architecture}")
            # A fused part has the config's rows: a tensor with more (or fewer) is an
            # error, not a neighbour's rows overwritten (or left empty).
            if target in mixed:  # blocks of its own type in a flat weight
                dst = part_blocks(mixed[target], offset)
            else:
                dst = param.data if offset is None else param.data.narrow(0, offset, rows)
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            if (adopt and offset is None and tensor.dtype == dst.dtype
                    and tensor.device == dst.device and tensor.is_contiguous()
                    and tensor.untyped_storage().nbytes() == dst.numel() * dst.element_size()):
                # Copying would touch every page twice, a second of the default model's
                # start-up.
                param.data = tensor
            else:
                dst.copy_(tensor)
            loaded.add(target if offset is None else f"{target}#{offset}")
        if stored_head is not None and self._untie_if_different(stored_head):
            loaded.add("lm_head.weight")
        if self.config.norm_weight_offset:
            gemma.fold_norm_offsets(self)
        return loaded

    def _untie_if_different(self, head: torch.Tensor) -> bool:
        """A tied config whose checkpoint also stores an ``lm_head.weight`` that is not
        the embedding: transformers then unties them and uses the stored head; so do
        we (this rank's vocabulary shard decides for itself: where they are equal, the
        logits are the same either way). Returns whether it untied them."""
        emb = self.model.embed_tokens.weight
        if tuple(head.shape) != tuple(emb.shape):
            raise ValueError(f"checkpoint tensor 'lm_head.weight': shape {tuple(head.shape)}, "
                             f"expected {tuple(emb.shape)}")
        if torch.equal(head.to(device=emb.device, dtype=emb.dtype), emb):
            return False
        warnings.warn("tie_word_embeddings is set but the checkpoint's lm_head.weight "
                      "differs from the embedding: using it untied, as transformers does",
                      stacklevel=2)
        self.lm_head = Linear(emb.shape[1], emb.shape[0], bias=False,
                              device=emb.device, dtype=emb.dtype).requires_grad_(False)
        self.lm_head.weight.copy_(head)
        return True

    def keep_quantized(self, plan: dict[str, int]) -> set[str]:
        """Make the layers of the checkpoint weights named in ``plan`` (HF name -> ggml
        type id) hold GGUF blocks, before they are materialised. A fused layer (q/k/v,
        gate/up) is kept quantized only when all its parts are planned with one type.
        Returns the checkpoint names whose layer now holds blocks. ``ValueError`` naming
        the tensor when a row (or this rank's part of one) is not whole blocks."""
        self.decoder_stack.reset()
        groups: dict[str, list[tuple[str, int]]] = {}
        experts: dict[str, dict[str, int]] = {}  # MoE block -> its experts' names
        for name, qtype in plan.items():
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding's blocks serve both
            stack = expert_stack(canonical_moe_name(name))
            if stack is not None:
                experts.setdefault(stack[0], {})[name] = qtype
                continue
            target = self.fused_target(canonical_moe_name(name))[0]
            groups.setdefault(target, []).append((name, qtype))
        modules = dict(self.named_modules())
        keep: set[str] = set()
        for block, parts in experts.items():
            if isinstance(modules.get(block), SparseMoeBlock):
                keep |= modules[block].keep_quantized(parts)
        for target, parts in groups.items():
            fused = 3 if ".qkv_proj." in target else 2 if ".gate_up_proj." in target else 1
            if len(parts) != fused:
                continue
            module = modules.get(target.rsplit(".", 1)[0])
            if module is None or not target.endswith(".weight"):
                continue
            if len({q for _, q in parts}) == 1:
                keep_quantized(module, parts[0][1], parts[0][0])
            else:  # a fused layer of mixed types: each part its own blocks
                keep_quantized_parts(module, [
                    (*self.fused_target(canonical_moe_name(n))[1:], q, n) for n, q in parts])
            keep.update(name for name, _ in parts)
        return keep

    def checkpoint_name(self, key: str) -> str:
        """A key of :meth:`expected_weight_keys` as a checkpoint names the tensor (the
        fused q/k/v and gate/up parts, stacked experts by index)."""
        name, *parts = key.split("#")
        if not parts:
            return name
        offsets = [int(p) for p in parts]
        if ".qkv_proj." in name:
            q = self.model.layers[0].self_attn.q_size
            proj = "q_proj" if offsets[0] == 0 else "k_proj" if offsets[0] == q else "v_proj"
            return name.replace(".qkv_proj.", f".{proj}.")
        if ".gate_up_proj." in name:
            proj = "gate_proj" if offsets[0] == 0 else "up_proj"
            return name.replace(".gate_up_proj.", f".{proj}.")
        stem, expert = name.rsplit(".", 1)[0], offsets[0]
        if name.endswith(".w13"):
            proj = "gate_proj" if offsets[1] == 0 else "up_proj"
        else:
            proj = "down_proj"
        if self.config.architecture == "MixtralForCausalLM":  # its own module and names
            stem = stem[: -len(".mlp")] + ".block_sparse_moe"
            proj = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
        return f"{stem}.experts.{expert}.{proj}.weight"

    def expected_weight_keys(self) -> set[str]:
        """Keys ``load_weights`` must report for the model to be complete."""
        keys = set()
        a = self.model.layers[0].self_attn if len(self.model.layers) else None
        cfg = self.config
        modules = dict(self.named_modules())
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name and a is not None:
                keys |= {f"{name}#0", f"{name}#{a.q_size}", f"{name}#{a.q_size + a.kv_size}"}
            elif ".gate_up_proj." in name:
                up = modules[name.rsplit(".", 1)[0]].out_features // 2  # a flat weight too
                keys |= {f"{name}#0", f"{name}#{up}"}
            elif name.endswith((".mlp.w13", ".mlp.w2")):
                keys.update(expert_weight_keys(
                    name, cfg.num_experts, local_sizes(cfg, self.tp).moe_intermediate_size))
            else:
                keys.add(name)
        return keys

    def fused_target(self, name: str) -> tuple[str, int | None, int]:
        """HF name (``model.layers.0.self_attn.k_proj.weight``) -> (our parameter name,
        row offset inside a fused parameter or None, that part's number of rows)."""
        a = self.model.layers[0].self_attn if len(self.model.layers) else None
        q, kv = (a.q_size, a.kv_size) if a else (0, 0)
        sizes = local_sizes(self.config, self.tp)
        inter = (sizes.shared_expert_intermediate_size if ".shared_expert." in name
                 else sizes.intermediate_size)
        for proj, fused, offset, rows in (
            ("q_proj", "qkv_proj", 0, q),
            ("k_proj", "qkv_proj", q, kv),
            ("v_proj", "qkv_proj", q + kv, kv),
            ("gate_proj", "gate_up_proj", 0, inter),
            ("up_proj", "gate_up_proj", inter, inter),
        ):
            marker = f".{proj}."
            if marker in name:
                return name.replace(marker, f".{fused}."), offset, rows
        return name, None, 0
