"""The trust boundary: an inventory is validated before any host is contacted, on
every entry — ``pyinfra INVENTORY deploys/kimi.py``, ``k2fleet validate`` and
``k2fleet plan`` — with the same one-line message, exit code 2 and no traceback.

pyinfra's CLI runs ``config.py`` (repository root), loads the inventory (host data,
group data, ``--data``), calls ``State.init`` and only then ``connect_all``. The
repository's ``config.py`` calls :func:`install_pyinfra_gate`, which wraps that one
``State.init`` call: the loaded inventory is checked there, before the first TCP
connection, and a bad one ends the run. Host names are resolved to the fleet's IPs there,
once per run (:mod:`k2fleet.control.addresses`), so planning receives IPs.

>>> refusal_line(SpecError("k2_port", "not a port", "inventories/x.py"))
'error: inventories/x.py: k2_port: not a port'
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from typing import Any, NoReturn

from k2fleet.control.addresses import Resolver, resolve_addresses, resolve_egress
from k2fleet.planning.fetches import refusal
from k2fleet.planning.firewall import egress_names
from k2fleet.planning.os_tables import OS_TABLES, host_os
from k2fleet.planning.deployment import Deployment, resolve
from k2fleet.inventory.loader import (HostData, check_group_conflicts, check_group_data, check_inventory_groups,
                                     checked_groups, fleet_from_hosts, host_data, load_failure)
from k2fleet.planning.processes import Plan
from k2fleet.planning.planner import make_plan
from k2fleet.inventory.spec import SpecError


def refusal_line(exc: SpecError) -> str:
    """The one line every entry prints for a bad inventory."""
    return "error: " + " ".join(str(exc).split())


def refuse(exc: SpecError) -> NoReturn:
    """Print :func:`refusal_line` to stderr and exit 2 (no traceback)."""
    sys.stderr.write(refusal_line(exc) + "\n")
    sys.stderr.flush()
    raise SystemExit(2)


def check_hosts(source: str, hosts: list[HostData], resolver: Resolver | None = None) -> tuple[Deployment, Plan]:
    """Validate an inventory's hosts, resolve their DNS-name addresses to IPs on this control
    machine (once; ``resolver``: the tests' seam, default ``socket.getaddrinfo``), and plan
    them (pure, on IPs), then the control machine's files the inventory names; raises
    SpecError on the first problem."""
    dep = resolve(resolve_addresses(fleet_from_hosts(source, hosts), resolver))
    outside = refusal(dep)  # k2_egress: mirrors-only or k2_bundle: a fetch from outside the declared mirrors
    if outside is not None:
        raise outside
    if dep.s.egress == "mirrors-only":  # the mirrors' names → IPs, once, for the firewall's egress sets
        dep = dataclasses.replace(dep, fleet=resolve_egress(dep.fleet, egress_names(dep), resolver))
    plan = make_plan(dep)
    check_token_file(dep.s.hub_token_file, source)
    check_token_file(dep.s.api_key_file, source, key="k2_api_key_file", what="the endpoints' API key")
    check_tls_files(dep, plan, source)
    for key in ("k2_os_mirror_keyring", "k2_nvidia_repo_keyring", "k2_container_toolkit_repo_keyring",
                "k2_docker_repo_keyring"):
        check_keyring_file(getattr(dep.s, key[3:]), source, key, armored=any(
            OS_TABLES[host_os(h)].manager == "dnf" for h in dep.fleet.hosts))
    check_control_source(dep.s.checkpoint_source, source, "k2_checkpoint_source")
    if dep.s.gguf_repo:
        check_control_source(dep.s.gguf_source, source, "k2_gguf_source")
    return dep, plan


CONTROL = "control:"
MANIFEST = ".k2fleet/manifest.json"  # what a control: copy holds beside its files (k2fleet.hostprogs.manifest)


def check_control_source(value: str, source: str, key: str) -> None:
    """A ``control:/path`` weight source (``k2_checkpoint_source``, ``k2_gguf_source``): a
    directory on this control machine holding the verified files' ``.k2fleet/manifest.json``
    (the control step verifies the files against it; it fetches nothing). ``hub``: nothing here."""
    if not value.startswith(CONTROL):
        return
    path = value[len(CONTROL):]
    fix = (f"put the files and their {MANIFEST} there (e.g. `hf download REPO --revision SHA --local-dir {path}` "
           "on a connected machine, then copy it here), or use `hub`")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SpecError(key, f"{path} does not exist on this control machine; {fix}", source) from None
    except OSError as exc:
        raise SpecError(key, f"{path} cannot be read: {exc.strerror}", source) from None
    if not stat.S_ISDIR(st.st_mode):
        raise SpecError(key, f"{path} is not a directory on this control machine; name the directory that holds "
                        f"the files and their {MANIFEST}", source)
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise SpecError(key, f"{path} has no {MANIFEST}; {fix}", source)


def _regular_file(path: str, source: str, key: str, fix: str) -> os.stat_result:
    """``path``'s stat on the control machine, not following a symlink; SpecError naming
    ``key`` when it is missing (``fix``: what to put there), cannot be stat'ed (a directory on its
    path not searchable) or is not a regular file."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        raise SpecError(key, f"{path} does not exist on this control machine; {fix} or unset the key", source) from None
    except OSError as exc:
        raise SpecError(key, f"{path} cannot be read: {exc.strerror}", source) from None
    if not stat.S_ISREG(st.st_mode):
        raise SpecError(key, f"{path} is not a regular file (a symlink or a directory)", source)
    return st


