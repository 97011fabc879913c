"""Write throwaway pyinfra inventories for tests (real files, loaded by pyinfra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

THINKING_SHA = "a51ccc050d73dab088bf7b0e2dd9b30ae85a4e55"


def write_inventory(
    directory: Path,
    hosts: int | list[tuple[str, dict[str, Any]]] = 1,
    name: str = "fleet",
    **data: Any,
) -> Path:
    """``directory/name.py`` with ``hosts`` and ``data`` as the file group's group data."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "group_data").mkdir(exist_ok=True)
    if isinstance(hosts, int):
        hosts = [(f"node-{i}", {"ssh_hostname": f"192.0.2.{10 + i}"}) for i in range(hosts)]
    defaults: dict[str, Any] = {
        "k2_model": "moonshotai/Kimi-K2-Thinking",
        "k2_revision": THINKING_SHA,
        "k2_engine": "vllm",
        "k2_gpu": "h200",
    }
    merged = defaults | data
    merged = {k: v for k, v in merged.items() if v is not None}
    (directory / f"{name}.py").write_text(f"nodes = {hosts!r}\n")
    (directory / "group_data" / f"{name}.py").write_text("".join(f"{k} = {v!r}\n" for k, v in merged.items()))
    return directory / f"{name}.py"


def scenario_inventories(root: Path | None = None) -> list[str]:
    """``inventories/NAME.py`` of every scenario inventory the offline tests plan as written:
    not the sandbox's own, and not a company-network one (``corp-*``: its hosts are DNS names
    that resolve only on its network; tests/test_company_network.py rehearses it, on a sandbox
    network that serves them, and tests/test_addresses.py plans named hosts with a resolver)."""
    top = root or Path(__file__).resolve().parents[1]
    return sorted(f"inventories/{p.name}" for p in (top / "inventories").glob("*.py")
                  if not p.name.startswith(("sandbox", "corp-")))
