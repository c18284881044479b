"""Every code block of README.md and docs/*.md that is meant to run runs here.

The fence's info string says what a block is (docs/development.md tells writers the same):

- ```` ```python ````: executed. A document's Python blocks share one namespace and run in
  order, like a notebook, in the document's own temp folder. ``LLM()`` with no arguments
  is built once per test session and shared by every document.
- ```` ```bash ````: run by ``bash -e`` in the document's temp folder, the venv's ``bin``
  first on ``PATH``. Only ``deepinfer-generate`` / ``python -m deepinfer.generate`` and a
  few file commands (``cat``, ``head``, ...) on one rank may appear.
- ```` ```json ```` / ```` ```jsonl ````: parsed (each line of a jsonl block). With
  ``file=NAME`` the block is also written to the document's folder as NAME, where the
  blocks after it read it: that is how a command's input file is shown and tested at once.
- ```` ```text ````: a picture or a listing; nothing to run.
- ```` ```LANG no-run: REASON ````: not run (a GPU, several ranks, a model or a peer the
  reader brings, minutes of work); the test skips it with the reason.

Blocks run on one CPU thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``): on a
machine whose cores are busy with other tests, torch's thread pool waiting on itself
makes a tiny model's steps ten times slower.

Any other block fails the test, as does a Python or shell block that cannot run as
written: new docs are run, or say why not.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
DATA = {"json", "jsonl"}
TEXT = {"text"}
# Commands a shell block may run (besides the generator): cheap, local, one process.
FILE_COMMANDS = {"cat", "head", "tail", "wc", "ls", "echo", "printf", "test", "grep", "rm"}
GENERATE = ("deepinfer-generate",)
SEVERAL_RANKS = re.compile(r"(^|\s)(--dp|--tp|--tensor-parallel-size|--pd)(\s|=)")
SHELL_TIMEOUT_S = 180

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass
class Block:
    """One fenced code block: where it is, its info string and its text."""

    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    options: str  # the info string after the language
    text: str

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def no_run(self) -> str | None:
        """The reason given after ``no-run:``, or None when the block is not marked."""
        m = re.search(r"(?:^|\s)no-run:(.*)$", self.options)
        return m.group(1).strip() if m else None

    @property
    def file(self) -> str | None:
        """The name a data block is written under (``file=NAME``), or None."""
        m = re.search(r"(?:^|\s)file=(\S+)", self.options)
        return m.group(1) if m else None


def parse_blocks(doc: Path, text: str) -> list[Block]:
    """Every fenced block of a Markdown text, in order (CommonMark fences, not nested)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").strip()
        lang, _, options = info.partition(" ")
        body: list[str] = []
        j = i + 1
        closing = re.compile(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$")
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"{doc}:{i + 1}: code block never closed")
        blocks.append(Block(doc, i + 1, lang.lower(), options.strip(), "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def shell_commands(script: str) -> Iterator[list[str]]:
    """The argv of each simple command of a shell block (continuations joined)."""
    joined = re.sub(r"\\\n", " ", script)
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        argv: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|()<>"):
                if argv:
                    yield argv
                argv = []
            else:
                argv.append(token)
        if argv:
            yield argv


def why_shell_cannot_run(script: str) -> str | None:
    """Why a shell block cannot run here as written, or None when it can."""
    for argv in shell_commands(script):
        words = [w for w in argv if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w)]
        if not words:
            continue  # an assignment alone
        cmd = words[0]
        generator = cmd in GENERATE or (
            cmd in {"python", "python3"} and words[1:3] == ["-m", "deepinfer.generate"])
        if generator:
            line = " ".join(words)
            if SEVERAL_RANKS.search(line) and not re.search(
                    r"(--dp|--tp|--tensor-parallel-size)[ =]1(\s|$)", line):
                return f"`{line}` runs several ranks"
            if re.fullmatch(r"[A-Za-z_]+=.*", argv[0]):
                return f"`{' '.join(argv)}` sets the environment of the run"
            continue
        if cmd not in FILE_COMMANDS:
            return f"`{cmd}` is not a command this test runs"
    return None


def check_kind(block: Block) -> str:
    """What the test does with a block: 'skip', 'python', 'shell', 'data' or 'text'.

    Raises AssertionError, naming the block, for a block it cannot classify or run.
    """
    reason = block.no_run
    if reason is not None:
        assert reason, f"{block.name}: `no-run:` needs a reason"
        return "skip"
    if block.lang in PYTHON:
        return "python"
    if block.lang in SHELL:
        why = why_shell_cannot_run(block.text)
        assert why is None, (f"{block.name}: {why}; make the block runnable, or mark it "
                             "`no-run: <reason>` in its info string")
        return "shell"
    if block.lang in DATA:
        return "data"
    if block.lang in TEXT:
        assert block.file is None, f"{block.name}: file= is for json/jsonl blocks"
        return "text"
    raise AssertionError(
        f"{block.name}: a ```{block.lang or '(no language)'} block; use python or bash "
        "(run), json/jsonl (parsed), text (not code), or mark it `no-run: <reason>`")


def check_data(block: Block) -> None:
    """A json block parses as one value, a jsonl block as one value per line."""
    text = block.text.strip()
    values = [text] if block.lang == "json" else [ln for ln in text.splitlines() if ln]
    for k, value in enumerate(values):
        try:
            json.loads(value)
        except json.JSONDecodeError as e:
            pytest.fail(f"{block.name}: line {k + 1} of the block is not JSON: {e}")


@dataclass
class DocRun:
    """A document's blocks run in order in one folder, with one Python namespace."""

    blocks: list[Block]
    folder: Path
    namespace: dict[str, Any] = field(default_factory=dict)
    done: int = 0  # blocks before this index have run
    broken: str | None = None  # the first block that failed, once one has

    def run_through(self, index: int, shared_llm: Callable[..., Any]) -> None:
        """Run every block up to and including ``index`` that has not run yet."""
        while self.done <= index:
            if self.broken:
                pytest.fail(f"{self.blocks[index].name}: an earlier block of its document "
                            f"failed: {self.broken}")
            block = self.blocks[self.done]
            self.done += 1
            try:
                run_block(block, self, shared_llm)
            except BaseException:
                self.broken = block.name
                raise


def run_block(block: Block, run: DocRun, shared_llm: Callable[..., Any]) -> None:
    """Run one block in its document's folder and namespace."""
    kind = check_kind(block)
    if kind == "data":
        check_data(block)
        if block.file:
            (run.folder / block.file).write_text(block.text, encoding="utf-8")
    elif kind == "python":
        run_python(block, run, shared_llm)
    elif kind == "shell":
        run_shell(block, run.folder)


def run_python(block: Block, run: DocRun, shared_llm: Callable[..., Any]) -> None:
    """Execute a Python block in the document's namespace, from its folder."""
    import torch

    import deepinfer

    real_llm, threads, cwd = deepinfer.LLM, torch.get_num_threads(), os.getcwd()
    run.namespace.setdefault("__name__", "__main__")
    deepinfer.LLM = shared_llm
    torch.set_num_threads(1)
    os.chdir(run.folder)
    try:
        code = compile(block.text, block.name, "exec")
        exec(code, run.namespace)  # noqa: S102 - running the docs is the point
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
        deepinfer.LLM = real_llm


def run_shell(block: Block, folder: Path) -> None:
    """Run a shell block with bash -e in the document's folder; it must exit 0."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env["OMP_NUM_THREADS"] = "1"  # see the module docstring
    try:
        proc = subprocess.run(["bash", "-e", "-c", block.text], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.name}: still running after {SHELL_TIMEOUT_S} s")
    if proc.returncode != 0:
        pytest.fail(f"{block.name}: exit status {proc.returncode}\n"
                    f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")


def _all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in parse_blocks(doc, doc.read_text(encoding="utf-8"))]


@pytest.fixture(scope="module")
def shared_llm() -> Callable[..., Any]:
    """``LLM`` as the blocks see it: ``LLM()`` is built once, other calls build anew."""
    from deepinfer import LLM

    built: list[Any] = []

    def make(*args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return LLM(*args, **kwargs)
        if not built:
            built.append(LLM())
        return built[0]

    return make


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, DocRun]:
    """One DocRun per document, made on first use."""
    runs: dict[Path, DocRun] = {}
    for doc in DOCS:
        folder = tmp_path_factory.mktemp(doc.stem.lower().replace(".", "_"))
        runs[doc] = DocRun(parse_blocks(doc, doc.read_text(encoding="utf-8")), folder)
    return runs


@pytest.mark.parametrize("block", _all_blocks(), ids=lambda b: f"{b.name}-{b.lang or 'none'}")
def test_doc_block(block: Block, doc_runs: dict[Path, DocRun],
                   shared_llm: Callable[..., Any]) -> None:
    """The block runs (with the blocks before it in its document), or says why not."""
    kind = check_kind(block)
    if kind == "skip":
        pytest.skip(f"{block.name}: no-run: {block.no_run}")
    run = doc_runs[block.doc]
    run.run_through(run.blocks.index(block), shared_llm)


LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)\s#]+)(#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    """Every relative link of a document names a file or folder that exists."""
    text = doc.read_text(encoding="utf-8")
    missing = [m.group(1) for m in LINK.finditer(text)
               if not (doc.parent / m.group(1)).exists()]
    assert not missing, f"{doc.relative_to(ROOT)}: links to missing {missing}"


# The checker itself: it must refuse what it cannot run, so docs cannot rot silently.

def _block(text: str, info: str) -> Block:
    [block] = parse_blocks(ROOT / "README.md", f"```{info}\n{text}```\n")
    return block


@pytest.mark.parametrize(("info", "text"), [
    ("bash", "torchrun --nproc-per-node 2 -m deepinfer.generate --input a --output b\n"),
    ("bash", "deepinfer-generate --input a.jsonl --output b.jsonl --dp 2\n"),
    ("bash", "deepinfer-generate --input a.jsonl \\\n    --output b.jsonl --pd 1:1\n"),
    ("bash", "make generate\n"),
    ("bash", "deepinfer-generate --input a --output b && python benchmarks/x.py\n"),
    ("", "print(1)\n"),
    ("console", "$ ls\n"),
    ("python no-run:", "print(1)\n"),
])
def test_checker_refuses_blocks_it_cannot_run(info: str, text: str) -> None:
    """Unmarked blocks that cannot run here fail instead of being skipped."""
    with pytest.raises(AssertionError):
        check_kind(_block(text, info))


@pytest.mark.parametrize(("info", "text", "kind"), [
    ("bash", "deepinfer-generate --input a.jsonl --output b.jsonl  # one engine\n", "shell"),
    ("bash", "python -m deepinfer.generate --input a --output b --dp 1\ncat b\n", "shell"),
    ("bash no-run: several ranks", "deepinfer-generate --input a --output b --dp 2\n", "skip"),
    ("python no-run: needs a GPU", "LLM(device='cuda')\n", "skip"),
    ("jsonl file=prompts.jsonl", '{"prompt": "Hi"}\n', "data"),
    ("text", "deepinfer/  the engine\n", "text"),
])
def test_checker_kinds(info: str, text: str, kind: str) -> None:
    """Marked and runnable blocks are classified as the module docstring says."""
    assert check_kind(_block(text, info)) == kind
