"""Files k2fleet writes over a sudo connection (a non-root SSH user with ``_sudo``), on a
real sshd and real sudo on loopback: pyinfra uploads such a file to a temporary file as
the SSH user, then ``sudo cp``s it into place. A private file (a key, a token, a secret:
mode without group/other bits) must never exist anywhere with group/other bits, even for
the milliseconds of that hand-over; every file ends root-owned with its planned mode.

The exploit watched for: the temporary copy in /tmp created with the SSH session's umask
(0644: any local user reads the secret while it is there), at a name predictable from
the destination path (a local user could plant a symlink there first).
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

USER = f"k2sudo{os.getpid()}"  # this run's own: created by the fixture, removed by it (with its home)
needs = pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t) for t in ("sudo", "sshd", "ssh-keygen", "useradd",
                                                                                  "userdel")),
                           reason="needs root, sudo, sshd, ssh-keygen, useradd and userdel")
SECRET = b"k2fleet-test-secret-0123456789\n"
REPO = Path(__file__).resolve().parents[1]


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="module")
def sudo_sshd(tmp_path_factory: pytest.TempPathFactory):
    """A real sshd on 127.0.0.1 that lets ``USER`` (passwordless sudo) in with a fresh key.
    Everything it adds to this machine — the user, its home, its sudoers file, the sshd — is
    removed at teardown, however far the setup got and whether or not the test passed."""
    work = tmp_path_factory.mktemp("sudo-sshd")
    os.chmod(work, 0o755)
    assert not _user_exists(USER), f"{USER} exists already: not this run's to use or remove"
    sudoers = Path(f"/etc/sudoers.d/{USER}")
    sshd = None
    try:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", USER], check=True)
        subprocess.run(["usermod", "-p", "*", USER], check=True)  # no password, not locked (sshd refuses locked accounts)
        sudoers.write_text(f"{USER} ALL=(ALL) NOPASSWD:ALL\n")
        sudoers.chmod(0o440)
        home = Path(pwd.getpwnam(USER).pw_dir)
        ssh_dir = home / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / "id")], check=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / "hostkey")], check=True)
        (ssh_dir / "authorized_keys").write_bytes((work / "id.pub").read_bytes())
        uid = pwd.getpwnam(USER).pw_uid
        for p in (ssh_dir, ssh_dir / "authorized_keys"):
            os.chown(p, uid, uid)
        with socket_port() as port:
            pass
        os.makedirs("/run/sshd", exist_ok=True)
        config = work / "sshd_config"
        config.write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {work / 'hostkey'}\nPidFile {work / 'pid'}\n"
                          f"AllowUsers {USER}\nPasswordAuthentication no\nPermitRootLogin no\n"
                          "Subsystem sftp internal-sftp\nUsePAM no\n")
        sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stderr=subprocess.DEVNULL)
        host_pub = (work / "hostkey.pub").read_text().split()
        (work / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
        time.sleep(0.5)
        yield {"port": port, "key": work / "id", "known_hosts": work / "known_hosts", "work": work}
    finally:
        if sshd is not None:
            sshd.terminate()
            sshd.wait()
        sudoers.unlink(missing_ok=True)
        for _ in range(20):  # userdel refuses while a session of USER (ended with its connection) is still exiting
            if not _user_exists(USER) or subprocess.run(["userdel", "--remove", USER], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        assert not _user_exists(USER) and not sudoers.exists(), f"{USER} or its sudoers file is left behind"


class socket_port:
    def __enter__(self) -> int:
        import socket
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def watch(directory: str, stop: threading.Event, seen: dict[str, set[int]]) -> None:
    """Every regular file that appears in ``directory``, with each mode it was seen with (a file
    there before the watch began is not one: e.g. a stray /tmp/pyinfra.txt failed this test once)."""
    try:
        before = {entry.path for entry in os.scandir(directory)}
    except OSError:
        before = set()
    while not stop.is_set():
        try:
            for entry in os.scandir(directory):
                if entry.path in before:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    seen.setdefault(entry.path, set()).add(stat.S_IMODE(st.st_mode))
        except OSError:
            pass
        time.sleep(0.0005)


@needs
def test_private_files_never_readable_by_others_over_sudo(sudo_sshd: dict, tmp_path: Path) -> None:
    target = tmp_path / "etc-k2test"
    deploy = tmp_path / "deploy.py"
    deploy.write_text(
        "from k2fleet.deploy.operations import synced_files\n"
        "from k2fleet.planning.desired import FileSpec\n"
        f"synced_files(name='files', files={{{str(target / 'secret')!r}: FileSpec({SECRET!r}, '600'),\n"
        f"    {str(target / 'public')!r}: FileSpec(b'public\\n', '644')}}, current={{}})\n")
    inventory = tmp_path / "inventory.py"
    inventory.write_text(f"hosts = [('127.0.0.1', {{'ssh_port': {sudo_sshd['port']}, 'ssh_user': {USER!r}, "
                         f"'ssh_key': {str(sudo_sshd['key'])!r}, 'ssh_known_hosts_file': {str(sudo_sshd['known_hosts'])!r}, "
                         "'ssh_strict_host_key_checking': 'yes', '_sudo': True})]\n")
    home = pwd.getpwnam(USER).pw_dir
    seen: dict[str, set[int]] = {}
    stop = threading.Event()
    watchers = [threading.Thread(target=watch, args=(d, stop, seen), daemon=True) for d in ("/tmp", "/var/tmp", home)]
    for w in watchers:
        w.start()
    try:
        proc = subprocess.run([str(Path(sys.executable).parent / "pyinfra"), "-y", str(inventory), str(deploy)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        stop.set()
        for w in watchers:
            w.join()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    secret = os.stat(target / "secret")
    assert (secret.st_uid, stat.S_IMODE(secret.st_mode)) == (0, 0o600)
    assert (target / "secret").read_bytes() == SECRET
    public = os.stat(target / "public")
    assert (public.st_uid, stat.S_IMODE(public.st_mode)) == (0, 0o644)
    temps = {path: modes for path, modes in seen.items() if "pyinfra" in os.path.basename(path)}
    assert temps, "the watcher saw no temporary upload at all: it proves nothing"
    leaked = {path: sorted(oct(m) for m in modes) for path, modes in temps.items() if any(m & 0o077 for m in modes)}
    # the public file's temporary copy may be readable; no other may
    assert len(leaked) <= 1, f"temporary uploads readable by others: {leaked}"
    assert any(modes == {0o600} for modes in temps.values()), f"the secret's copy was not seen: {temps}"
