"""k2fleet.planning.quoting against each format's own parser, with hostile values.

Real parsers: systemd 252 (``systemd --test --user`` dumps every unit it loaded, argv
included, without a running manager; ``systemd-analyze verify``), sshd (``sshd -t`` /
``sshd -T``), sh/dash (``-n`` and running ``printf``), PyYAML, and for environment files
systemd's ``environment.d`` generator (same parser as ``EnvironmentFile=``) plus ``sh``
sourcing the file plus a port of ``parse_env_file_internal``.

Debian packages: systemd (systemd, systemd-analyze, environment-d generator),
openssh-server (sshd), openssh-client (ssh-keygen), dash. Tests needing a binary skip
only when it is missing.
"""

from __future__ import annotations

import dataclasses
import doctest
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from k2fleet.planning import engine_cache
from k2fleet.planning import mesh_config, quoting, units
from k2fleet.planning.quoting import (
    authorized_keys_from,
    env_file_line,
    known_hosts_host,
    shell_line,
    shell_word,
    ssh_config_word,
    ssh_public_key,
    ssh_user_name,
    sshd_allow_user,
    sshd_config_word,
    systemd_exec,
    systemd_value,
    yaml_document,
)

HOSTILE = {
    "newline": "a\nb",
    "injected directive": "x\nExecStartPre=/bin/sh -c id",
    "CR": "a\rb",
    "double quote": 'a"b',
    "single quote": "a'b",
    "dollar": "a$b",
    "dollar brace": "${HOME}",
    "command substitution": "$(id)",
    "backtick": "`id`",
    "percent": "100%",
    "specifier": "%n",
    "semicolon": ";",
    "and-and": "&&",
    "backslash": "a\\b",
    "backslash n": "a\\nb",
    "trailing backslash": "a\\",
    "space": "a b",
    "leading space": " a",
    "hash": "#",
    "hash word": "a #b",
    "tab": "a\tb",
    "NUL": "a\x00b",
    "DEL": "a\x7fb",
    "escape": "a\x1bb",
    "unicode": "ünïcødé €😀",
    "empty": "",
    "equals": "=a",
}
CONTROL = {"newline", "injected directive", "CR", "tab", "NUL", "DEL", "escape"}
ON_PATH = "/srv/k2 test/"  # hostile values become the last component of a path

SYSTEMD = shutil.which("systemd") or next((p for p in ("/lib/systemd/systemd", "/usr/lib/systemd/systemd") if os.path.exists(p)), None)
ENV_GENERATOR = next(
    (p for p in ("/usr/lib/systemd/user-environment-generators/30-systemd-environment-d-generator",
                 "/lib/systemd/user-environment-generators/30-systemd-environment-d-generator") if os.path.exists(p)),
    None,
)
needs = {
    "systemd": pytest.mark.skipif(SYSTEMD is None, reason="systemd not installed (Debian package systemd)"),
    "systemd-analyze": pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="Debian package systemd"),
    "sshd": pytest.mark.skipif(shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"),
                               reason="Debian package openssh-server"),
    "ssh-keygen": pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="Debian package openssh-client"),
    "dash": pytest.mark.skipif(shutil.which("dash") is None, reason="Debian package dash"),
    "env-generator": pytest.mark.skipif(ENV_GENERATOR is None, reason="Debian package systemd"),
}


def test_doctests() -> None:
    assert doctest.testmod(quoting).failed == 0


# --------------------------------------------------------------------------- helpers: systemd


def _decode_systemd_quoted(text: str) -> list[str]:
    """Words of systemd's ``quote_command_line`` / ``shell_maybe_quote`` output."""
    words, i = [], 0
    while i < len(text):
        if text[i] == " ":
            i += 1
            continue
        out = bytearray()
        if text[i] != '"':
            j = text.find(" ", i)
            j = len(text) if j < 0 else j
            words.append(text[i:j])
            i = j
            continue
        i += 1
        while text[i] != '"':
            ch = text[i]
            if ch == "\\":
                nxt = text[i + 1]
                simple = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}
                if nxt in simple:
                    out.append(simple[nxt])
                    i += 2
                elif nxt in "01234567":
                    out.append(int(text[i + 1 : i + 4], 8))
                    i += 4
                else:
                    out += nxt.encode()
                    i += 2
            else:
                out += ch.encode()
                i += 1
        words.append(out.decode())
        i += 1
    return words


