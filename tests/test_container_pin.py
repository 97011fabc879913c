"""Container runtime on a sandbox host (Docker installed by the deploy from the offline
bundle, the engine TEST DOUBLE image ``docker load``-ed): the unit runs the pinned image
ID only. Another image moved onto the same reference is refused by name at the next
(re)start, the stopped container is gone, and the next deploy loads the pinned image back.
"""

from __future__ import annotations

import pytest

from k2sandbox.harness import SandboxFleet, ssh

SANDBOX_HOSTS = 1
SANDBOX_DOCKER = True
DATA = {"k2_runtime": "container"}
UNIT = "k2-vllm.service"

pytestmark = pytest.mark.sandbox


def image_id(host: dict, ref: str) -> str:
    return ssh(host, f"docker image inspect --format '{{{{.Id}}}}' {ref}").stdout.strip()


def test_unit_refuses_another_image_under_the_pinned_reference(fleet: SandboxFleet) -> None:
    fleet.ensure_deployed(DATA)
    host = fleet.hosts[0]
    ref = ssh(host, f"systemctl show -p ExecStartPre --value {UNIT}").stdout
    ref = ref.split("k2fleet-host.pyz image_pin ", 1)[1].split()[0]
    pinned = image_id(host, ref)
    assert pinned.startswith("sha256:")
    assert ssh(host, "docker ps --filter name=^k2-vllm$ --format '{{.Image}}'").stdout.strip() == ref

    # Someone moves the tag to another image (a commit of the same image: another ID).
    ssh(host, f"docker create --name k2-other {ref} true && docker commit --change 'LABEL other=1' k2-other {ref}"
              " && docker rm k2-other")
    moved = image_id(host, ref)
    assert moved != pinned
    restart = ssh(host, f"systemctl restart {UNIT}", check=False)
    assert restart.returncode != 0
    journal = ssh(host, f"journalctl -u {UNIT} --no-pager -n 50").stdout
    assert f"image-pin: {ref} is {moved}, the plan pins {pinned}; refusing to start a different image" in journal
    assert ssh(host, "docker ps -a --filter name=^k2-vllm$ -q").stdout.strip() == ""  # stop removed it
    fleet.forget()

    # The next deploy sees the pin check fail, loads the archive again and starts the unit.
    again = fleet.deploy(DATA)
    assert again.returncode == 0, again.tail()
    assert again.changed > 0
    assert image_id(host, ref) == pinned
    assert ssh(host, f"systemctl is-active {UNIT}").stdout.strip() == "active"
