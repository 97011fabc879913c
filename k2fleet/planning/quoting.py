"""One quoting function per output format k2fleet writes onto hosts (pure, stdlib + PyYAML).

Inventory values are validated when the inventory is loaded; everything rendered into a
systemd unit, an EnvironmentFile, sshd_config / ssh_config / authorized_keys /
known_hosts, a shell line or a YAML document goes through one of these functions as
well, so a value that slipped past validation still cannot add a second directive or
command. A value that the format cannot represent faithfully is refused with
:class:`ValueError` naming what was refused (never echoing the value itself, which may
be a secret).

The rules follow the parsers themselves (systemd 252 ``config_parse_exec``,
``extract_first_word``, ``parse_env_file_internal``; OpenSSH 9.2 ``argv_split``,
``match_user``); ``tests/test_quoting.py`` checks every function against the real
parser (systemd, sshd, sh, PyYAML) with hostile values.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "authorized_keys_from",
    "env_file_line",
    "known_hosts_host",
    "shell_line",
    "shell_word",
    "ssh_config_word",
    "ssh_public_key",
    "ssh_user_name",
    "sshd_allow_user",
    "sshd_config_word",
    "systemd_exec",
    "systemd_value",
    "yaml_document",
]

# Words shlex.quote leaves bare: keeps rendered units byte-identical to the former
# shlex.join rendering for ordinary argv.
_BARE = re.compile(r"[\w@%+=:,./-]+", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_C_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _describe(ch: str) -> str:
    names = {"\n": "newline", "\r": "carriage return", "\x00": "NUL", "\t": "tab", "\x7f": "DEL"}
    return names.get(ch, f"control character U+{ord(ch):04X}")


def _utf8(text: str, what: str) -> None:
    if not isinstance(text, str):
        raise ValueError(f"{what}: expected a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what}: not encodable as UTF-8 (lone surrogate)") from None


def _no_controls(text: str, what: str, allow: str = "") -> None:
    _utf8(text, what)
    for ch in _CONTROL.findall(text):
        if ch not in allow:
            raise ValueError(f"{what}: {_describe(ch)} refused")


def _refuse_chars(text: str, what: str, chars: str) -> None:
    for ch in text:
        if ch in chars:
            raise ValueError(f"{what}: character {ch!r} refused")


def _absolute(text: str, what: str) -> None:
    if not text.startswith("/"):
        raise ValueError(f"{what}: not an absolute path")
    if ".." in text.split("/"):
        raise ValueError(f"{what}: '..' path component refused")


# --------------------------------------------------------------------------- systemd


def _systemd_word(word: str) -> str:
    if _BARE.fullmatch(word):
        return word.replace("%", "%%")
    body = word.replace("%", "%%").replace("$", "$$")
    if "'" not in word and "\\" not in word and not _CONTROL.search(word):
        return f"'{body}'"
    out = []
    for ch in body:
        if ch in _C_ESCAPES:
            out.append(_C_ESCAPES[ch])
        elif _CONTROL.fullmatch(ch):
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def systemd_exec(argv: Sequence[str]) -> str:
    r"""``argv`` as the value of ``ExecStart=`` / ``ExecStartPre=`` (systemd.service(5),
    "Command lines"): one word per argument, quoted when needed, so systemd's
    ``extract_first_word`` gives back exactly ``argv``.

    Plain words stay bare and other words are single-quoted, as ``shlex.join`` writes
    them; a word holding a quote, a backslash or a control character is double-quoted
    with C escapes (systemd unescapes inside both kinds of quotes). ``%`` becomes ``%%``
    (specifiers) and ``$`` becomes ``$$`` (environment expansion). The first word must
    be an absolute path without quotes, backslashes or control characters (systemd
    refuses those); NUL cannot be passed in an argv and is refused.

    >>> print(systemd_exec(["/usr/bin/python3", "-c", "print('%d' % 1)", "$HOME", ";"]))
    /usr/bin/python3 -c "print('%%d' %% 1)" '$$HOME' ';'
    >>> print(systemd_exec(["/bin/echo", "a\nExecStartPre=/bin/sh", "back\\slash", ""]))
    /bin/echo "a\nExecStartPre=/bin/sh" "back\\slash" ''
    >>> systemd_exec(["relative/bin"])
    Traceback (most recent call last):
    ValueError: ExecStart executable: not an absolute path
    """
    if isinstance(argv, str) or not argv:
        raise ValueError("ExecStart: expected a non-empty list of words")
    exe = argv[0]
    what = "ExecStart executable"
    _no_controls(exe, what)
    _absolute(exe, what)
    _refuse_chars(exe, what, "\"'\\")
    if exe.endswith("/"):
        raise ValueError(f"{what}: path names a directory")
    for i, word in enumerate(argv[1:], 1):
        _utf8(word, f"ExecStart argument {i}")
        if "\x00" in word:
            raise ValueError(f"ExecStart argument {i}: NUL refused")
    return " ".join(_systemd_word(w) for w in argv)


def systemd_value(text: str, *, path: bool = False) -> str:
    """``text`` as the whole value of a single-value unit setting (``Description=``,
    ``WorkingDirectory=``, ``EnvironmentFile=``, ``User=``...).

    These settings have no escape for control characters, so any (newline, CR, NUL,
    tab, other C0, DEL) is refused, as are leading/trailing whitespace (systemd strips
    it) and a trailing backslash (it would continue the line onto the next directive).
    ``%`` becomes ``%%`` (all of these settings expand specifiers). ``path=True``
    requires an absolute path without ``..`` (no ``-``/``~`` prefix meanings either).

    >>> systemd_value("k2fleet: vLLM at 90% GPU")
    'k2fleet: vLLM at 90%% GPU'
    >>> systemd_value("/etc/k2fleet/env/k2-vllm.env", path=True)
    '/etc/k2fleet/env/k2-vllm.env'
    >>> systemd_value("/etc/k2fleet\\nExecStartPre=/bin/sh -c id", path=True)
    Traceback (most recent call last):
    ValueError: systemd setting value: newline refused
    """
    what = "systemd setting value"
    _no_controls(text, what)
    if not text:
        raise ValueError(f"{what}: empty value refused")
    if text != text.strip(" "):
        raise ValueError(f"{what}: leading or trailing whitespace refused")
    if text.endswith("\\"):
        raise ValueError(f"{what}: trailing backslash (line continuation) refused")
    if path:
        _absolute(text, f"{what} (path)")
    return text.replace("%", "%%")


def env_file_line(key: str, value: str) -> str:
    r"""``KEY="value"`` for a systemd ``EnvironmentFile=`` (no trailing newline).

    Inside double quotes systemd's env-file parser unescapes ``\"``, ``\\``, ``\`` `` ``
    and ``\$`` and keeps everything else literally — the same as a POSIX shell, so the
    line also means the same when sourced by ``sh``. A newline or CR would end the
    assignment in other parsers and NUL truncates the file: control characters other
    than tab are refused. The key must be ``[A-Za-z_][A-Za-z0-9_]*``.

    >>> print(env_file_line("NCCL_IB_HCA", 'mlx5_0,"x" $HOME `id` \\'))
    NCCL_IB_HCA="mlx5_0,\"x\" \$HOME \`id\` \\"
    >>> env_file_line("BAD KEY", "x")
    Traceback (most recent call last):
    ValueError: environment file key: not a valid variable name
    """
    _utf8(key, "environment file key")
    if not _ENV_KEY.fullmatch(key):
        raise ValueError("environment file key: not a valid variable name")
    _no_controls(value, f"environment file value of {key}", allow="\t")
    escaped = re.sub(r'(["\\`$])', r"\\\1", value)
    return f'{key}="{escaped}"'


# --------------------------------------------------------------------------- OpenSSH

_SSH_REFUSED = "\"'\\"


def _ssh_word(text: str, what: str, expand: bool) -> str:
    _no_controls(text, what)
    if not text:
        raise ValueError(f"{what}: empty token refused")
    # argv_split knows backslash escapes and both quotes, but older OpenSSH releases
    # (strdelim) do not: refuse quotes and backslashes rather than rely on either.
    _refuse_chars(text, what, _SSH_REFUSED)
    if expand:
        _refuse_chars(text, what, "$")  # ${VAR} expansion has no escape
        text = text.replace("%", "%%")
    if re.search(r"[ #=]", text):
        return f'"{text}"'
    return text


def sshd_config_word(text: str, *, expand: bool = False) -> str:
    """One argument token of an ``sshd_config`` line.

    Tokens with a space, ``#`` (a comment when a token starts with it) or ``=`` (the
    keyword separator) are double-quoted; quotes, backslashes and control characters
    are refused. ``expand=True`` for arguments sshd %-expands (``AuthorizedKeysFile``):
    ``%`` becomes ``%%``.

    >>> sshd_config_word("/etc/k2fleet/mesh/ssh_host_ed25519_key")
    '/etc/k2fleet/mesh/ssh_host_ed25519_key'
    >>> sshd_config_word("/srv/k2 fleet/#1/authorized_keys", expand=True)
    '"/srv/k2 fleet/#1/authorized_keys"'
    >>> sshd_config_word("root\\nAllowUsers *")
    Traceback (most recent call last):
    ValueError: sshd_config token: newline refused
    """
    return _ssh_word(text, "sshd_config token", expand)


def ssh_config_word(text: str, *, expand: bool = False) -> str:
    """One argument token of an ``ssh_config`` line (``ssh -F``); same rules as
    :func:`sshd_config_word`. ``expand=True`` for arguments ssh %- and ${}-expands
    (``IdentityFile``, ``UserKnownHostsFile``): ``%`` becomes ``%%`` and ``$`` is
    refused (``${VAR}`` has no escape).

    >>> ssh_config_word("/etc/k2fleet/mesh/id_ed25519", expand=True)
    '/etc/k2fleet/mesh/id_ed25519'
    >>> ssh_config_word("/etc/k2fleet/100%/known_hosts", expand=True)
    '/etc/k2fleet/100%%/known_hosts'
    """
    return _ssh_word(text, "ssh_config token", expand)


def ssh_user_name(user: str) -> str:
    """A user name for ``ssh_config`` ``User`` and the user part of sshd ``AllowUsers``.

    Refuses what would turn the name into a pattern or an expansion: ``* ? !`` (sshd
    wildcards / negation), ``@`` and ``,`` (host part, pattern lists), ``%`` and ``$``
    (newer ssh expands them in ``User``), whitespace, quotes, backslashes, control
    characters, and a leading ``-``.

    >>> ssh_user_name("k2mesh")
    'k2mesh'
    >>> ssh_user_name("*")
    Traceback (most recent call last):
    ValueError: SSH user name: character '*' refused
    """
    what = "SSH user name"
    _no_controls(user, what)
    if not user:
        raise ValueError(f"{what}: empty name refused")
    _refuse_chars(user, what, "*?!@,%$ #=" + _SSH_REFUSED)
    if user.startswith("-"):
        raise ValueError(f"{what}: leading '-' refused")
    return user


def _ssh_address(address: str, what: str) -> str:
    _no_controls(address, what)
    if not address:
        raise ValueError(f"{what}: empty address refused")
    _refuse_chars(address, what, "*?!@,%$ #=[]" + _SSH_REFUSED)
    return address


def sshd_allow_user(user: str, address: str) -> str:
    """One ``AllowUsers`` token: exactly ``user`` connecting from exactly ``address``.

    Wildcards (``* ?``), negation (``!``), pattern lists (``,``), a second ``@`` and
    whitespace are refused in either part.

    >>> sshd_allow_user("root", "10.0.0.2")
    'root@10.0.0.2'
    >>> sshd_allow_user("root", "10.0.0.2 *")
    Traceback (most recent call last):
    ValueError: AllowUsers address: character ' ' refused
    """
    return f"{ssh_user_name(user)}@{_ssh_address(address, 'AllowUsers address')}"


def authorized_keys_from(addresses: Iterable[str]) -> str:
    """The ``from="..."`` option of an ``authorized_keys`` line for exactly ``addresses``.

    Each address may not hold ``"`` (ends the option), ``,`` (adds a pattern), ``* ? !``
    (wildcard / negation), whitespace or control characters.

    >>> authorized_keys_from(["10.0.0.1", "10.0.0.2"])
    'from="10.0.0.1,10.0.0.2"'
    >>> authorized_keys_from(['10.0.0.1" command="id'])
    Traceback (most recent call last):
    ValueError: authorized_keys from= address: character '"' refused
    """
    addresses = list(addresses)
    if not addresses:
        raise ValueError("authorized_keys from=: no address")
    return 'from="' + ",".join(_ssh_address(a, "authorized_keys from= address") for a in addresses) + '"'


def ssh_public_key(text: str) -> str:
    """One OpenSSH public key line (``type base64 [comment]``), stripped; anything that
    would make it two lines or change its options is refused.

    >>> ssh_public_key("ssh-ed25519 AAAAC3Nza k2fleet-mesh\\n")
    'ssh-ed25519 AAAAC3Nza k2fleet-mesh'
    >>> ssh_public_key("ssh-ed25519 AAAA x\\nssh-ed25519 BBBB evil")
    Traceback (most recent call last):
    ValueError: SSH public key: newline refused
    """
    what = "SSH public key"
    text = text.strip()
    _no_controls(text, what)
    fields = text.split(" ")
    if len(fields) < 2 or not re.fullmatch(r"[A-Za-z0-9@.-]+", fields[0]) or not re.fullmatch(r"[A-Za-z0-9+/=]+", fields[1]):
        raise ValueError(f"{what}: not 'type base64 [comment]'")
    return text


def known_hosts_host(address: str, port: int) -> str:
    """The host field ``[address]:port`` of a ``known_hosts`` line, for exactly one host
    (no pattern: ``* ? ! , [ ]``, whitespace, ``#``, quotes and control characters are
    refused).

    >>> known_hosts_host("10.0.0.1", 2233)
    '[10.0.0.1]:2233'
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError("known_hosts port: not a port number")
    return f"[{_ssh_address(address, 'known_hosts address')}]:{port}"