def _systemd_dump(tmp: Path, units_text: dict[str, str]) -> dict[str, list[str]]:
    """Load ``units_text`` (name → unit file) with the real systemd (``--test --user``:
    parse, build the start-up transaction, dump, exit) and return each unit's dump lines."""
    # pytest's tmp_path sits in a root-only directory; the manager may run as nobody
    tmp_path = Path(tempfile.mkdtemp(prefix="k2q-systemd-"))
    try:
        return _systemd_dump_in(tmp_path, units_text)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _systemd_dump_in(tmp_path: Path, units_text: dict[str, str]) -> dict[str, list[str]]:
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    names = sorted(units_text)
    (unit_dir / "k2q-all.target").write_text("[Unit]\nDescription=all\nWants=" + " ".join(names) + "\n")
    for name, text in units_text.items():
        (unit_dir / name).write_text(text)
    env = {"SYSTEMD_UNIT_PATH": f"{unit_dir}:", "XDG_RUNTIME_DIR": str(tmp_path), "HOME": str(tmp_path),
           "SYSTEMD_LOG_TARGET": "console", "SYSTEMD_LOG_LEVEL": "info", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    argv = [SYSTEMD, "--test", "--user", "--unit=k2q-all.target", "--no-pager"]
    if os.geteuid() == 0:  # a user manager refuses to run as root: drop to nobody
        nobody = pwd.getpwnam("nobody")
        for p in [tmp_path, *tmp_path.rglob("*")]:
            os.chown(p, nobody.pw_uid, nobody.pw_gid)
        argv = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups", *argv]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert "-> Unit k2q-all.target:" in out, out[-3000:]
    dumps: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        m = re.fullmatch(r"\t-> Unit (.+):", line)
        if m:
            current = m.group(1) if m.group(1) in units_text else None
            if current:
                dumps[current] = []
        elif current:
            dumps[current].append(line)
    problems = [l for l in out.splitlines() if "k2q-" in l and re.search(r"Unknown|[Ii]nvalid|Unbalanced|[Ii]gnoring|Failed", l)]
    assert not problems, problems
    assert set(dumps) == set(units_text), out[-3000:]
    return dumps


def _dump_commands(lines: list[str], kind: str) -> list[list[str]]:
    cmds, take = [], False
    for line in lines:
        if line.strip().startswith("-> "):
            take = line.strip() == f"-> {kind}:"
        elif take and line.strip().startswith("Command Line: "):
            cmds.append(_decode_systemd_quoted(line.split("Command Line: ", 1)[1]))
    return cmds


def _dump_field(lines: list[str], field: str) -> list[str]:
    return [l.split(": ", 1)[1] for l in lines if l.startswith(f"\t\t{field}: ")]


def _env_expand(word: str) -> str:
    """systemd's exec-time environment expansion for a word that holds only ``$$``."""
    assert re.fullmatch(r"(?:[^$]|\$\$)*", word), f"unescaped $ in {word!r}"
    return word.replace("$$", "$")


def _directives(unit_text: str) -> list[str]:
    """Keys of a unit file the way systemd's line reader sees them (\\n, \\r, NUL end a
    line; a trailing backslash continues it; # and ; start comments)."""
    keys, cont = [], ""
    for raw in re.split(r"\r\n|\n\r|[\n\r\x00]", unit_text):
        line = cont + raw
        stripped = line.strip()
        if not cont and (not stripped or stripped[0] in "#;"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2:
            cont = line[:-1] + " "
            continue
        cont = ""
        if stripped.startswith("["):
            keys.append(stripped)
        else:
            keys.append(stripped.split("=", 1)[0].strip())
    return keys


# --------------------------------------------------------------------------- systemd_exec / systemd_value


def test_systemd_exec_keeps_shlex_output_for_ordinary_words() -> None:
    argv = ["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/k2",
            "--served-model-name", "kimi-k2", "--gpu-memory-utilization", "0.9", "--json", '{"a": 1}', "a b"]
    import shlex
    assert systemd_exec(argv) == shlex.join(argv)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_systemd_exec_words_parse_back_exactly_or_are_refused(name: str) -> None:
    value = HOSTILE[name]
    if "\x00" in value:
        with pytest.raises(ValueError, match="NUL"):
            systemd_exec(["/bin/true", value])
        return
    line = "ExecStart=" + systemd_exec(["/bin/true", value, "tail"])
    assert _directives(f"[Service]\n{line}\n") == ["[Service]", "ExecStart"]


@pytest.mark.parametrize("exe", ["bin/true", "-/bin/true", "@/bin/true", "/bin/tr\nue", "/bin/'x", '/bin/"x', "/bin/x\\y", "/bin/", "/x/../bin/sh", ""])
def test_systemd_exec_refuses_bad_executables(exe: str) -> None:
    with pytest.raises(ValueError):
        systemd_exec([exe, "x"])
    with pytest.raises(ValueError):
        systemd_exec([])


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_systemd_value_refuses_or_escapes(name: str) -> None:
    value = "k2fleet: " + HOSTILE[name] + " end"
    if name in CONTROL:
        with pytest.raises(ValueError, match=r"refused") as err:
            systemd_value(value)
        assert HOSTILE[name] not in str(err.value) or not HOSTILE[name].strip()
        with pytest.raises(ValueError):
            systemd_value(ON_PATH + HOSTILE[name], path=True)
        return
    rendered = systemd_value(value)
    assert _directives(f"[Unit]\nDescription={rendered}\n") == ["[Unit]", "Description"]
    assert rendered.replace("%%", "") .count("%") == 0


@pytest.mark.parametrize("bad", ["", " lead", "trail ", "trail\\", "rel/path", "-/optional", "~/home", "/a/../b"])
def test_systemd_value_refusals(bad: str) -> None:
    with pytest.raises(ValueError):
        systemd_value(bad, path=True)


@needs["systemd"]
def test_real_systemd_parses_hostile_words_and_values_back(tmp_path: Path) -> None:
    """One unit per hostile value: ExecStartPre/ExecStart argv, Description,
    WorkingDirectory and EnvironmentFile as systemd itself loads them."""
    unit_texts, expected = {}, {}
    for i, (name, value) in enumerate(sorted(HOSTILE.items())):
        if "\x00" in value:
            continue
        argv = ["/bin/echo", value, f"{value}{value}", "-", value + " x"]
        lines = ["[Unit]", f"Description={systemd_value('k2q ' + value + ' end')}" if name not in CONTROL else "Description=k2q",
                 "", "[Service]", "Type=oneshot", f"ExecStartPre={systemd_exec(argv)}", f"ExecStart={systemd_exec(['/bin/true', value])}"]
        if name not in CONTROL and not value.endswith("\\"):
            lines += [f"WorkingDirectory={systemd_value(ON_PATH + value, path=True)}",
                      f"EnvironmentFile={systemd_value(ON_PATH + value + '.env', path=True)}"]
        unit = f"k2q-{i}.service"
        unit_texts[unit] = "\n".join(lines) + "\n"
        expected[unit] = (name, value, argv)
    dumps = _systemd_dump(tmp_path, unit_texts)
    for unit, (name, value, argv) in expected.items():
        lines = dumps[unit]
        pre = _dump_commands(lines, "ExecStartPre")
        start = _dump_commands(lines, "ExecStart")
        assert [[_env_expand(w) for w in c] for c in pre] == [argv], name
        assert [[_env_expand(w) for w in c] for c in start] == [["/bin/true", value]], name
        if name not in CONTROL:
            assert _dump_field(lines, "Description") == [f"k2q {value} end"], name
        if name not in CONTROL and not value.endswith("\\"):
            assert _dump_field(lines, "WorkingDirectory") == [(ON_PATH + value).rstrip("/")], name  # systemd drops a trailing /
            assert _dump_field(lines, "EnvironmentFile") == [ON_PATH + value + ".env"], name


@needs["systemd-analyze"]
def test_systemd_analyze_verify_accepts_hostile_unit(tmp_path: Path) -> None:
    argv = ["/bin/echo"] + [v for v in HOSTILE.values() if "\x00" not in v]
    start = systemd_exec(["/bin/true", ";", "\\;", "$(id)", "a'b"])
    text = "\n".join([
        "[Unit]", f"Description={systemd_value('k2q 100% $x ; # `id` ünï')}", "",
        "[Service]", "Type=oneshot", f"ExecStartPre={systemd_exec(argv)}",
        f"ExecStart={start}",
        f"WorkingDirectory={systemd_value('/tmp/a b %n #x', path=True)}",
        f"EnvironmentFile={systemd_value('/tmp/k2 env %n.env', path=True)}", "",
        "[Install]", "WantedBy=multi-user.target", "",
    ])
    path = tmp_path / "k2-test.service"
    path.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=120)
    mine = [l for l in (proc.stdout + proc.stderr).splitlines() if "k2-test.service" in l]
    assert not [l for l in mine if re.search(r"Unknown|[Ii]nvalid|Unbalanced|[Ii]gnoring", l)], mine
    assert proc.returncode == 0, proc.stdout + proc.stderr  # verify itself accepts the unit
    broken = tmp_path / "k2-broken.service"  # and the check can fail: a quoting error is seen
    broken.write_text(text.replace(f"ExecStart={start}", 'ExecStart=/bin/true "unbalanced'))
    bad = subprocess.run(["systemd-analyze", "verify", "--man=no", str(broken)], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 or re.search(r"[Ii]nvalid|Unbalanced|[Ii]gnoring", bad.stdout + bad.stderr), bad
    assert _directives(text) == ["[Unit]", "Description", "[Service]", "Type", "ExecStartPre", "ExecStart",
                                 "WorkingDirectory", "EnvironmentFile", "[Install]", "WantedBy"]


# --------------------------------------------------------------------------- env files


def _parse_env_file(text: str) -> dict[str, str]:
    """Port of systemd 252 ``parse_env_file_internal`` (src/basic/env-file.c)."""
    out: dict[str, str] = {}
    state, key, value = "PRE_KEY", "", None
    last_vw: int | None = None
    last_kw: int | None = None

    def push() -> None:
        k = key if last_kw is None else key[:last_kw]
        out[k] = value if value is not None else ""

    for c in text.split("\x00", 1)[0]:
        if state == "PRE_KEY":
            if c in "#;":
                state = "COMMENT"
            elif c not in " \t\n\r":
                state, key, last_kw = "KEY", c, None
        elif state == "KEY":
            if c in "\n\r":
                state, key = "PRE_KEY", ""
            elif c == "=":
                state, last_vw = "PRE_VALUE", None
            else:
                if c not in " \t\n\r":
                    last_kw = None
                elif last_kw is None:
                    last_kw = len(key)
                key += c
        elif state == "PRE_VALUE":
            if c in "\n\r":
                push()
                state, key, value = "PRE_KEY", "", None
            elif c == "'":
                state = "SQ"
            elif c == '"':
                state = "DQ"
            elif c == "\\":
                state = "VALUE_ESCAPE"
            elif c not in " \t\n\r":
                state, value = "VALUE", (value or "") + c
        elif state == "VALUE":
            if c in "\n\r":
                if last_vw is not None:
                    value = value[:last_vw]
                push()
                state, key, value = "PRE_KEY", "", None
            elif c == "\\":
                state, last_vw = "VALUE_ESCAPE", None
            else:
                if c not in " \t\n\r":
                    last_vw = None
                elif last_vw is None:
                    last_vw = len(value or "")
                value = (value or "") + c
        elif state == "VALUE_ESCAPE":
            state = "VALUE"
            if c not in "\n\r":
                value = (value or "") + c
        elif state == "SQ":
            if c == "'":
                state = "PRE_VALUE"
            else:
                value = (value or "") + c
        elif state == "DQ":
            if c == '"':
                state = "PRE_VALUE"
            elif c == "\\":
                state = "DQ_ESCAPE"
            else:
                value = (value or "") + c
        elif state == "DQ_ESCAPE":
            state = "DQ"
            if c in '"\\`$':
                value = (value or "") + c
            elif c != "\n":
                value = (value or "") + "\\" + c
        elif state == "COMMENT":
            if c == "\\":
                state = "COMMENT_ESCAPE"
            elif c in "\n\r":
                state = "PRE_KEY"
        elif state == "COMMENT_ESCAPE":
            state = "COMMENT"
    if state in ("PRE_VALUE", "VALUE", "VALUE_ESCAPE", "SQ", "DQ", "DQ_ESCAPE"):
        if state == "VALUE" and last_vw is not None:
            value = value[:last_vw]
        push()
    return out


ENV_REFUSED = CONTROL - {"tab"}


def _env_text() -> tuple[str, dict[str, str]]:
    values = {f"K2Q_{i}": v for i, (n, v) in enumerate(sorted(HOSTILE.items())) if n not in ENV_REFUSED}
    return "\n".join(env_file_line(k, v) for k, v in values.items()) + "\nK2Q_LAST=end\n", values | {"K2Q_LAST": "end"}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_env_file_line_round_trips_or_refuses(name: str) -> None:
    value = HOSTILE[name]
    if name in ENV_REFUSED:
        with pytest.raises(ValueError, match="refused") as err:
            env_file_line("K2Q", value)
        assert "K2Q" in str(err.value)
        return
    line = env_file_line("K2Q", value)
    assert "\n" not in line
    assert _parse_env_file(line + "\nNEXT=1\n") == {"K2Q": value, "NEXT": "1"}


@pytest.mark.parametrize("key", ["", "1A", "A-B", "A B", "A=B", "A\nB", "ü"])
def test_env_file_key_refused(key: str) -> None:
    with pytest.raises(ValueError, match="key"):
        env_file_line(key, "x")


def test_env_file_sourced_by_sh_gives_the_same_values(tmp_path: Path) -> None:
    text, values = _env_text()
    path = tmp_path / "k2q.env"
    path.write_text(text)
    script = f". {shell_word(str(path))}; " + "; ".join(f'printf "%s\\0" "${k}"' for k in values)
    out = subprocess.run(["sh", "-c", script], capture_output=True, timeout=30, check=True).stdout
    assert out.decode().split("\x00")[:-1] == list(values.values())


@needs["env-generator"]
def test_env_file_parsed_by_systemd_environment_d_generator(tmp_path: Path) -> None:
    """The environment.d generator reads files with systemd's env-file parser (then
    expands ``$VAR``, which EnvironmentFile= does not: values with ``$`` are left to the
    port above)."""
    text, values = _env_text()
    values = {k: v for k, v in values.items() if "$" not in v and v}  # empty: the generator drops it
    text = "\n".join(l for l in text.splitlines() if l.split("=", 1)[0] in values) + "\n"
    conf = tmp_path / "environment.d"
    conf.mkdir()
    (conf / "k2q.conf").write_text(text)
    env = {"XDG_CONFIG_HOME": str(tmp_path), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([ENV_GENERATOR], env=env, capture_output=True, text=True, timeout=30, check=True).stdout
    got = {}
    for line in out.splitlines():
        k, _, v = line.partition("=")
        if k.startswith("K2Q_"):
            words = _decode_systemd_quoted(v) if v.startswith('"') else [v]
            got[k] = words[0] if words else ""
    assert got == values
    assert _parse_env_file(text) == values


# --------------------------------------------------------------------------- sshd / ssh


SSH_OK = {"space", "leading space", "hash", "hash word", "semicolon", "and-and", "dollar", "dollar brace",
          "command substitution", "backtick", "percent", "specifier", "unicode", "equals"}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_ssh_words_refuse_or_quote(name: str) -> None:
    value = HOSTILE[name]
    for fn in (sshd_config_word, ssh_config_word):
        if name in SSH_OK:
            word = fn("/k2/" + value)
            assert "\n" not in word and "\r" not in word
        else:
            with pytest.raises(ValueError):
                fn("/k2/" + value if value else "")
    with pytest.raises(ValueError):
        ssh_config_word("/k2/$x", expand=True)
    if name not in {"unicode", "semicolon", "and-and", "backtick"}:  # odd but inert in a user name
        with pytest.raises(ValueError):
            sshd_allow_user(value, "10.0.0.1")
    if name not in {"unicode", "semicolon", "and-and", "backtick", "dollar brace", "dollar", "command substitution", "percent", "specifier"}:
        with pytest.raises(ValueError):
            sshd_allow_user("root", value)


@pytest.mark.parametrize("bad_user", ["*", "r?ot", "!root", "root@*", "a,b", "-oProxy", "a b", "a\nb", "%u", "$x", ""])
def test_ssh_user_name_refuses_patterns(bad_user: str) -> None:
    with pytest.raises(ValueError):
        ssh_user_name(bad_user)
    with pytest.raises(ValueError):
        sshd_allow_user(bad_user, "10.0.0.1")


@pytest.mark.parametrize("bad", ["*", "10.0.0.*", "!10.0.0.1", "10.0.0.1,*", '10.0.0.1"', "a b", "a\nb", ""])
def test_ssh_addresses_refuse_patterns(bad: str) -> None:
    for call in (lambda: sshd_allow_user("root", bad), lambda: authorized_keys_from(["10.0.0.1", bad]),
                 lambda: known_hosts_host(bad, 22)):
        with pytest.raises(ValueError):
            call()


def test_ssh_public_key_single_line() -> None:
    assert ssh_public_key("ssh-ed25519 AAAA c\n") == "ssh-ed25519 AAAA c"
    for bad in ["ssh-ed25519 AAAA\nssh-rsa BBBB", "ssh-ed25519", 'command="id" ssh-ed25519 AAAA', "ssh-ed25519 AA\x00AA", "ssh-ed25519 A\rA"]:
        with pytest.raises(ValueError):
            ssh_public_key(bad)
    with pytest.raises(ValueError):
        known_hosts_host("10.0.0.1", 0)


@pytest.fixture()
def sshd_setup(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd -t wants its privilege separation dir
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "hostkey")], check=True)
    return tmp_path


def _sshd(config: Path, *args: str) -> subprocess.CompletedProcess:
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    return subprocess.run([sshd, *args, "-f", str(config)], capture_output=True, text=True, timeout=30)


@needs["sshd"]
@needs["ssh-keygen"]
def test_real_sshd_reads_exactly_the_allowed_users(sshd_setup: Path) -> None:
    users = ["root", "k2;mesh", "k2&&x", "ünï", "a#b"[0:1], "x(id)", "`id`"]
    addresses = ["192.0.2.1", "10.0.0.0/8", "host;x", "h`id`"]
    allow = [sshd_allow_user(u, a) for u in users for a in addresses]
    weird_dir = sshd_setup / "k2 #dir %h=x"
    text = "\n".join([
        f"HostKey {sshd_config_word(str(sshd_setup / 'hostkey'))}",
        f"AuthorizedKeysFile {sshd_config_word(str(weird_dir / 'authorized_keys'), expand=True)}",
        f"PidFile {sshd_config_word(str(weird_dir / 'pid'))}",
        f"AllowUsers {' '.join(allow)}",
        "PasswordAuthentication no", "",
    ])
    config = sshd_setup / "sshd_config"
    config.write_text(text)
    assert _sshd(config, "-t").returncode == 0, _sshd(config, "-t").stderr
    dump = _sshd(config, "-T", "-C", "user=root,host=x,addr=192.0.2.1")
    assert dump.returncode == 0, dump.stderr
    got = [l.split(" ", 1)[1] for l in dump.stdout.splitlines() if l.startswith("allowusers ")]
    assert got == allow
    akf = [l.split(" ", 1)[1] for l in dump.stdout.splitlines() if l.startswith("authorizedkeysfile ")]
    assert akf == [str(weird_dir / "authorized_keys").replace("%", "%%")]
    pid = [l.split(" ", 1)[1] for l in dump.stdout.splitlines() if l.startswith("pidfile ")]
    assert pid == [str(weird_dir / "pid")]


@needs["sshd"]
@needs["ssh-keygen"]
def test_real_sshd_on_rendered_mesh_config_with_hostile_dir(sshd_setup: Path) -> None:
    dep = _mesh_dep(config_dir=str(sshd_setup / "k2 #cfg; x"))
    text = mesh_config.sshd_config(dep, dep.fleet.hosts[0])
    text = re.sub(r"(?m)^ListenAddress .*$", "ListenAddress 127.0.0.1", text)
    text = re.sub(r"(?m)^HostKey .*$", f"HostKey {sshd_setup / 'hostkey'}", text)
    text = re.sub(r"(?m)^PidFile .*$", f"PidFile {sshd_setup / 'pid'}", text)
    config = sshd_setup / "mesh_sshd_config"
    config.write_text(text)
    dump = _sshd(config, "-T", "-C", "user=root,host=x,addr=192.0.2.70")
    assert dump.returncode == 0, dump.stderr
    got = [l.split(" ", 1)[1] for l in dump.stdout.splitlines() if l.startswith("allowusers ")]
    assert got == [f"{dep.s.mesh_user}@{h.address}" for h in dep.fleet.hosts]
    akf = [l.split(" ", 1)[1] for l in dump.stdout.splitlines() if l.startswith("authorizedkeysfile ")]
    assert akf == [f"{sshd_setup}/k2 #cfg; x/mesh/authorized_keys"]


@needs["ssh-keygen"]
def test_real_ssh_reads_rendered_ssh_config(tmp_path: Path) -> None:
    dep = _mesh_dep(config_dir=str(tmp_path / "k2 #cfg 100%"))
    config = tmp_path / "ssh_config"
    config.write_text(mesh_config.ssh_config(dep))
    ssh = shutil.which("ssh")
    if ssh is None:
        pytest.skip("Debian package openssh-client")
    out = subprocess.run([ssh, "-G", "-F", str(config), "peer"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    opts = dict(l.split(" ", 1) for l in out.stdout.splitlines() if " " in l)
    # ssh -G prints IdentityFile before %-expansion ("%%" is the escaped "%"), UserKnownHostsFile after
    assert opts["identityfile"] == f"{tmp_path}/k2 #cfg 100%%/mesh/id_ed25519"
    assert opts["userknownhostsfile"] == f"{tmp_path}/k2 #cfg 100%/mesh/known_hosts"  # expanded
    assert opts["user"] == dep.s.mesh_user


# --------------------------------------------------------------------------- shell, YAML


@pytest.mark.parametrize("shell", ["sh", pytest.param("dash", marks=needs["dash"]), "bash"])
def test_shell_words_round_trip(shell: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} not installed")
    values = [v for v in HOSTILE.values() if "\x00" not in v]
    line = "printf '%s\\0' " + shell_line(values)
    assert subprocess.run([shell, "-n", "-c", line], timeout=30).returncode == 0
    out = subprocess.run([shell, "-c", line], capture_output=True, timeout=30, check=True).stdout
    assert out.decode().split("\x00")[:-1] == values
    for v in values:
        out = subprocess.run([shell, "-c", f"printf '%s' {shell_word(v)}"], capture_output=True, timeout=30, check=True).stdout
        assert out.decode() == v
    with pytest.raises(ValueError, match="NUL"):
        shell_word("a\x00b")
    with pytest.raises(ValueError):
        shell_line("echo hi")


def test_yaml_document_round_trips_hostile_strings() -> None:
    doc = {"plain": 1, **{name: value for name, value in HOSTILE.items()}, "list": list(HOSTILE.values()),
           "keys": {v: v for v in HOSTILE.values()}, "yamlish": ["!!python/object:os.system", "- x", "{a: b}", "null", "yes", "0x10", "~"]}
    text = yaml_document(doc)
    assert yaml.safe_load(text) == doc
    assert list(yaml.safe_load(text)) == list(doc)


# --------------------------------------------------------------------------- end to end: units.py, mesh_config.py


def _with_settings(dep, **update):
    hosts = [dataclasses.replace(h, settings=h.settings.model_copy(update=update)) for h in dep.fleet.hosts]
    return dataclasses.replace(dep, fleet=dataclasses.replace(dep.fleet, hosts=hosts))


def _mesh_dep(**update):
    from k2fleet.cli import load_plan

    dep, _ = load_plan("inventories/h200-trtllm-mpi.py")
    return _with_settings(dep, **update)


def _h200():
    from k2fleet.cli import load_plan

    return load_plan("inventories/h200.py")


@pytest.mark.parametrize("config_dir", ["/etc/k2fleet\nExecStartPre=/bin/sh -c id", "/etc/k2\rx", "/etc/k2\x00x", "/etc/k2\x1bx"])
def test_unit_file_refuses_control_characters_in_config_dir(config_dir: str) -> None:
    dep, plan = _h200()
    _, svc = plan.services()[0]
    with pytest.raises(ValueError):
        units.unit_file(_with_settings(dep, config_dir=config_dir), svc)


def test_unit_file_hostile_description_workdir_argv_env() -> None:
    dep, plan = _h200()
    _, svc = plan.services()[0]
    for field, value in [("description", "k2\nExecStartPre=/bin/sh"), ("workdir", "/srv/x\nUser=root"),
                         ("workdir", "relative"), ("argv", ["/usr/bin/python3", "a\x00b"]), ("argv", ["sh", "-c", "id"])]:
        with pytest.raises(ValueError):
            units.unit_file(dep, dataclasses.replace(svc, **{field: value}))
    with pytest.raises(ValueError):
        units.env_file(dataclasses.replace(svc, env={"A": "x\nB=evil"}))
    with pytest.raises(ValueError):
        units.env_file(dataclasses.replace(svc, env={"A\nB": "x"}))
    hostile = dataclasses.replace(svc, description="90% of $HOME; `id` #x", workdir="/srv/a b %n",
                                  argv=[*svc.argv, "x\ny", "$(id)", ";", "%n", "a\\b"], env={"A": 'x"$y`\\'})
    text = units.unit_file(dep, hostile)
    keys = _directives(text)
    pres = 1 + bool(engine_cache.cache_dir_of(svc.env))  # the weights' gate (+ the engine cache directory)
    assert keys.count("ExecStart") == 1 and keys.count("ExecStartPre") == pres and keys.count("WorkingDirectory") == 1
    assert len(keys) == len(_directives(units.unit_file(dep, dataclasses.replace(svc, workdir="/w"))))
    assert _parse_env_file(units.env_file(hostile)) == {"A": 'x"$y`\\'}


@needs["systemd"]
def test_real_systemd_loads_rendered_units_argv_exactly(tmp_path: Path) -> None:
    """Every unit of a real inventory plan, plus one with hostile values, as systemd loads it."""
    dep, plan = _h200()
    hostile = dataclasses.replace(plan.services()[0][1], name="k2-hostile", description="90% of $HOME; `id` #x",
                                  workdir="/srv/a b %n", argv=[*plan.services()[0][1].argv, "x\ny", "$(id)", ";", "%n", "a\\b", "'"])
    services = {f"k2q-{i}.service": s for i, (_, s) in enumerate(plan.services())} | {"k2q-hostile.service": hostile}
    dep = _with_settings(dep, config_dir="/etc/k2 fleet %i")
    dumps = _systemd_dump(tmp_path, {n: units.unit_file(dep, s) for n, s in services.items()})
    for name, svc in services.items():
        lines = dumps[name]
        assert [[_env_expand(w) for w in c] for c in _dump_commands(lines, "ExecStart")] == [svc.argv]
        cache = engine_cache.cache_dir_of(svc.env)  # the engine cache directory, made root-only before start
        assert [[_env_expand(w) for w in c] for c in _dump_commands(lines, "ExecStartPre")] == \
            [units.gate_argv(dep.weight_sets[0]), *([engine_cache.make_dir_argv(cache)] if cache else [])]
        assert _dump_field(lines, "EnvironmentFile") == [f"/etc/k2 fleet %i/env/{svc.name}.env"]
        assert _dump_field(lines, "Description") == [f"k2fleet: {svc.description or svc.name}"]
        if svc.workdir:
            assert _dump_field(lines, "WorkingDirectory") == [svc.workdir]


def test_mesh_renders_refuse_injection() -> None:
    for update in [{"mesh_user": "root\nAllowUsers *"}, {"mesh_user": "*"}, {"mesh_user": "root@*"},
                   {"config_dir": "/etc/k2\nAllowUsers *"}, {"address": "10.0.0.1 *"}, {"address": "*"}]:
        dep = _mesh_dep(**update)
        with pytest.raises(ValueError):
            mesh_config.sshd_config(dep, dep.fleet.hosts[0])
    dep = _mesh_dep(address='10.0.0.1",command="id')
    with pytest.raises(ValueError):
        mesh_config.authorized_keys(dep, "ssh-ed25519 AAAA k")
    with pytest.raises(ValueError):
        mesh_config.known_hosts(dep, {h.name: "ssh-ed25519 AAAA" for h in dep.fleet.hosts})
    dep = _mesh_dep()
    with pytest.raises(ValueError):
        mesh_config.authorized_keys(dep, "ssh-ed25519 AAAA k\nssh-ed25519 BBBB evil")
    with pytest.raises(ValueError):
        mesh_config.known_hosts(dep, {h.name: "ssh-ed25519 AAAA\n@revoked * ssh-ed25519 BBBB" for h in dep.fleet.hosts})
    with pytest.raises(ValueError):
        mesh_config.ssh_config(_mesh_dep(mesh_user="root\n  ProxyCommand sh -c id"))
    # in an argv a newline is just an escaped character: no second directive
    assert _directives(mesh_config.unit_file(_mesh_dep(config_dir="/etc/k2\nExecStartPre=/bin/sh"))) == _directives(mesh_config.unit_file(dep))


@needs["systemd"]
def test_real_systemd_loads_mesh_unit(tmp_path: Path) -> None:
    dep = _mesh_dep(config_dir="/etc/k2 #fleet 100% $x")
    dumps = _systemd_dump(tmp_path, {"k2q-mesh.service": mesh_config.unit_file(dep)})
    cfg = "/etc/k2 #fleet 100% $x/mesh/sshd_config"
    lines = dumps["k2q-mesh.service"]
    assert [[_env_expand(w) for w in c] for c in _dump_commands(lines, "ExecStartPre")] == [
        ["/bin/mkdir", "-p", "/run/sshd"], ["/usr/sbin/sshd", "-t", "-f", cfg]]
    assert [[_env_expand(w) for w in c] for c in _dump_commands(lines, "ExecStart")] == [["/usr/sbin/sshd", "-D", "-e", "-f", cfg]]
