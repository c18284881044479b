"""What the ahead-of-time compile check compiles: the targets (sm_80, sm_90), the op calls
the engine makes on them (``Case``: op, dtype, head_dim, GQA, block size, variant), one
compiled kernel's result (``KernelResult``: registers, spills, shared memory, tensor cores,
and why it fails the check), and ``plan``: a case's launches through the ops' own
``*_launches`` planners on meta tensors (no GPU, no data). ``deepinfer_compile_grid.check``
compiles them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from deepinfer_kernels.runtime import Launch, Target

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Arch:
    """A compile target and the device facts the launchers would read from it."""

    name: str
    capability: tuple[int, int]
    num_sms: int  # drives the decode split choice (and so the merge kernel's S_PAD)
    max_shared: int  # bytes per block, opt-in (cudaDevAttrMaxSharedMemoryPerBlockOptin)

    def target(self) -> Target:
        return Target(self.capability, self.num_sms, interpret=False)


ARCHS = {
    "sm_90": Arch("sm_90", (9, 0), 132, 232_448),  # H100 SXM / H200: 227 KB
    "sm_80": Arch("sm_80", (8, 0), 108, 166_912),  # A100: 163 KB
}

# Engine-like shapes: 8 KV heads (Qwen3-0.6B, Llama-3-8B), q heads = 8 * GQA.
NUM_KV_HEADS = 8


@dataclass(frozen=True)
class Case:
    """One op call the engine makes, on one target.

    op: ``decode`` (unsplit: a large batch already fills the GPU), ``decode_split`` (one
    long sequence: split-KV + merge), ``prefill`` (each with variant ``kv8``: an int8
    cache, or ``cap``: Gemma 2's soft-capped scores, the kernels' ``SOFTCAP`` build),
    ``store_kv`` (variant ``t1``: one token, ``batch``: a decode batch),
    ``clone_blocks``, ``zero_states``, ``clone_states``;
    mixture of experts (variant ``<model>-m<tokens>``, model a key of ``MOE_SHAPES``):
    ``moe_gemm`` (the layer's two grouped GEMMs: gate+up with SiLU-and-mul, down),
    ``moe_align`` (its three alignment kernels), ``moe_route``; ``moe_gguf`` (the two
    grouped GEMMs with the experts as GGUF blocks, variant ``<model>-<type>-m<tokens>``).
    head_dim, gqa and block_size do not apply to them (and are left out of their ids).

    The decoder layer's elementwise ops (no tensor cores; ids name what sets their tile):
    ``rms_norm`` and ``add_rms_norm`` (the norm fused with the residual add before it),
    variant ``h<hidden>-t<tokens>`` (id ``rms_norm-sm_90-bf16-h4096-t256``);
    ``silu_and_mul``, variant ``i<intermediate>-t<tokens>``; ``rotary_qk`` on head_dim
    with ``NUM_KV_HEADS * gqa`` q heads, variant ``norm`` (Qwen3's per-head q/k norm fused
    in) or ``rope`` (id ``rotary_qk-sm_90-bf16-d128-hq16-hkv8-norm``). gqa and block_size
    do not apply to the first three, nor head_dim (all left out of their ids).

    The sampler's fused temperature sampling (no tensor cores): ``sample_tokens``, variant
    ``v<vocab>-n<rows>``, dtype the logits' (id ``sample_tokens-sm_90-fp32-v151936-n256``);
    head_dim, gqa and block_size do not apply (left out of its id).

    Matmuls on GGUF-quantized weights (``gguf_matmul``): ``gguf_gemv`` (M <= 16, FMAs)
    and ``gguf_gemm`` (tensor cores), variant ``<type>-m<rows of x>`` on an
    ``N = K = 4096`` weight (id ``gguf_gemv-sm_90-bf16-q4_k-m1``); head_dim, gqa and
    block_size do not apply (left out of their ids).
    """

    op: str
    arch: str
    dtype: str
    head_dim: int = 128
    gqa: int = 1
    block_size: int = 16
    variant: str = ""

    @property
    def id(self) -> str:
        if (self.op.startswith("moe_") or self.op in _ROW_OPS or self.op in SAMPLING_OPS
                or self.op in GGUF_OPS):
            return f"{self.op}-{self.arch}-{self.dtype}-{self.variant}"
        if self.op == "rotary_qk":
            return (f"{self.op}-{self.arch}-{self.dtype}-d{self.head_dim}"
                    f"-hq{NUM_KV_HEADS * self.gqa}-hkv{NUM_KV_HEADS}-{self.variant}")
        parts = [self.op, self.arch, self.dtype, f"d{self.head_dim}", f"gqa{self.gqa}",
                 f"bs{self.block_size}"]
        return "-".join(parts + ([self.variant] if self.variant else []))

    @property
    def must_not_spill(self) -> bool:
        """What the engine serves: 16-bit everywhere, fp32 on sm_90 (fp32 on sm_80 is only
        compiled and reported)."""
        return self.dtype != "fp32" or self.arch == "sm_90"

    @property
    def wants_tensor_cores(self) -> bool:
        """16-bit attention and GEMMs must keep their ``tl.dot``s on the tensor cores."""
        return (self.op in ("decode", "decode_split", "prefill", "moe_gemm", "gguf_gemm",
                            "moe_gguf")
                and self.dtype != "fp32")


@dataclass
class KernelResult:
    """One compiled kernel of a case (decode_split gives two: the split kernel, the merge)."""

    case: str
    kernel: str
    config: str
    regs: int = -1
    stack: int = -1  # ptxas stack frame bytes per thread: spilled registers here
    local: int = -1
    shared: int = -1  # dynamic (Triton) + static bytes per block
    tensor_cores: bool = False
    error: str = ""
    seconds: float = 0.0

    def problems(self, case: Case, arch: Arch) -> list[str]:
        """Why this result fails the check (empty: it passes)."""
        if self.error:
            return [f"{self.kernel}: compile error: {self.error}"]
        out = []
        if self.shared > arch.max_shared:
            out.append(f"{self.kernel}: {self.shared} B shared memory > {arch.max_shared} B "
                       f"on {arch.name}")
        if case.must_not_spill and (self.stack > 0 or self.local > 0):
            out.append(f"{self.kernel}: spills on {arch.name} ({self.regs} registers, "
                       f"{self.stack} B stack, {self.local} B local) with {self.config}")
        if case.wants_tensor_cores and self.kernel != "_merge_kernel" and not self.tensor_cores:
            out.append(f"{self.kernel}: no tensor-core mma in the PTX ({self.config})")
        return out


# --- cases -----------------------------------------------------------------------------

# Row-wise elementwise ops of the decoder layer: one (variant-named) shape per case.
_ROW_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul")
LAYER_OPS = (*_ROW_OPS, "rotary_qk")
SAMPLING_OPS = ("sample_tokens",)

_ATTN_OPS = ("decode", "decode_split", "prefill")

# (experts, top_k, hidden, intermediate) of the MoE models the issue targets.
MOE_SHAPES = {
    "qwen3": (128, 8, 2048, 768),  # Qwen3-30B-A3B
    "mixtral": (8, 2, 4096, 14336),  # Mixtral-8x7B
}
# Token counts that reach each BLOCK_M bucket of deepinfer_kernels.moe_gemm.moe_block_m
# (16 / 32 / 64 / 128: decode, small, medium, prefill).
MOE_TOKENS = {"qwen3": (1, 512, 1024, 4096), "mixtral": (1, 128, 256, 4096)}


def moe_cases(archs: Iterable[str] = ARCHS) -> list[Case]:
    """Every MoE tile configuration: the GEMM pair per model x BLOCK_M bucket x dtype,
    alignment per model at decode and prefill sizes, routing per model x logits dtype."""
    cases = []
    for arch in archs:
        for model, tokens in MOE_TOKENS.items():
            for m, dt in itertools.product(tokens, DTYPES):
                cases.append(Case("moe_gemm", arch, dt, variant=f"{model}-m{m}"))
            for m in (tokens[0], tokens[-1]):
                cases.append(Case("moe_align", arch, "fp32", variant=f"{model}-m{m}"))
            for dt in ("bf16", "fp32"):
                cases.append(Case("moe_route", arch, dt, variant=f"{model}-m{tokens[-1]}"))
            # GGUF experts: every type at the decode and prefill tiles in bf16, and one
            # type through every BLOCK_M bucket x dtype.
            gguf = {(t, m, "bf16") for t in GGUF_TYPES for m in (tokens[0], tokens[-1])}
            gguf |= {("Q4_K", m, dt) for m, dt in itertools.product(tokens, DTYPES)}
            for t, m, dt in sorted(gguf):
                cases.append(Case("moe_gguf", arch, dt, variant=f"{model}-{t.lower()}-m{m}"))
    return cases


def full_cases(archs: Iterable[str] = ARCHS) -> list[Case]:
    """The whole grid: head_dim 64/128/256 x GQA 1/4/8 x block size 16/32 x bf16/fp16/fp32
    for decode (unsplit and split) and prefill, plus the engine's other block sizes (8, 64)
    at GQA 4; store_kv and the copy ops per dtype; the MoE cases (``moe_cases``), the
    decoder layer's elementwise ops (``layer_cases``) and the sampler's kernel
    (``sampling_cases``) and the GGUF matmuls (``gguf_cases``)."""
    shapes = [(gqa, bs) for gqa in (1, 4, 8) for bs in (16, 32)] + [(4, 8), (4, 64)]
    cases = []
    for arch in archs:
        for op, d, (gqa, bs), dt in itertools.product(
                _ATTN_OPS, (64, 128, 256), shapes, DTYPES):
            cases.append(Case(op, arch, dt, d, gqa, bs))
        # The int8 cache: each attention op and head_dim in both 16-bit dtypes and fp32.
        for op, d, dt in itertools.product(_ATTN_OPS, (64, 128, 256), DTYPES):
            cases.append(Case(op, arch, dt, d, 4, 16, "kv8"))
        # Soft-capped scores (the SOFTCAP build): Gemma 2's GQA 2, each head_dim and dtype.
        for op, d, dt in itertools.product(_ATTN_OPS, (64, 128, 256), DTYPES):
            cases.append(Case(op, arch, dt, d, 2, 16, "cap"))
        for d, bs, dt, variant in itertools.product((64, 128, 256), (16, 32), DTYPES,
                                                    ("t1", "batch", "kv8")):
            cases.append(Case("store_kv", arch, dt, d, 1, bs, variant))
        for dt in DTYPES:
            cases.append(Case("clone_blocks", arch, dt, 128, 1, 16, "int64"))
        for op, variant in itertools.product(("zero_states", "clone_states"),
                                             ("int64", "int32")):
            cases.append(Case(op, arch, "fp32", 128, 1, 16, variant))
    return (cases + moe_cases(archs) + layer_cases(archs) + sampling_cases(archs)
            + gguf_cases(archs))


# Decoder-layer shapes: one sequence's decode token (a row count of 1 is specialized by
# the compiler, and silu_and_mul plans a one-row tile for it), a decode batch and a
# prefill chunk of tokens (these two plan the same tiles today);
# hidden sizes of Qwen3-0.6B (1024), Qwen3-1.7B (2048), Llama-3-8B / Mixtral / Qwen3-8B
# (4096) and larger models (8192); MLP widths of Qwen3-0.6B (3072) and Llama-3-8B /
# Mixtral (14336).
LAYER_TOKENS = (1, 256, 8192)
LAYER_HIDDEN = (1024, 2048, 4096, 8192)
LAYER_INTERMEDIATE = (3072, 14336)


def layer_cases(archs: Iterable[str] = ARCHS) -> list[Case]:
    """The decoder layer's elementwise ops: RMSNorm alone and with the residual add per
    hidden size x tokens, SiLU-and-mul per MLP width x tokens, rotary per head_dim
    (64/128/256) x q heads (16, 32 with 8 KV heads) x with/without the q/k norm; each in
    bf16/fp16/fp32."""
    cases = []
    for arch, dt in itertools.product(archs, DTYPES):
        for op, h, t in itertools.product(("rms_norm", "add_rms_norm"), LAYER_HIDDEN,
                                          LAYER_TOKENS):
            cases.append(Case(op, arch, dt, variant=f"h{h}-t{t}"))
        for i, t in itertools.product(LAYER_INTERMEDIATE, LAYER_TOKENS):
            cases.append(Case("silu_and_mul", arch, dt, variant=f"i{i}-t{t}"))
        for d, gqa, variant in itertools.product((64, 128, 256), (2, 4), ("rope", "norm")):
            cases.append(Case("rotary_qk", arch, dt, d, gqa, variant=variant))
    return cases


# Vocabularies of Qwen2.5/Qwen3 (151,936), SmolLM2 (49,152) and Llama 3 (128,256): the
# sampler's logits rows; a decode batch of 256 rows.
SAMPLING_VOCABS = (151_936, 49_152, 128_256)
SAMPLING_ROWS = 256


def sampling_cases(archs: Iterable[str] = ARCHS) -> list[Case]:
    """The sampler's ``sample_tokens`` per vocabulary x logits dtype (fp32: what the
    sampler passes today; bf16: a model's own logits, should it pass them uncast)."""
    return [Case("sample_tokens", arch, dt, variant=f"v{v}-n{SAMPLING_ROWS}")
            for arch, v, dt in itertools.product(archs, SAMPLING_VOCABS, ("fp32", "bf16"))]


# Matmuls on GGUF blocks: every block type on a 4096 x 4096 weight (a Llama-3-8B /
# Qwen3-8B attention projection). Rows of x that reach each tile of
# deepinfer_kernels.gguf_matmul: the GEMV's BLOCK_M 1 / 2 / 4 / 8 / 16 (decode batches),
# the GEMM's BLOCK_M 32 / 64 / 128 (prefill).
GGUF_OPS = ("gguf_gemv", "gguf_gemm")
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
GGUF_ROWS = {"gguf_gemv": (1, 2, 4, 8, 16), "gguf_gemm": (32, 64, 256)}
GGUF_SHAPE = (4096, 4096)  # (N, K)


def gguf_cases(archs: Iterable[str] = ARCHS) -> list[Case]:
    """Both GGUF matmul kernels for every block type x tile (rows of x) x bf16/fp16/fp32
    on each target."""
    return [Case(op, arch, dt, variant=f"{qtype.lower()}-m{m}")
            for arch, op, qtype in itertools.product(archs, GGUF_OPS, GGUF_TYPES)
            for m, dt in itertools.product(GGUF_ROWS[op], DTYPES)]


def quick_cases(archs: Iterable[str] = ARCHS) -> list[Case]:
    """A representative subset for ``make test`` (about a minute on 2 cores, cold cache).

    Every tile configuration the launchers choose on each target: prefill (the kernel that
    spilled) at every head_dim x dtype, decode at every head_dim for 16-bit and fp32 (its
    tile depends on row bytes), split and unsplit; store_kv for one token and for a batch;
    the copy kernel; the MoE tiles; each decoder-layer elementwise op once; the sampler's
    kernel once; both GGUF matmul kernels, each for a K-quant and a 32-weight type. GQA,
    block size and fp16/bf16 rotate across the cases (the full grid covers every
    combination).
    """
    shapes = itertools.cycle([(4, 16), (8, 32), (1, 16), (4, 32)])
    cases = []
    for arch in archs:
        for d, dt in itertools.product((64, 128, 256), DTYPES):
            gqa, bs = next(shapes)
            cases.append(Case("prefill", arch, dt, d, gqa, bs))
        # Every decode tile (16-bit and fp32 at each head_dim), split and unsplit.
        for d, (op, dt) in zip((64, 128, 256, 64, 128, 256),
                               [("decode", "bf16"), ("decode_split", "fp16"),
                                ("decode_split", "bf16"), ("decode_split", "fp32"),
                                ("decode", "fp32"), ("decode", "fp32")]):
            gqa, bs = next(shapes)
            cases.append(Case(op, arch, dt, d, gqa, bs))
        cases.append(Case("store_kv", arch, "bf16", 128, 1, 16, "t1"))
        cases.append(Case("store_kv", arch, "fp32", 64, 1, 32, "batch"))
        # The int8 KV cache: its store, and each attention kernel dequantizing its rows.
        cases.append(Case("store_kv", arch, "bf16", 128, 1, 16, "kv8"))
        cases.append(Case("decode", arch, "bf16", 128, 4, 16, "kv8"))
        cases.append(Case("decode_split", arch, "fp16", 64, 8, 32, "kv8"))
        cases.append(Case("prefill", arch, "bf16", 128, 4, 16, "kv8"))
        # Soft-capped scores at Gemma 2's head_dim 256 (the tightest 16-bit tiles).
        cases.append(Case("prefill", arch, "bf16", 256, 2, 16, "cap"))
        cases.append(Case("decode_split", arch, "bf16", 256, 2, 16, "cap"))
        cases.append(Case("clone_blocks", arch, "bf16", 128, 1, 16, "int64"))
        cases.append(Case("zero_states", arch, "fp32", 128, 1, 16, "int64"))
        # MoE: the decode GEMM tile (BLOCK_M 16) and the prefill one (128, 8 warps) on each
        # target; alignment and routing once (their tiles do not depend on the target).
        cases.append(Case("moe_gemm", arch, "bf16", variant="qwen3-m1"))  # N tiles of 32
        cases.append(Case("moe_gemm", arch, "bf16", variant="mixtral-m1"))  # 64 and 32
        cases.append(Case("moe_gemm", arch, "fp16", variant="mixtral-m4096"))
        cases.append(Case("moe_gguf", arch, "bf16", variant="qwen3-q4_k-m1"))
        cases.append(Case("moe_gguf", arch, "fp16", variant="mixtral-q6_k-m4096"))
        if arch == "sm_90":
            cases.append(Case("moe_align", arch, "fp32", variant="qwen3-m4096"))
            cases.append(Case("moe_route", arch, "bf16", variant="qwen3-m4096"))
        # Decoder-layer elementwise ops, one each: the fused add + norm of a decode batch,
        # the widest norm row (16 warps) in fp32, Qwen3's norm + rotary, the MLP activation.
        cases.append(Case("add_rms_norm", arch, "bf16", variant="h4096-t256"))
        cases.append(Case("rms_norm", arch, "fp32", variant="h8192-t8192"))
        cases.append(Case("rotary_qk", arch, "bf16", 128, 2, variant="norm"))
        cases.append(Case("silu_and_mul", arch, "bf16", variant="i3072-t256"))
        # The sampler's kernel on Qwen's vocabulary (fp32 logits, as the sampler passes).
        cases.append(Case("sample_tokens", arch, "fp32",
                          variant=f"v151936-n{SAMPLING_ROWS}"))
        # GGUF matmuls: the decode GEMV and the prefill GEMM, a K-quant and a 32-weight
        # type each (the two decoders), both 16-bit dtypes.
        cases.append(Case("gguf_gemv", arch, "bf16", variant="q4_k-m1"))
        cases.append(Case("gguf_gemv", arch, "fp16", variant="q5_1-m16"))
        cases.append(Case("gguf_gemm", arch, "fp16", variant="q6_k-m256"))
        cases.append(Case("gguf_gemm", arch, "bf16", variant="q8_0-m64"))
    return cases


def spill_canary(arch: str = "sm_90") -> Case:
    """A configuration known to spill (the pre-fix fp32 prefill tile), to prove that the
    check sees spills: planned with ``variant="canary"``."""
    return Case("prefill", arch, "fp32", 64, 4, 16, "canary")


# --- planning (meta tensors; no GPU, no data) ---------------------------------------------

def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def plan(case: Case) -> list[Launch]:
    """The launches the engine's call for ``case`` makes, via the ops' own planners."""
    from deepinfer_kernels.cache_ops import clone_blocks_launches, state_launches
    from deepinfer_kernels.decode_attention import decode_launches
    from deepinfer_kernels.kv_quant import kv_row_width
    from deepinfer_kernels.prefill_attention import prefill_kernel, prefill_launches
    from deepinfer_kernels.store_kv import store_kv_launches

    if case.op.startswith("moe_"):
        return _plan_moe(case)
    if case.op in LAYER_OPS:
        return _plan_layer(case)
    if case.op in SAMPLING_OPS:
        return _plan_sampling(case)
    if case.op in GGUF_OPS:
        return _plan_gguf(case)

    target = ARCHS[case.arch].target()
    dtype = DTYPES[case.dtype]
    d, bs, hkv = case.head_dim, case.block_size, NUM_KV_HEADS
    hq = hkv * case.gqa
    scale = d**-0.5
    i32 = torch.int32
    kv8 = case.variant == "kv8"
    softcap = 50.0 if case.variant == "cap" else None  # Gemma 2's attention cap
    row, cache_dtype = (kv_row_width(d, "int8"), torch.int8) if kv8 else (d, dtype)

    if case.op in ("decode", "decode_split"):
        # Unsplit: 256 sequences of up to 4K tokens (256 * 8 programs cover every SM).
        # Split: one 32K-token sequence, so the split heuristic picks many splits.
        batch, context = (256, 4096) if case.op == "decode" else (1, 32768)
        cache = _meta(batch * context // bs + 1, bs, hkv, row, dtype=cache_dtype)
        q = _meta(batch, hq, d, dtype=dtype)
        launches = decode_launches(
            q, cache, cache, _meta(batch, context // bs, dtype=i32), _meta(batch, dtype=i32),
            torch.empty_like(q), scale, None, context, target, softcap=softcap)
        want_split = case.op == "decode_split"
        if (len(launches) > 1) != want_split:
            raise AssertionError(f"{case.id}: the split heuristic chose {len(launches)} "
                                 "launch(es); the case no longer covers what it names")
        return launches
    if case.op == "prefill":
        # 4 prompts of 1K new tokens after a cached prefix, packed.
        seqs, new, context = 4, 1024, 2048
        cache = _meta(seqs * context // bs + 1, bs, hkv, row, dtype=cache_dtype)
        q = _meta(seqs * new, hq, d, dtype=dtype)
        launches = prefill_launches(
            q, cache, cache, _meta(seqs, context // bs, dtype=i32), _meta(seqs + 1, dtype=i32),
            _meta(seqs, dtype=i32), torch.empty_like(q), scale, new, target,
            softcap=softcap)
        if case.variant == "canary":
            # The fp32 d=64 tile used before the per-target table: 560 B stack on sm_90.
            (launch,) = launches
            launch.kwargs.update(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3)
            assert launch.kernel is prefill_kernel
        return launches
    if case.op == "store_kv":
        tokens = 1 if case.variant == "t1" else 256
        k = _meta(tokens, hkv, d, dtype=dtype)
        cache = _meta(4096, bs, hkv, row, dtype=cache_dtype)
        return store_kv_launches(k, torch.empty_like(k), cache, cache,
                                 _meta(tokens, dtype=torch.int64), target)
    index_dtype = getattr(torch, case.variant or "int64")
    if case.op == "clone_blocks":
        kv = _meta(28, 2, 4096, bs, hkv, d, dtype=dtype)  # [layers, K/V, blocks, bs, Hkv, D]
        return clone_blocks_launches(kv, _meta(64, 2, dtype=index_dtype), target)
    if case.op in ("zero_states", "clone_states"):
        # The sampler's per-slot state: token counts (int32) and a seen-token mask (bool)
        # over a 151,936-token vocabulary.
        states = [_meta(256, 151_936, dtype=torch.int32), _meta(256, 151_936, dtype=torch.bool)]
        idx = (_meta(8, dtype=index_dtype) if case.op == "zero_states"
               else _meta(8, 2, dtype=index_dtype))
        return state_launches(states, idx, case.op == "zero_states", target)
    raise ValueError(f"unknown op {case.op!r}")


def _plan_moe(case: Case) -> list[Launch]:
    """A MoE layer call of ``case.variant`` (``<model>-m<tokens>``) via the ops' planners."""
    from deepinfer_kernels.fused_moe import fused_moe_launches
    from deepinfer_kernels.moe_routing import route_launches

    target = ARCHS[case.arch].target()
    dtype = DTYPES[case.dtype]
    if case.op == "moe_gguf":
        return _plan_moe_gguf(case, target, dtype)
    model, tokens = case.variant.split("-m")
    experts, top_k, hidden, inter = MOE_SHAPES[model]
    t = int(tokens)
    if case.op == "moe_route":
        return route_launches(_meta(t, experts, dtype=dtype), top_k, True,
                              _meta(t, top_k, dtype=torch.float32),
                              _meta(t, top_k, dtype=torch.int32), target)
    x = _meta(t, hidden, dtype=dtype)
    launches = fused_moe_launches(
        x, _meta(experts, 2 * inter, hidden, dtype=dtype), _meta(experts, hidden, inter,
                                                                 dtype=dtype),
        _meta(t, top_k, dtype=torch.float32), _meta(t, top_k, dtype=torch.int32),
        _meta(t * top_k, hidden, dtype=dtype), target)
    # fused_moe_launches: three alignment launches, then the two GEMMs.
    return launches[:3] if case.op == "moe_align" else launches[3:]


def _plan_moe_gguf(case: Case, target: Target, dtype: torch.dtype) -> list[Launch]:
    """The two grouped GEMMs of ``fused_moe_gguf`` for ``<model>-<type>-m<tokens>``,
    both weights of that type."""
    from deepinfer_kernels.fused_moe_gguf import fused_moe_gguf_launches
    from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS

    model, qtype, tokens = case.variant.split("-")
    fmt = next(f for f in BLOCK_FORMATS.values() if f.name == qtype.upper())
    experts, top_k, hidden, inter = MOE_SHAPES[model]
    t = int(tokens.removeprefix("m"))
    u8 = torch.uint8
    return fused_moe_gguf_launches(
        _meta(t, hidden, dtype=dtype), _meta(experts, 2 * inter, fmt.row_bytes(hidden), dtype=u8),
        _meta(experts, hidden, fmt.row_bytes(inter), dtype=u8), fmt, fmt,
        _meta(t, top_k, dtype=torch.float32), _meta(t, top_k, dtype=torch.int32),
        _meta(t * top_k, hidden, dtype=dtype), target)[3:]


def _plan_layer(case: Case) -> list[Launch]:
    """A decoder-layer elementwise op's call, as the model makes it, via its planner."""
    from deepinfer_kernels.activation import silu_and_mul_launches
    from deepinfer_kernels.rms_norm import rms_norm_launches
    from deepinfer_kernels.rotary import rotary_qk_launches

    target = ARCHS[case.arch].target()
    dtype = DTYPES[case.dtype]
    if case.op == "rotary_qk":
        # q and k are strided views of the fused qkv projection; a Qwen3 rope cache.
        t, d, hkv = 256, case.head_dim, NUM_KV_HEADS
        hq = hkv * case.gqa
        qkv = _meta(t, (hq + 2 * hkv) * d, dtype=dtype)
        q = qkv[:, :hq * d].unflatten(1, (hq, d))
        k = qkv[:, hq * d:(hq + hkv) * d].unflatten(1, (hkv, d))
        if case.variant not in ("norm", "rope"):
            raise ValueError(f"{case.id}: variant must be 'norm' or 'rope'")
        norm = case.variant == "norm"
        qw, kw = (_meta(d, dtype=dtype), _meta(d, dtype=dtype)) if norm else (None, None)
        return rotary_qk_launches(
            q, k, _meta(40_960, d, dtype=dtype), _meta(t, dtype=torch.int64), qw, kw, 1e-6,
            _meta(t, hq, d, dtype=dtype), _meta(t, hkv, d, dtype=dtype), target)
    width, tokens = case.variant.split("-t")
    t = int(tokens)
    if case.op == "silu_and_mul":
        inter = int(width.removeprefix("i"))
        return silu_and_mul_launches(_meta(t, 2 * inter, dtype=dtype),
                                     _meta(t, inter, dtype=dtype), target)
    h = int(width.removeprefix("h"))
    x = _meta(t, h, dtype=dtype)
    fused = case.op == "add_rms_norm"
    return rms_norm_launches(
        x, torch.empty_like(x) if fused else None, _meta(h, dtype=dtype),
        torch.empty_like(x), torch.empty_like(x) if fused else None, 1e-6, target)


def _plan_sampling(case: Case) -> list[Launch]:
    """The sampler's call for ``case.variant`` (``v<vocab>-n<rows>``) via its planner:
    contiguous ``[rows, vocab]`` logits, fp32 temperatures and uniforms."""
    from deepinfer_kernels.sampling import sample_tokens_launches

    vocab, rows = case.variant.removeprefix("v").split("-n")
    v, n = int(vocab), int(rows)
    f32 = torch.float32
    return sample_tokens_launches(_meta(n, v, dtype=DTYPES[case.dtype]), _meta(n, dtype=f32),
                                  _meta(n, dtype=f32), _meta(n, dtype=torch.int64),
                                  ARCHS[case.arch].target())


def _plan_gguf(case: Case) -> list[Launch]:
    """``gguf_matmul`` of ``case.variant`` (``<type>-m<rows>``) on a ``GGUF_SHAPE`` weight
    via its planner: contiguous x, blocks and out. Refuses a variant whose rows would
    take the other kernel than its op names."""
    from deepinfer_kernels.gguf_blocks import BLOCK_FORMATS
    from deepinfer_kernels.gguf_matmul import GEMV_MAX_M, gguf_matmul_launches

    qtype, rows = case.variant.split("-m")
    fmt = next(f for f in BLOCK_FORMATS.values() if f.name == qtype.upper())
    m, (n, k) = int(rows), GGUF_SHAPE
    if (m <= GEMV_MAX_M) != (case.op == "gguf_gemv"):
        raise ValueError(f"{case.id}: {m} rows of x do not run the {case.op} kernel")
    dtype = DTYPES[case.dtype]
    return gguf_matmul_launches(_meta(m, k, dtype=dtype),
                                _meta(n, fmt.row_bytes(k), dtype=torch.uint8), fmt,
                                _meta(m, n, dtype=dtype), ARCHS[case.arch].target())
