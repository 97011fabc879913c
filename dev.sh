#!/usr/bin/env bash
# k2fleet developer entry point on a fresh Debian 12 machine (run as root):
#   ./dev.sh demo   set up, bring up the 3-host sandbox fleet, deploy Kimi-K2 (test doubles) to it
#   ./dev.sh test   set up, run the whole test suite (sandbox end-to-end tests included)
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv

setup() {
  export DEBIAN_FRONTEND=noninteractive
  if ! dpkg -s debootstrap systemd systemd-container iproute2 openssh-client openssh-server dash rsync openmpi-bin python3-mpi4py apt-utils python3-venv nftables haproxy prometheus sudo dnsmasq-base >/dev/null 2>&1; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends debootstrap systemd systemd-container iproute2 openssh-client openssh-server dash \
      rsync openmpi-bin python3-mpi4py apt-utils python3-venv nftables haproxy prometheus sudo dnsmasq-base ca-certificates >/dev/null
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
    python -m pytest -q -p no:cacheprovider --durations=30 "$@"
    ;;
  *)
    echo "usage: $0 demo|test" >&2
    exit 2
    ;;
esac
