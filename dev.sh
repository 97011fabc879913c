#!/usr/bin/env bash
# k2fleet developer entry point on a fresh Debian 12 machine (run as root):
#   ./dev.sh demo   set up, bring up the 3-host sandbox fleet, deploy Kimi-K2 (test doubles) to it
#   ./dev.sh test   set up, run the whole test suite (sandbox end-to-end tests included)
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv

# Every Debian package the demo and the whole suite use on this machine, installed up front in
# one apt-get (nothing is apt-get installed in the middle of a test run): the sandbox (debootstrap,
# systemd-nspawn, iproute2, OpenSSH), the real tools tests drive (sudo, dash, nft, haproxy,
# prometheus/promtool, dnsmasq, OpenMPI), strace, and dpkg-dev (dpkg-scanpackages, for the
# bundle's and the NVIDIA test doubles' apt repositories).
PACKAGES="debootstrap systemd systemd-container iproute2 openssh-client openssh-server dash rsync openmpi-bin
  python3-mpi4py apt-utils python3-venv nftables haproxy prometheus sudo dnsmasq-base ca-certificates strace dpkg-dev"
# Debian's ubuntu-keyring (the Ubuntu archive's key, for bundles of Ubuntu hosts) is not in every
# release's archive (bookworm's has none): installed where the archive carries it.
OPTIONAL_PACKAGES="ubuntu-keyring"

setup() {
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086 # the package lists are word lists
  if ! dpkg -s $PACKAGES >/dev/null 2>&1; then
    apt-get update -qq
    optional=""
    for pkg in $OPTIONAL_PACKAGES; do
      # madison lists only versions apt can install (`apt-cache show` also succeeds for a name
      # the archive merely mentions, e.g. bookworm's ubuntu-keyring, and then the install fails)
      if [ -n "$(apt-cache madison "$pkg" 2>/dev/null)" ]; then optional="$optional $pkg"; fi
    done
    apt-get install -y -qq --no-install-recommends $PACKAGES $optional >/dev/null
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[test]'
  # the checkout's bytecode, as pip writes it for an installed package (an editable install
  # gets none, and with PYTHONDONTWRITEBYTECODE set every pyinfra run would compile k2fleet again)
  "$VENV/bin/python" -m compileall -q k2fleet k2sandbox >/dev/null
  export PATH="$PWD/$VENV/bin:$PATH"
}

case "${1:-}" in
  demo)
    setup
    k2fleet sandbox up 3 --gpus h200
    python -m k2sandbox.checkpoint_cache >/dev/null
    pyinfra -y inventories/sandbox.py deploys/kimi.py
    ;;
  test)
    setup
    shift
    # two xdist workers, each with its own sandbox fleet (worker gwN: sandbox instance N), each
    # test module on one worker; the modules that change what the whole machine shares
    # (tests/conftest.py MACHINE_MODULES) on the first (tests/test_xdist_groups.py); three were
    # slower on 2 cores, 47.5 vs 40.5 min (docs/testing.md); `./dev.sh test -n 0`: one process
    python -m pytest -q -p no:cacheprovider --durations=30 -n 2 --dist loadgroup "$@"
    ;;
  *)
    echo "usage: $0 demo|test" >&2
    exit 2
    ;;
esac