# --------------------------------------------------------------------------- shell, YAML


def shell_word(text: str) -> str:
    """``text`` as one POSIX sh word (``shlex.quote``); NUL cannot be in a word.

    >>> shell_word("$(id); rm -rf / #")
    "'$(id); rm -rf / #'"
    """
    _utf8(text, "shell word")
    if "\x00" in text:
        raise ValueError("shell word: NUL refused")
    return shlex.quote(text)


def shell_line(argv: Sequence[str]) -> str:
    """``argv`` as one POSIX sh command line (``shlex.join``); NUL refused.

    >>> print(shell_line(["printf", "%s", "it's $(id)"]))
    printf %s 'it'"'"'s $(id)'
    """
    if isinstance(argv, str):
        raise ValueError("shell line: expected a list of words")
    return " ".join(shell_word(w) for w in argv)


def yaml_document(obj: Any) -> str:
    """``obj`` as a YAML document that ``yaml.safe_load`` reads back equal (keys kept
    in order, block style).

    >>> print(yaml_document({"b": "x: y\\n- z", "a": [1, "#"]}), end="")
    b: 'x: y
    <BLANKLINE>
      - z'
    a:
    - 1
    - '#'
    """
    import yaml  # PyYAML: a k2fleet dependency; imported here to keep this module light

    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)


def curl_line(base: str, model: str, api_key_file: str | None = None, ca_file: str | None = None) -> str:
    """A chat completion to paste; with ``api_key_file`` the key is read from that file when
    the line runs (never printed); with ``ca_file`` (an ``https://`` base) curl verifies the
    server against that CA (``--cacert``).

    >>> print(curl_line("http://10.0.0.1:8000/v1", "moonshotai/Kimi-K2-Thinking"))
    curl -s http://10.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "moonshotai/Kimi-K2-Thinking", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 256}'
    """
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 256})
    auth = f" -H \"Authorization: Bearer $(cat {shell_line([api_key_file])})\"" if api_key_file else ""
    ca = f" --cacert {shell_line([ca_file])}" if ca_file else ""
    return f"curl -s{ca} {base}/chat/completions -H 'Content-Type: application/json'{auth} -d {shell_line([body])}"
