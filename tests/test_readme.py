"""The README and docs/: the README stays short and keeps the two set-up commands, every
relative link resolves, and docs/inventory-keys.md's key table is exactly what
``k2fleet keys`` prints."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from k2sandbox.harness import tool

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
KEYS_DOC = DOCS / "inventory-keys.md"
README_MAX_LINES = 250
COMMANDS = (
    "    ./dev.sh demo    # set up, boot the 3-host sandbox fleet, deploy to it until healthy\n",
    "    ./dev.sh test    # set up, run the whole test suite (sandbox end-to-end tests included)\n",
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def markdown_table(text: str) -> str:
    """The one Markdown table in ``text`` (its lines starting with ``|``); ValueError when the
    ``|`` lines are not one contiguous block.

    >>> markdown_table("# Keys\\n\\nintro\\n\\n| a |\\n|---|\\n| b |\\n\\nafter\\n")
    '| a |\\n|---|\\n| b |\\n'
    >>> markdown_table("| a |\\n\\n| b |\\n")
    Traceback (most recent call last):
    ValueError: 2 tables, not one
    """
    lines = text.splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("|")]
    blocks = sum(1 for i in rows if i - 1 not in rows)
    if blocks != 1:
        raise ValueError(f"{blocks} tables, not one")
    return "\n".join(lines[i] for i in rows) + "\n"


def relative_links(text: str) -> list[str]:
    """Targets of the Markdown links and images in ``text`` that point into this repository
    (no URL scheme, no bare ``#anchor``), with any ``#anchor`` cut; links inside inline code
    and indented code blocks are not links.

    >>> relative_links("[a](docs/x.md#top) ![p](p.png) [w](https://pyinfra.com) [s](#here) `[c](no.md)`\\n"
    ...                "\\n    [code](block.md)\\n")
    ['docs/x.md', 'p.png']
    """
    out = []
    for line in text.splitlines():
        if line.startswith("    "):
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            out.append(target.split("#", 1)[0])
    return out


def broken_links(path: Path) -> list[str]:
    """The relative links of Markdown file ``path`` whose target file does not exist."""
    return [t for t in relative_links(path.read_text()) if not (path.parent / t).exists()]


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into docs/"


def test_readme_keeps_the_two_commands() -> None:
    readme = README.read_text()
    for command in COMMANDS:
        assert command in readme, f"README.md lost the set-up command {command.strip()!r}"


def test_every_relative_link_resolves() -> None:
    assert len(markdown_files()) > 1
    broken = {str(p.relative_to(ROOT)): b for p in markdown_files() if (b := broken_links(p))}
    assert not broken, f"links to missing files: {broken}"


def test_a_missing_link_target_is_reported(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("x\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md) [gone](docs/missing.md#a) ![img](missing.png)\n")
    assert broken_links(doc) == ["docs/missing.md", "missing.png"]


def test_readme_links_every_doc() -> None:
    linked = {(ROOT / t).resolve() for t in relative_links(README.read_text())}
    unlinked = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not unlinked, f"docs not in README's contents: {unlinked}"


def test_key_table_is_k2fleet_keys() -> None:
    keys = subprocess.run([tool("k2fleet"), "keys"], capture_output=True, text=True, check=True).stdout
    assert markdown_table(KEYS_DOC.read_text()) == keys.strip() + "\n", \
        "docs/inventory-keys.md's key table is stale: replace it with `k2fleet keys` output"