KEYRING_MAX = 1 << 20
ARMOR = b"-----BEGIN PGP PUBLIC KEY BLOCK-----"


def check_keyring_file(path: str | None, source: str, key: str, armored: bool = False) -> None:
    """A mirror's keyring on the control machine (``k2_os_mirror_keyring``,
    ``k2_nvidia_repo_keyring``, ``k2_container_toolkit_repo_keyring``, ``k2_docker_repo_keyring``): a regular file (not a symlink), readable, not empty, at most
    1 MiB, holding OpenPGP key material (binary, or armored; dnf hosts: armored). Public keys:
    any mode is fine; the hosts get it 0644."""
    if path is None:
        return
    st = _regular_file(path, source, key, "put the mirror's signing key there")
    if st.st_size == 0 or st.st_size > KEYRING_MAX:
        raise SpecError(key, f"{path} is {'empty' if st.st_size == 0 else 'larger than 1 MiB'}; it must hold the "
                        "mirror's OpenPGP public key", source)
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
    except OSError as exc:
        raise SpecError(key, f"{path} cannot be read: {exc.strerror}", source) from None
    is_armored = head.lstrip().startswith(ARMOR)
    # a binary OpenPGP packet has its top bit set (RFC 4880 4.2); a public key packet is tag 6
    if not is_armored and not (head[0] & 0x80):
        raise SpecError(key, f"{path} is neither an armored OpenPGP key ({ARMOR.decode()}) nor a binary keyring "
                        "(gpg --export); export the mirror's public key into it", source)
    if armored and not is_armored:
        raise SpecError(key, f"{path} is a binary keyring but dnf (RHEL hosts) imports armored keys; "
                        f"gpg --armor --export > {path}.asc and name that file", source)


def check_token_file(path: str | None, source: str, key: str = "k2_hub_token_file", what: str = "the Hub token") -> None:
    """A secret file on the control machine (``k2_hub_token_file``, ``k2_api_key_file``):
    a regular file of this user's, not empty, readable by no one else (0600 or stricter).
    Only its metadata and size are read here; the secret itself is read when it is used
    (the Hub download; the API key's root-only files for hosts)."""
    if path is None:
        return
    st = _regular_file(path, source, key, f"write {what} there (install -m 600 /dev/stdin PATH)")
    if st.st_mode & 0o077:
        raise SpecError(key, f"{path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 {path}", source)
    if st.st_uid != os.geteuid():
        raise SpecError(key, f"{path} belongs to uid {st.st_uid}, not to the user running k2fleet", source)
    if st.st_size == 0:
        raise SpecError(key, f"{path} is empty; write {what} into it", source)
    if key == "k2_api_key_file":  # it reaches an env file and an HTTP header: one line of visible ASCII
        with open(path, "rb") as fh:
            text = fh.read(API_KEY_MAX + 2).strip()
        if not text or len(text) > API_KEY_MAX or any(b < 0x21 or b > 0x7E for b in text):
            raise SpecError(key, f"{path} must hold one key of 1-{API_KEY_MAX} visible ASCII characters "
                            "(no spaces or control characters), e.g. openssl rand -hex 32", source)


