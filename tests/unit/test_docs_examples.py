"""Every Python example in README.md and docs/ is type-checked, and run unless marked.

Each page's ```python blocks are joined, in order, into one module after a prelude that
defines ``app`` (the Celery app most examples assume), so a later block may use what an
earlier one of the same page defined. The module is type-checked with mypy (one run for
all pages), then run in a subprocess of its own, after which every Celery app it made is
finalized: that binds each SingletonTask, so a bad option in an example fails here as it
would at registration.

A block can opt out with an HTML comment on the line before it (invisible once rendered):

- ``<!-- docs-test: typecheck-only (why) -->``: type-checked, not run (it sends a message,
  imports Django...);
- ``<!-- docs-test: skip (why) -->``: neither (another library's code, in the migration guide).

Running needs no service: defining apps and tasks opens no connection.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
README_MAX_LINES = 250

PRELUDE = """\
from celery import Celery as _DocsCelery

app = _DocsCelery("docs", broker="memory://", set_as_current=False)
app.conf.pglock_database_url = "postgresql+psycopg2://app@db/app"
"""
EPILOGUE = """
import celery as _docs_celery

for _docs_value in list(globals().values()):
    if isinstance(_docs_value, _docs_celery.Celery):
        _docs_value.finalize(auto=True)  # binds every task: registration checks run
"""
MYPY_CONFIG = """\
[mypy]
python_version = 3.10
check_untyped_defs = True
strict_equality = True
warn_unused_ignores = True
warn_redundant_casts = True
"""

_FENCE = re.compile(r"^\s*```(?P<info>[^\n`]*)$")
_MARKER = re.compile(
    r"^\s*<!--\s*docs-test:\s*(?P<mode>typecheck-only|skip)\b(?P<why>.*)-->\s*$"
)


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the first code line in the page
    code: str
    mode: str  # "run", "typecheck-only" or "skip"
    reason: str


def fenced_blocks(page: Path, language: str = "python") -> list[Block]:
    """The ``language`` code blocks of a Markdown page, with the marker before each."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        start = index
        index += 1
        while index < len(lines) and lines[index].strip() != "```":
            index += 1
        if fence["info"].strip().split(" ")[0] == language:
            previous = next(
                (line for line in reversed(lines[:start]) if line.strip()), ""
            )
            marker = _MARKER.match(previous)
            # dedent: a block inside a list item is indented in the page
            code = textwrap.dedent("\n".join(lines[start + 1 : index]))
            blocks.append(
                Block(
                    page=page,
                    line=start + 2,
                    code=code,
                    mode=marker["mode"] if marker else "run",
                    reason=marker["why"].strip() if marker else "",
                )
            )
        index += 1
    return blocks


def page_module(
    blocks: list[Block], *, modes: set[str]
) -> tuple[str, list[tuple[int, int, int]]]:
    """One page's module text, and for each of its lines the (page line, module line) map."""
    text = PRELUDE
    origin: list[tuple[int, int, int]] = []
    for block in blocks:
        if block.mode not in modes:
            continue
        text += f"\n# --- {block.page.name}:{block.line}\n"
        first = text.count("\n") + 1
        text += block.code + "\n"
        origin.append((first, block.line, block.code.count("\n") + 1))
    return text, origin


def module_name(page: Path) -> str:
    return re.sub(r"\W", "_", str(page.relative_to(ROOT).with_suffix(""))).lower()


def page_line(origin: list[tuple[int, int, int]], line: int) -> int | None:
    """The page line of a module line (None for the prelude and the epilogue)."""
    for first, page_first, length in origin:
        if first <= line < first + length:
            return page_first + line - first
    return None


PAGE_BLOCKS = {page: fenced_blocks(page) for page in PAGES}
RUNNABLE = [
    page
    for page, blocks in PAGE_BLOCKS.items()
    if any(block.mode == "run" for block in blocks)
]


def test_examples_are_found_and_opt_outs_say_why():
    """The collector sees the README's examples, and every opt-out gives its reason."""
    readme = PAGE_BLOCKS[ROOT / "README.md"]
    assert len(readme) >= 2
    assert any(block.mode == "run" for block in readme)
    for blocks in PAGE_BLOCKS.values():
        for block in blocks:
            if block.mode != "run":
                assert block.reason, f"{block.page}:{block.line}: say why it is not run"


def test_readme_is_a_five_minute_read():
    """The README stays short; everything else belongs to the docs site."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES


def test_examples_type_check(tmp_path):
    """mypy accepts every example that is not skipped, with each page's blocks in order."""
    origins: dict[str, tuple[Path, list[tuple[int, int, int]]]] = {}
    for page, blocks in PAGE_BLOCKS.items():
        if not any(block.mode != "skip" for block in blocks):
            continue
        text, origin = page_module(blocks, modes={"run", "typecheck-only"})
        name = module_name(page)
        (tmp_path / f"{name}.py").write_text(text, encoding="utf-8")
        origins[name] = (page, origin)
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG, encoding="utf-8")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(tmp_path / "mypy.ini"),
            "--cache-dir",
            str(ROOT / ".mypy_cache" / "docs-examples"),
            *sorted(str(tmp_path / f"{name}.py") for name in origins),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
    )
    report = []
    for line in result.stdout.splitlines():
        match = re.match(r"^(?P<name>\w+)\.py:(?P<line>\d+): (?P<rest>.*)$", line)
        if match and match["name"] in origins:
            page, origin = origins[match["name"]]
            where = page_line(origin, int(match["line"]))
            line = f"{page.relative_to(ROOT)}:{where}: {match['rest']}"
        report.append(line)
    assert 0 == result.returncode, "\n".join(report) + result.stderr


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda page: str(page.relative_to(ROOT)))
def test_examples_run(page, tmp_path):
    """Each page's runnable examples execute, and every app they define finalizes."""
    text, origin = page_module(PAGE_BLOCKS[page], modes={"run"})
    script = tmp_path / f"{module_name(page)}.py"
    script.write_text(text + EPILOGUE, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    traceback = result.stderr
    for line in re.findall(rf'File "{re.escape(str(script))}", line (\d+)', traceback):
        traceback += (
            f"\n(module line {line} is {page.name}:{page_line(origin, int(line))})"
        )
    assert 0 == result.returncode, traceback


def test_package_imports_without_a_database():
    """The API reference and users' imports need no database: importing opens nothing."""
    code = (
        "import celery_pglock, celery_pglock.task, celery_pglock.db.engines as db; "
        "assert db._engines == {}, db._engines"
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("CELERY_PGLOCK_")
    }
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert 0 == result.returncode, result.stderr


def test_published_key_vectors_match_the_algorithm():
    """Every row of the docs' test-vector table is what key_from_text computes."""
    from celery_pglock import keys

    page = (ROOT / "docs" / "reference" / "keys.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\[\"celery_pglock/1\".*\])` \| `(-?\d+)` \|$", page, re.M)
    assert len(rows) >= 6
    for text, key in rows:
        assert int(key) == keys.key_from_text(text), text
