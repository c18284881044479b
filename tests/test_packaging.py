"""What the project installs: import names of its own (the folders kernels/ and
scheduler/ install as deepinfer_kernels and deepinfer_scheduler), every package in the
wheel, and HuggingFace's ``kernels`` (a transformers dependency) importable beside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("deepinfer", "kernels", "scheduler")
TOOLS = "tools"  # lab tooling (the kernels' compile grid): in the checkout, never installed


def _setuptools_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _import_names() -> dict[str, str]:
    """Folder -> top-level import name, as pyproject's package-dir maps them."""
    mapping = {folder: folder for folder in FOLDERS}
    for name, folder in _setuptools_config()["package-dir"].items():
        mapping[folder] = name
    return mapping


def _packages_on_disk() -> set[str]:
    names = _import_names()
    found = set()
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((names[folder], *rel)))
    return found


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter run from ``cwd``, without the caller's PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_names_are_the_projects_own():
    assert set(_import_names().values()) == {"deepinfer", "deepinfer_kernels",
                                              "deepinfer_scheduler"}


def test_packages_list_covers_every_package_folder():
    listed = set(_setuptools_config()["packages"])
    on_disk = _packages_on_disk()
    assert listed == on_disk, (f"pyproject's packages miss {sorted(on_disk - listed)}, "
                               f"or list what is gone: {sorted(listed - on_disk)}")


def test_huggingface_kernels_imports_beside_deepinfer_in_this_process():
    """make test runs the venv's pytest in importlib mode, so the checkout's kernels/
    folder is not on sys.path to hide the installed ``kernels``."""
    kernels = pytest.importorskip("kernels")
    import deepinfer_kernels

    assert Path(deepinfer_kernels.__file__).parent == ROOT / "kernels"
    assert not Path(kernels.__file__).is_relative_to(ROOT / "kernels")
    assert hasattr(kernels, "get_kernel")


def test_huggingface_kernels_imports_beside_deepinfer_in_a_fresh_process(tmp_path):
    pytest.importorskip("kernels")
    code = ("import deepinfer, deepinfer_kernels, deepinfer_scheduler, transformers, kernels\n"
            "from deepinfer import LLM, SamplingParams\n"
            "print(kernels.get_kernel.__module__)\n")
    res = _python(code, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith("kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from a copy of the sources (a build in the checkout would leave
    build/ and egg-info behind while other tests run)."""
    src = tmp_path_factory.mktemp("src")
    # tools/ is copied too: the wheel is built from a tree that has it, as the checkout does.
    for folder in (*FOLDERS, TOOLS):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(out), str(src)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    (path,) = out.glob("deepinfer-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_holds_every_module_under_its_import_name(wheel):
    names = set(wheel.namelist())
    mapping = _import_names()
    for folder in FOLDERS:
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT / folder).as_posix()
            assert f"{mapping[folder]}/{rel}" in names, f"{folder}/{rel} is not in the wheel"
    # The C kernels are compiled on first use: every source and header must ship.
    for src in (ROOT / "kernels" / "csrc").iterdir():
        assert f"deepinfer_kernels/csrc/{src.name}" in names, f"{src.name} is not in the wheel"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"deepinfer", "deepinfer_kernels", "deepinfer_scheduler"}


def test_wheel_ships_no_compile_tooling(wheel):
    """The ahead-of-time compile grid (tools/deepinfer_compile_grid) stays out of the wheel,
    under its own name and under the kernel package's old module names."""
    tooling = [n for n in wheel.namelist()
               if "compile_grid" in n or n.startswith("tools/")
               or n.startswith(("deepinfer_kernels/compile_", "kernels/compile_"))]
    assert not tooling, tooling
    assert (ROOT / TOOLS / "deepinfer_compile_grid" / "check.py").is_file()


def test_wheel_requires_no_transformers_upper_bound(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    requires = [line for line in wheel.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist: transformers")]
    assert requires and all("<" not in line for line in requires), requires


def test_huggingface_kernels_imports_from_the_checkout_root():
    """``python -m ...`` from the checkout puts its root on sys.path, where the kernels/
    folder is found first under the name ``kernels``: it hands over to the installed one."""
    pytest.importorskip("kernels")
    code = ("import sys, kernels, transformers.activations, deepinfer_kernels\n"
            "print(kernels.__file__)\n")
    res = _python(code, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert not Path(res.stdout.strip()).is_relative_to(ROOT / "kernels"), res.stdout


def test_without_huggingface_kernels_the_checkout_folder_is_an_empty_namespace():
    """Where no ``kernels`` is installed, the checkout's folder found from its root stands
    for nothing: an empty namespace without ``__file__``, which transformers' probe reads
    as "not installed" instead of failing on deepinfer's kernels."""
    code = (
        "import importlib.machinery as m\n"
        "find = m.PathFinder.find_spec\n"
        "m.PathFinder.find_spec = classmethod(lambda cls, name, path=None, target=None: "
        "None if name == 'kernels' and path is not None else find(name, path, target))\n"
        "import kernels\n"
        "assert getattr(kernels, '__file__', None) is None, kernels.__file__\n"
        "assert not hasattr(kernels, 'paged_decode_attention')\n"
        "try:\n"
        "    from kernels import get_kernel\n"
        "except ImportError:\n"
        "    print('ImportError')\n")
    res = _python(code, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ImportError"


def test_the_hand_over_loads_nothing_of_deepinfer(tmp_path):
    """Imported as ``kernels``, the folder hands over and stops there: no deepinfer kernel
    module, no TRITON_INTERPRET set for the process, and it works where deepinfer is not
    installed at all (``-S``: no editable finder)."""
    pytest.importorskip("kernels")
    site = Path(pytest.importorskip("torch").__file__).resolve().parents[1]
    code = (f"import os, sys; sys.path[:0] = [{str(ROOT)!r}]; sys.path.append({str(site)!r})\n"
            "import kernels\n"
            "print(os.environ.get('TRITON_INTERPRET'), "
            "any(m.startswith('deepinfer') for m in sys.modules), kernels.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    res = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    interpret, deepinfer_loaded, path = res.stdout.split()
    assert (interpret, deepinfer_loaded) == ("None", "False")
    assert not Path(path).is_relative_to(ROOT / "kernels")


def test_the_checkout_reached_twice_through_a_link_hands_over_once(tmp_path):
    pytest.importorskip("kernels")
    link = tmp_path / "checkout"
    link.symlink_to(ROOT, target_is_directory=True)
    code = (f"import sys; sys.path[:0] = [{str(link)!r}, {str(ROOT)!r}]\n"
            "import kernels\n"
            "print(kernels.__file__)\n")
    res = _python(code, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "kernels" in res.stdout and "checkout" not in res.stdout
