"""kernels.cpu_native: the C paged decode kernel (built here with the system compiler)
against the torch reference, its input checks, and the fallbacks when it cannot be built.

Fresh random data per case; caches are NaN outside the live tokens and spare table columns
point at NaN blocks (make_paged_kv), so a read past a sequence's end shows as NaN; ``out``
is NaN-poisoned before each call.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from deepinfer_kernels import cpu_backend, cpu_native, reference
from tests.kernels.helpers import assert_close, generator, make_paged_kv, randn, seed_for

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the native kernel cannot "
                                                  "be built (the torch path runs instead)")


def _paged_kv(lens, bs, hkv, d, dtype, g, extra_cols=2):
    kv = make_paged_kv(lens, bs, hkv, d, dtype, g, extra_cols=extra_cols)
    kv.k_cache, kv.v_cache = kv.k_cache.cpu(), kv.v_cache.cpu()
    kv.block_tables, kv.seq_lens = kv.block_tables.cpu(), kv.seq_lens.cpu()
    return kv


def _native_vs_reference(q, kv, out=None, threads: int | None = None, **kwargs):
    """The kernel's output (on ``threads`` torch threads when given) and the reference's."""
    out = torch.full_like(q, float("nan")) if out is None else out.fill_(float("nan"))
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        got = cpu_native.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                                kv.seq_lens, out=out, **kwargs)
    finally:
        torch.set_num_threads(before)
    assert got is out
    want = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                            kv.seq_lens, **kwargs)
    return got, want


@needs_cc
def test_library_builds_where_a_compiler_exists():
    assert cpu_native.native_library() is not None


# (q heads, kv heads, head_dim, block_size, dtype, seq_lens)
CASES = [
    pytest.param(4, 2, 16, 16, F32, [141, 1, 16, 17, 33], id="tiny-gqa2-f32"),
    pytest.param(9, 3, 64, 16, F32, [300, 2, 64, 129], id="smollm-gqa3-f32"),
    pytest.param(16, 1, 32, 8, F32, [9, 40, 1], id="mqa16-bs8"),
    pytest.param(8, 8, 128, 64, BF16, [200, 64, 65, 3], id="mha-d128-bs64-bf16"),
    pytest.param(12, 2, 80, 32, BF16, [77, 32, 5], id="gqa6-d80-bs32-bf16"),
    pytest.param(32, 4, 8, 16, F32, [50, 18], id="gqa8-d8"),
    # The wide kernel (head dim 64 / 128, groups 1-8): tokens left over past each 16,
    # blocks of 16 / 32 / 64, both cache dtypes.
    pytest.param(9, 3, 64, 16, BF16, [150, 1, 15, 16, 17, 31, 33], id="wide-gqa3-d64-bf16"),
    pytest.param(16, 4, 128, 16, BF16, [70, 5, 48], id="wide-gqa4-d128-bf16"),
    pytest.param(16, 2, 64, 32, F32, [97, 32, 2], id="wide-gqa8-d64-bs32-f32"),
    pytest.param(14, 7, 128, 64, F32, [130, 63, 1], id="wide-gqa2-d128-bs64-f32"),
    pytest.param(9, 1, 64, 16, BF16, [40, 7], id="gqa9-d64-general"),  # group > 8
]


@needs_cc
@pytest.mark.parametrize("hq, hkv, d, bs, dtype, lens", CASES)
def test_matches_reference(hq, hkv, d, bs, dtype, lens):
    g = generator(seed_for("cpu-native", hq, hkv, d, bs, dtype, lens))
    kv = _paged_kv(lens, bs, hkv, d, dtype, g)
    q = randn((len(lens), hq, d), dtype, g).cpu()
    assert cpu_native.can_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    got, want = _native_vs_reference(q, kv)
    assert_close(got, want, dtype)


# Head dim 256 (every Gemma): the wide kernel's groups 1-8 as at 64 / 128. Lengths
# around 16 and the block size (past each 16 tokens, mid-block), a length 0.
D256_LENS = [150, 0, 1, 15, 16, 17, 33, 70]


@needs_cc
@pytest.mark.parametrize("window, cap", [(None, None), (37, None), (None, 5.0), (21, 0.5)],
                         ids=["plain", "window", "softcap", "window-softcap"])
@pytest.mark.parametrize("hq, hkv, bs, dtype", [
    pytest.param(4, 1, 16, BF16, id="gqa4-bf16"),  # Gemma 3 1B / 270M
    pytest.param(8, 4, 16, F32, id="gqa2-f32"),  # Gemma 2 2B
    pytest.param(3, 3, 32, BF16, id="mha-bs32-bf16"),
    pytest.param(16, 2, 16, F32, id="gqa8-f32"),
    pytest.param(6, 2, 64, BF16, id="gqa3-bs64-bf16")])
def test_head_dim_256_on_the_wide_kernel(hq, hkv, bs, dtype, window, cap):
    lib = cpu_native.native_library()
    takes = lib["paged_decode_wide_takes"]  # a fresh function object: argtypes stay local
    takes.restype, takes.argtypes = ctypes.c_int, [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    assert takes(hq // hkv, 256, cpu_native.KV_KIND[dtype])
    g = generator(seed_for("cpu-native-d256", hq, hkv, bs, dtype, window, cap))
    kv = _paged_kv(D256_LENS, bs, hkv, 256, dtype, g)
    # With a cap, scores of about twice the cap (k ~ N(0, 1), scale 1 / 16), where tanh bends.
    q = (torch.randn((len(D256_LENS), hq, 256), generator=g) * (2 * (cap or 0.5))).to(dtype)
    assert cpu_native.can_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    got, want = _native_vs_reference(q, kv, window=window, softcap=cap)
    live = [b for b, n in enumerate(D256_LENS) if n]
    assert_close(got[live], want[live], dtype)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # length 0: zeros
    if cap is not None:  # the cap moves the result far past the tolerance
        plain = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                                 kv.seq_lens, window=window)
        assert (want[live].float() - plain[live].float()).abs().max() > 0.1


@needs_cc
@pytest.mark.parametrize("threads", [1, 3])
def test_ragged_batch_over_threads_and_int64_tables(threads):
    """Many ragged sequences shared out over threads (dynamic schedule), int64 tables
    with a row stride wider than the row."""
    g = generator(seed_for("cpu-native-threads", threads))
    lens = [int(x) for x in torch.randint(1, 120, (37,), generator=g)]
    lens[5] = lens[20] = 0  # attention over nothing: zeros (the reference gives NaN there)
    kv = _paged_kv(lens, 16, 2, 32, F32, g)
    # int64, and rows of a wider buffer (as the scheduler's launch tensors are sliced).
    wide = torch.full((len(lens), kv.block_tables.shape[1] + 5), -7, dtype=torch.int64)
    wide[:, : kv.block_tables.shape[1]] = kv.block_tables
    kv.block_tables = wide[:, : kv.block_tables.shape[1]]
    assert not kv.block_tables.is_contiguous()
    q = randn((len(lens), 6, 32), F32, g).cpu()
    got, want = _native_vs_reference(q, kv, threads=threads)
    live = [b for b, n in enumerate(lens) if n]
    assert_close(got[live], want[live], F32)
    assert torch.equal(got[[5, 20]], torch.zeros_like(got[[5, 20]]))


@needs_cc
@pytest.mark.parametrize("d", [16, 64])  # the general and the wide kernel
@pytest.mark.parametrize("lens, hkv", [([300], 3), ([37, 0], 8), ([65, 9, 1], 2)],
                         ids=["one-seq-3-heads", "two-seqs-8-heads", "three-seqs-2-heads"])
def test_small_batch_split_by_kv_head_over_threads(lens, hkv, d):
    """Fewer sequences than threads: each sequence's KV heads are shared out (uneven
    ranges, a zero-length sequence among them)."""
    g = generator(seed_for("cpu-native-split", lens, hkv, d))
    kv = _paged_kv(lens, 16, hkv, d, F32, g)
    q = randn((len(lens), 2 * hkv, d), F32, g).cpu()
    got, want = _native_vs_reference(q, kv, threads=4)
    live = [b for b, n in enumerate(lens) if n]
    assert_close(got[live], want[live], F32)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b]))


@needs_cc
def test_large_score_range_and_custom_scale():
    """Scores spread over hundreds: the per-block online-softmax rescale and exp's
    underflow to 0 for keys far below the maximum."""
    g = generator(seed_for("cpu-native-range"))
    lens = [250, 97]
    kv = _paged_kv(lens, 16, 2, 64, F32, g)
    q = randn((2, 4, 64), F32, g).cpu() * 12.0
    got, want = _native_vs_reference(q, kv, scale=0.5)
    assert_close(got, want, F32)


@needs_cc
@pytest.mark.parametrize("kind", ["strided-f32", "bf16"])
def test_output_not_written_directly(kind):
    """An fp32 ``out`` that is not contiguous, and a bf16 ``out``: the kernel writes a
    scratch result that is copied in."""
    g = generator(seed_for("cpu-native-out", kind))
    lens = [40, 3]
    dtype = BF16 if kind == "bf16" else F32
    kv = _paged_kv(lens, 8, 2, 16, dtype, g)
    q = randn((2, 4, 16), dtype, g).cpu()
    out = (torch.empty((2, 8, 16), dtype=dtype)[:, ::2] if kind == "strided-f32"
           else torch.empty((2, 4, 16), dtype=dtype))
    got, want = _native_vs_reference(q, kv, out=out)
    assert_close(got, want, dtype)


@needs_cc
def test_bad_tables_raise_naming_the_sequence():
    g = generator(seed_for("cpu-native-bad"))
    lens = [20, 40, 5]
    kv = _paged_kv(lens, 16, 2, 16, F32, g, extra_cols=0)
    q = randn((3, 4, 16), F32, g).cpu()
    args = (q, kv.k_cache, kv.v_cache)
    bad_id = kv.block_tables.clone()
    bad_id[1, 1] = kv.k_cache.shape[0]  # a needed column past the cache
    with pytest.raises(IndexError, match="sequence 1 "):
        cpu_native.paged_decode_attention(*args, bad_id, kv.seq_lens)
    negative = kv.block_tables.clone()
    negative[2, 0] = -1
    with pytest.raises(IndexError, match="sequence 2 "):
        cpu_native.paged_decode_attention(*args, negative, kv.seq_lens)
    too_long = kv.seq_lens.clone()
    too_long[0] = 16 * kv.block_tables.shape[1] + 1  # needs one more block than the row has
    with pytest.raises(IndexError, match="sequence 0 "):
        cpu_native.paged_decode_attention(*args, kv.block_tables, too_long)


def test_inputs_it_does_not_take_fall_back_to_torch():
    """fp16 caches, head dims not a multiple of 8, blocks over 64 tokens: can_decode says
    no and cpu_backend's entry point still matches the reference (torch path)."""
    g = generator(seed_for("cpu-native-fallback"))
    cases = [(F16, 16, 16), (F32, 12, 16), (F32, 16, 128)]
    for dtype, d, bs in cases:
        kv = _paged_kv([70, 9], bs, 2, d, dtype, g)
        q = randn((2, 4, d), dtype, g).cpu()
        assert not cpu_native.can_decode(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                         kv.seq_lens), (dtype, d, bs)
        out = torch.full_like(q, float("nan"))
        got = cpu_backend.paged_decode_attention(q, kv.k_cache, kv.v_cache,
                                                 kv.block_tables, kv.seq_lens, out=out)
        want = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache,
                                                kv.block_tables, kv.seq_lens)
        assert_close(got, want, dtype)
    # More query heads x head dim than a thread's stack holds: not the C kernel's either.
    many = torch.empty(1, 2048, 512)
    cache = torch.empty(1, 8, 32, 512)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    assert not cpu_native.can_decode(many, cache, cache, tables, lens)
    assert cpu_native.can_decode(many[:, :256], cache, cache, tables, lens) == HAS_CC