API_KEY_MAX = 4096
TLS_FILE_MAX = 1 << 20


def _read_pem(path: str, source: str, key: str, fix: str) -> bytes:
    """A PEM file of ``k2_tls_*``: a regular file (not a symlink), at most 1 MiB, read."""
    st = _regular_file(path, source, key, fix)
    if st.st_size == 0 or st.st_size > TLS_FILE_MAX:
        raise SpecError(key, f"{path} is {'empty' if st.st_size == 0 else 'larger than 1 MiB'}; {fix}", source)
    try:
        with open(path, "rb") as fh:
            return fh.read(TLS_FILE_MAX + 1)
    except OSError as exc:
        raise SpecError(key, f"{path} cannot be read: {exc.strerror}", source) from None


def _certificates(path: str, source: str, key: str, what: str) -> list[Any]:
    from cryptography import x509  # pyinfra's paramiko requires it: always in k2fleet's environment

    data = _read_pem(path, source, key, f"write {what} there (PEM)")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise SpecError(key, f"{path} holds no PEM certificate (-----BEGIN CERTIFICATE-----); write {what} there", source)
    return certs


def tls_endpoints(plan: Plan) -> list[tuple[str, str]]:
    """(host, fleet address) of every host that serves HTTPS (an API front, the load
    balancer): the address k2fleet's clients call, which the certificate must name."""
    from k2fleet.planning import api_front, load_balancer

    return [(name, hp.address) for name, hp in plan.hosts.items()
            if api_front.has_front(hp) or any(s.name == load_balancer.LB for s in hp.services)]


def check_tls_files(dep: Deployment, plan: Plan, source: str) -> None:
    """``k2_tls_cert_file``, ``k2_tls_key_file``, ``k2_tls_ca_file`` on the control machine
    (the grammar made them all three or none): the key the deploying user's, 0600, an
    unencrypted PEM private key; the certificate's public key the key's; the certificate
    verifying against the CA (chain, validity, server use) for every endpoint host's fleet
    address (:func:`tls_endpoints`: an IP subjectAltName), as each client will check it.
    Raises SpecError naming the key and the fix."""
    if dep.s.tls_cert_file is None or dep.s.tls_key_file is None or dep.s.tls_ca_file is None:
        return
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509 import verification

    cert_path, key_path, ca_path = dep.s.tls_cert_file, dep.s.tls_key_file, dep.s.tls_ca_file
    chain = _certificates(cert_path, source, "k2_tls_cert_file", "the server's certificate (then any intermediates)")
    cas = _certificates(ca_path, source, "k2_tls_ca_file", "the CA certificate the clients verify against")
    check_token_file(key_path, source, key="k2_tls_key_file", what="the certificate's private key")
    data = _read_pem(key_path, source, "k2_tls_key_file", "write the certificate's private key there (PEM)")
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise SpecError("k2_tls_key_file", f"{key_path} is encrypted: HAProxy cannot ask for its passphrase; "
                        f"openssl pkey -in {key_path} -out NEW (umask 077) and name NEW", source) from None
    except (ValueError, Exception) as exc:  # noqa: BLE001 - cryptography raises several kinds on garbage
        raise SpecError("k2_tls_key_file", f"{key_path} is not a PEM private key ({type(exc).__name__}); write "
                        "the key of k2_tls_cert_file there", source) from None
    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if chain[0].public_key().public_bytes(*der) != private.public_key().public_bytes(*der):
        raise SpecError("k2_tls_cert_file", f"{cert_path} is not the certificate of the key in {key_path} (their "
                        "public keys differ; the server's certificate must come first); name the matching pair", source)
    store = verification.Store(cas)
    now = datetime.datetime.now(datetime.timezone.utc)
    for host, address in tls_endpoints(plan):
        verifier = (verification.PolicyBuilder().store(store).time(now)
                    .build_server_verifier(x509.IPAddress(ipaddress.ip_address(address))))
        try:
            verifier.verify(chain[0], chain[1:])
        except verification.VerificationError as exc:
            raise SpecError("k2_tls_cert_file", f"{cert_path} does not verify against k2_tls_ca_file {ca_path} for "
                            f"{address} (host {host}, the address clients call): {' '.join(str(exc).split())[:200]}; "
                            f"issue it from that CA with subjectAltName IP:{address} for every endpoint host", source) from None


