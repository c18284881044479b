"""gpu_ci.sh's environment check: GPU, torch, triton, pytest (stops the run with a message
naming what is wrong); prints the environment as one JSON line for the summary.

    python scripts/gpu_ci_env.py > logs/env.json
"""
import json
import sys

try:
    import torch
except Exception as e:
    sys.exit(f"gpu_ci.sh: torch cannot be imported ({e})")
try:
    import triton
except Exception as e:
    sys.exit(f"gpu_ci.sh: triton cannot be imported ({e})")
try:
    import pytest  # noqa: F401
except Exception as e:
    sys.exit(f"gpu_ci.sh: pytest cannot be imported ({e}); pip install pytest")
if not torch.cuda.is_available():
    sys.exit(f"gpu_ci.sh: CUDA is not available (torch {torch.__version__}, "
             f"built for CUDA {torch.version.cuda}); this script needs a GPU")
major, minor = torch.cuda.get_device_capability()
if major < 8:
    sys.exit(f"gpu_ci.sh: {torch.cuda.get_device_name()} is sm_{major}{minor}; the kernels "
             "and CUDA graphs are tuned and tested for sm_80+")
tv = tuple(int(x) for x in triton.__version__.split(".")[:2])
if tv < (3, 6):
    sys.exit(f"gpu_ci.sh: triton {triton.__version__} is older than 3.6 (the oldest "
             "the kernels are compiled and checked with)")
try:
    import flash_attn
    fa = flash_attn.__version__
except Exception:
    fa = None
try:
    from importlib.metadata import version

    import xgrammar  # noqa: F401  (it has no __version__: read the installed metadata)
    xg = version("xgrammar")
except Exception:
    xg = None  # the structured-output step fails then; the others run
free, total = torch.cuda.mem_get_info()
print(json.dumps({
    "gpu": torch.cuda.get_device_name(), "capability": f"sm_{major}{minor}",
    "gpu_mem_gib": round(total / 2**30, 1), "gpu_free_gib": round(free / 2**30, 1),
    "python": sys.version.split()[0], "torch": torch.__version__,
    "cuda": torch.version.cuda, "triton": triton.__version__, "flash_attn": fa,
    "xgrammar": xg,
}))