_CHILD = textwrap.dedent("""
    import json, warnings
    import torch
    from deepinfer_kernels import cpu_backend, cpu_native, reference
    SETUP
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = cpu_native.native_library()
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 16, 2, 16, generator=g), torch.randn(6, 16, 2, 16, generator=g)
    tables = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    lens = torch.tensor([20, 31], dtype=torch.int32)
    q = torch.randn(2, 4, 16, generator=g)
    got = cpu_backend.paged_decode_attention(q, kc, vc, tables, lens)
    want = reference.paged_decode_attention(q, kc, vc, tables, lens)
    print(json.dumps({"lib": lib is not None, "close": bool(torch.allclose(got, want, atol=2e-5)),
                      "warnings": [str(w.message) for w in caught]}))
""")


def _child(tmp_path, setup: str = "pass", **env) -> dict:
    import json

    full = {**os.environ, "DEEPINFER_CACHE_DIR": str(tmp_path), **env}
    code = _CHILD.replace("SETUP", setup)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_switched_off_by_environment(tmp_path):
    res = _child(tmp_path, DEEPINFER_NATIVE_CPU="0")
    assert res == {"lib": False, "close": True, "warnings": []}
    assert not any(tmp_path.rglob("*.so"))  # nothing was built


def test_failing_compiler_warns_once_and_torch_path_runs(tmp_path):
    res = _child(tmp_path, CC="false")
    assert not res["lib"] and res["close"]
    assert len(res["warnings"]) == 1 and "could not build" in res["warnings"][0]


