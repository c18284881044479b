"""The benchmarks import their sibling modules by bare name, as they do when run as
scripts. deepinfer itself comes from the installed package (``make install``); the
checkout's root stays off sys.path, where its kernels/ folder would hide HuggingFace's
``kernels``."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
