"""README's inventory key table is exactly what ``k2fleet keys`` prints."""

from __future__ import annotations

import subprocess
from pathlib import Path

from k2sandbox.harness import tool

ROOT = Path(__file__).resolve().parents[1]
HEADING = "### Inventory keys"


def readme_key_table(text: str) -> str:
    """The Markdown table that follows the "Inventory keys" heading (its lines starting with ``|``).

    >>> readme_key_table("### Inventory keys\\n\\nintro\\n\\n| a |\\n|---|\\n| b |\\n\\nafter\\n| c |\\n")
    '| a |\\n|---|\\n| b |\\n'
    """
    lines = text.split(HEADING, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    return "\n".join(table) + "\n"


def test_readme_key_table_is_k2fleet_keys() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.count(HEADING) == 1
    keys = subprocess.run([tool("k2fleet"), "keys"], capture_output=True, text=True, check=True).stdout
    assert readme_key_table(readme) == keys.strip() + "\n", "README's key table is stale: paste `k2fleet keys` under ### Inventory keys"
