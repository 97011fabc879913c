"""``k2_checkpoint_fetcher: auto``: who talks to the Hub is chosen by what can reach it, asked
of the hosts before the deploy changes anything (:mod:`k2fleet.deploy.fetcher_choice`)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from k2fleet.cli import load_plan
from k2fleet.deploy import fetcher_choice
from k2fleet.deploy.facts import HubReach
from k2fleet.inventory.loader import inventory_host_data, parse_data_overrides
from k2fleet.planning.desired import fanout_plan
from k2fleet.planning.fetcher_plan import reach_argv

H200 = Path(__file__).resolve().parents[1] / "inventories" / "h200.py"


class FakeHost:
    def __init__(self, name: str, data: dict[str, Any], groups: tuple[str, ...], reaches: bool | None) -> None:
        self.name, self._data, self.groups, self.reaches = name, data, groups, reaches

    @property
    def data(self) -> Any:
        data = self._data
        return type("Data", (), {"dict": lambda _self: dict(data)})()

    def get_fact(self, fact: type, argv: list[str]) -> bool:
        assert fact is HubReach and argv == reach_argv(self._data.get("k2_hub_endpoint"))
        if self.reaches is None:
            raise RuntimeError("cannot be asked")
        return self.reaches


class FakeInventory(list):
    asked: list[str]

    def get_host(self, name: str) -> FakeHost:
        self.asked.append(name)
        return next(h for h in self if h.name == name)


def inventory(reaches: dict[str, bool | None], data: tuple[str, ...] = ()) -> FakeInventory:
    inv = FakeInventory(FakeHost(name, d, groups, reaches.get(name))
                        for name, d, groups in inventory_host_data(H200, parse_data_overrides(list(data))))
    inv.asked = []
    return inv


@pytest.fixture(autouse=True)
def _own_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deployment's control state (where a chosen fetcher is remembered) in this test's own directory."""
    monkeypatch.setenv("K2FLEET_STATE_DIR", str(tmp_path / "state"))


def test_a_chosen_host_is_remembered_and_not_asked_again() -> None:
    """A settled fleet's re-run pays no round trip for the question; the control machine
    (no host reached the Hub this time) is never remembered."""
    dep, plan = load_plan(str(H200), [])
    inv = inventory({"h200-0": False, "h200-1": None})
    assert fetcher_choice.resolve(inv, dep, plan)[2] == "control" and sorted(inv.asked) == ["h200-0", "h200-1"]
    inv = inventory({"h200-0": False, "h200-1": True})
    assert fetcher_choice.resolve(inv, dep, plan)[2] == "h200-1" and sorted(inv.asked) == ["h200-0", "h200-1"]
    inv = inventory({"h200-0": True, "h200-1": False})
    assert fetcher_choice.resolve(inv, dep, plan)[2] == "h200-1" and inv.asked == []  # remembered
    memo = fetcher_choice.state_dir(dep) / fetcher_choice.CHOICE_FILE
    assert memo.stat().st_mode & 0o777 == 0o600
    memo.write_text("gone-host\n")  # a host no longer in the inventory: ask again
    inv = inventory({"h200-0": True, "h200-1": False})
    assert fetcher_choice.resolve(inv, dep, plan)[2] == "h200-0" and sorted(inv.asked) == ["h200-0", "h200-1"]


@pytest.mark.parametrize("reaches, chosen", [
    ({"h200-0": False, "h200-1": True}, "h200-1"),
    ({"h200-0": True, "h200-1": True}, "h200-0"),  # the first in inventory order
    ({"h200-0": False, "h200-1": None}, "control"),  # none reaches (one cannot even be asked): the control copy
])
def test_auto_is_the_first_host_that_reaches_the_hub_else_control(reaches: dict[str, bool | None], chosen: str) -> None:
    dep, plan = load_plan(str(H200), [])
    assert dep.s.checkpoint_fetcher == "auto"  # the default
    inv = inventory(reaches)
    dep2, plan2, choice = fetcher_choice.resolve(inv, dep, plan)
    assert choice == chosen and dep2.s.checkpoint_fetcher == chosen and sorted(inv.asked) == ["h200-0", "h200-1"]
    fan = fanout_plan(dep2, plan2)
    assert fan.root == (chosen if chosen != "control" else "h200-0")


@pytest.mark.parametrize("data", [("k2_hub_endpoint=http://127.0.0.1:8080",), ("k2_checkpoint_fetcher=control",),
                                  ("k2_checkpoint_fetcher=h200-1",)])
def test_no_host_is_asked_when_the_answer_is_known(data: tuple[str, ...]) -> None:
    """A loopback endpoint (the control machine's own), or a fetcher the inventory names
    (``control`` keeps today's path through the deploy's SSH)."""
    dep, plan = load_plan(str(H200), list(data))
    inv = inventory({"h200-0": True, "h200-1": True}, data)
    dep2, _, choice = fetcher_choice.resolve(inv, dep, plan)
    assert inv.asked == []
    assert dep2.s.checkpoint_fetcher == ("control" if "127.0.0.1" in data[0] else data[0].split("=")[1])


def test_the_question_a_host_runs_opens_a_real_socket() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        up = subprocess.run(reach_argv(f"http://127.0.0.1:{port}"), capture_output=True, text=True, timeout=30)
    down = subprocess.run(reach_argv(f"http://127.0.0.1:{port}", timeout=1), capture_output=True, text=True, timeout=30)
    assert HubReach().process(up.stdout.splitlines()) is True
    assert HubReach().process(down.stdout.splitlines()) is False


def test_plan_says_how_auto_decides(capsys: pytest.CaptureFixture[str]) -> None:
    from k2fleet.cli import main

    assert main(["plan", str(H200)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint fetcher: auto → decided before the deploy changes anything: the first of h200-0, h200-1 " \
           "that opens huggingface.co:443" in out