def _cli_params() -> dict[str, Any]:
    """The parameters pyinfra's CLI was called with (``inventory``, ``dry``, ...), read in
    the CLI's own greenlet (click's context is greenlet-local under gevent)."""
    try:
        import click

        ctx = click.get_current_context(silent=True)
        return dict(ctx.params) if ctx is not None else {}
    except Exception:  # noqa: BLE001 - not under click
        return {}


def install_pyinfra_gate(state: Any) -> None:
    """Check the inventory inside ``state.init`` (before ``connect_all``); see module doc.

    Installed once per pyinfra run by the repository's ``config.py``.
    """
    if getattr(state, "_k2fleet_gate", False):
        return
    original_init = state.init

    def gated_init(inventory: Any, config: Any, initial_limit: Any = None) -> None:
        params = _cli_params()
        state.k2fleet_dry = bool(params.get("dry"))  # read by k2fleet.deploy.fleet_run: no control step when dry
        source = str(params.get("inventory", "inventory"))
        try:  # kept for k2fleet.deploy.fleet_run: the deploy plans from this, not a second time
            if os.path.isfile(source):
                check_group_conflicts(inventory, source)
            state.k2fleet_checked = check_hosts(source, host_data(inventory))
        except SpecError as exc:
            refuse(exc)
        original_init(inventory, config, initial_limit=initial_limit)

    state.init = gated_init
    state._k2fleet_gate = True
    _gate_inventory_load(state)


def install_at_inventory_load(state: Any, inventory: str) -> None:
    """The gate when pyinfra runs outside the checkout (no ``config.py`` of k2fleet's):
    called by :mod:`k2fleet.deploy.pyinfra_entry` while pyinfra loads ``inventory``, after
    it executed the inventory file and before the group-data files. Those are checked now
    (as :func:`_gate_inventory_load` does), one that raises when pyinfra executes it is the
    same one line naming it, and :func:`install_pyinfra_gate` checks the whole inventory
    in ``State.init`` before any connection."""
    loader = sys.modules.get("pyinfra_cli.inventory")
    if os.path.isfile(inventory):
        try:
            check_group_data(inventory, state.cwd)
            # pyinfra has run the inventory file and is building its hosts: its groups, read
            # again (the same file, run a second time), are checked before pyinfra trips on them
            check_inventory_groups(inventory, loader._get_groups_from_filename(inventory) if loader else {})
        except SpecError as exc:
            refuse(exc)
        except (SystemExit, Exception) as exc:  # noqa: BLE001 - user Python: report, don't trace
            refuse(SpecError("inventory", f"could not be loaded: {load_failure(exc)}", inventory))
    loader = sys.modules.get("pyinfra_cli.inventory")
    if loader is not None and not getattr(loader._get_group_data, "_k2fleet_gate", False):
        original = loader._get_group_data

        def gated_get_group_data(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - user Python in group data: report, don't trace
                problem = SpecError("inventory", f"could not be loaded: {load_failure(exc)}", inventory)
            refuse(problem)

        gated_get_group_data._k2fleet_gate = True  # type: ignore[attr-defined]
        loader._get_group_data = gated_get_group_data
    install_pyinfra_gate(state)


def _gate_inventory_load(state: Any) -> None:
    """pyinfra's CLI loads the inventory (executing its Python and the group-data files)
    before ``State.init``: check the group-data files first and turn a file that raises
    into the same one line naming it (pyinfra printed a traceback, exit 1)."""
    cli = sys.modules.get("pyinfra_cli.cli")
    if cli is None or getattr(cli.make_inventory, "_k2fleet_gate", False):
        return
    original = cli.make_inventory

    def gated_make_inventory(inventory: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if os.path.isfile(str(inventory)):
                check_group_data(str(inventory), kwargs.get("cwd") or state.cwd)
            with checked_groups(str(inventory)):
                return original(inventory, *args, **kwargs)
        except SpecError as exc:
            problem = exc
        except Exception as exc:  # noqa: BLE001 - user Python in the inventory: report, don't trace
            problem = SpecError("inventory", f"could not be loaded: {load_failure(exc)}", str(inventory))
        refuse(problem)

    gated_make_inventory._k2fleet_gate = True  # type: ignore[attr-defined]
    cli.make_inventory = gated_make_inventory
