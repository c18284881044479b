"""Requantize a GGUF file with llama.cpp's own quantizer, into one of its presets
(Q4_K_M, Q5_K_M, Q6_K, ...): the mixed-type files users download, for
``bench_quant.py --model``. The default model ships as Q4_1; this makes its Q4_K_M and
Q5_K_M twins on the machine that measures (the default model's 576 columns are not whole
256-weight super-blocks, so llama.cpp falls back to Q5_0 / Q5_1 for most matrices and
keeps Q4_K/Q5_K and Q6_K where the columns allow: ``ffn_down``, ``attn_v``).

Run it with the Python of the venv that has ``llama-cpp-python`` (it imports neither
deepinfer nor torch)::

    /work/venvs/llamacpp/bin/python benchmarks/requantize_gguf.py SRC.gguf OUT.gguf Q4_K_M

Requantizing from an already quantized file (``allow_requantize``) compounds the two
roundings: fine for speed, not for judging quality.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="the GGUF file to requantize")
    ap.add_argument("out", help="where to write the new file")
    ap.add_argument("preset", help="llama.cpp's file type name, e.g. Q4_K_M, Q5_K_M, Q6_K")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        sys.exit("requantize_gguf.py needs llama-cpp-python: run it with that venv's python")
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{a.preset.upper()}", None)
    if ftype is None:
        names = sorted(n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(llama_cpp)
                       if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        sys.exit(f"preset {a.preset!r} is not one of llama.cpp's: {', '.join(names)}")
    if not os.path.isfile(a.src):
        sys.exit(f"src {a.src!r} is not a file")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = a.threads
    rc = llama_cpp.llama_model_quantize(a.src.encode(), a.out.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize failed ({rc}) on {a.src!r}")
    print(f"wrote {a.out} ({os.path.getsize(a.out) / 1e6:.1f} MB, {a.preset})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