@needs_cc
def test_a_build_with_fewer_flags_is_said(tmp_path):
    """A compiler that fails on -march=native (as a build past its time limit does): the
    portable library is built, and a warning says so instead of running it silently.
    (-O0 last: the fastest build, this test checks the choice, not the code.)"""
    cc = shutil.which("gcc") or shutil.which("cc")
    script = tmp_path / "cc_no_native"
    script.write_text('#!/bin/sh\ncase "$*" in *-march=native*) echo "no native" >&2; '
                      f'exit 1;; esac\nexec {cc} "$@" -O0\n')
    script.chmod(0o755)
    res = _child(tmp_path, CC=str(script))
    assert res["lib"] and res["close"]
    assert len(res["warnings"]) == 1, res["warnings"]
    assert "-march=native failed (no native)" in res["warnings"][0]


@needs_cc
def test_compiler_with_a_launcher_or_flags_in_cc(tmp_path):
    """CC is split as make splits it: "gcc -O1" is a compiler and a flag, not a name."""
    cc = shutil.which("gcc") or shutil.which("cc")
    res = _child(tmp_path, CC=f"{cc} -O1")
    assert res == {"lib": True, "close": True, "warnings": []}


@needs_cc
def test_out_of_another_shape_or_device_is_refused():
    """The C kernel writes B x Hq x D floats through ``out``'s pointer: an ``out`` of
    another shape is a ValueError naming it, and a cache off the CPU is not taken."""
    g = generator(31)
    kv = _paged_kv([10, 3], 8, 2, 16, F32, g)
    q = randn((2, 4, 16), F32, g).cpu()
    small = torch.full((1, 4, 16), float("nan"))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 4, 16\)"):
        cpu_native.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                          kv.seq_lens, out=small)
    assert torch.isnan(small).all()  # nothing written
    meta_v = torch.empty(kv.v_cache.shape, device="meta")
    assert not cpu_native.can_decode(q, kv.k_cache, meta_v, kv.block_tables, kv.seq_lens)
    assert cpu_native.can_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)


@needs_cc
def test_build_is_cached_per_source_and_flags(tmp_path):
    """A fresh cache directory gets one library; a second process reuses it."""
    first = _child(tmp_path)
    built = sorted(tmp_path.rglob("*.so"))
    second = _child(tmp_path)
    assert first["lib"] and second["lib"] and first["close"] and second["close"]
    assert len(built) == 1 and sorted(tmp_path.rglob("*.so")) == built
    assert not any(p.suffix == ".so" and p.name.startswith("tmp") for p in built)


@needs_cc
def test_build_without_openmp_or_native_flags(tmp_path):
    """The last resort of a compiler without OpenMP (Apple clang): plain flags, the
    pragmas ignored, one thread; still the reference's results."""
    res = _child(tmp_path, setup="cpu_native._FLAG_SETS = (cpu_native._BASE_FLAGS,)")
    assert res == {"lib": True, "close": True, "warnings": []}


# x86 classes whose preprocessor branches the native sources take apart: no vector ISA the
# kernels use, AVX2 (the 8-lane row groups, int8 by vpmaddubsw), AVX512-VNNI without
# AVX512-BF16, and both. This machine runs one of them; the others must still compile.
_X86_CLASSES = ("x86-64", "haswell", "icelake-server", "sapphirerapids")


@needs_cc
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86 only")
@pytest.mark.parametrize("march", _X86_CLASSES)
def test_sources_compile_for_every_x86_vector_class(march: str):
    """A syntax-and-types check (-fsyntax-only, warnings as errors) of every C source
    for each -march class, a few seconds each: an edit that breaks the AVX-512 branches
    fails here on an AVX2 machine, and the other way round, not on a user's CPU."""
    cc = shlex.split(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
    probe = subprocess.run([*cc, f"-march={march}", "-E", "-x", "c", os.devnull],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode:
        pytest.skip(f"{cc[0]} does not know -march={march}")
    flags = ["-fsyntax-only", "-std=gnu11", "-fopenmp", f"-march={march}", "-Wall",
             "-Wno-psabi", "-Werror"]
    proc = subprocess.run([*cc, *flags, *map(str, cpu_native.SOURCES)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
