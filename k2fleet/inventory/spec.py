"""The fleet spec: every ``k2_*`` inventory key, typed, with its default and meaning.

An inventory is a plain pyinfra inventory. k2fleet reads the ``k2_*`` keys of each
host's data (host data, group data, ``group_data/*.py`` — pyinfra's own merge) into a
:class:`HostSettings`. Each key has a *scope*:

- ``fleet``: must be the same on every host (model, revision, engine, ports, ...);
- ``pool``: must be the same on every host of one role (prefill, decode, serve, ...);
- ``host``: may differ per host (address, NIC).

``k2fleet keys`` prints the table below as Markdown; docs/inventory-keys.md holds that output.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import posixpath
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError
from pydantic_core import PydanticCustomError

PREFIX = "k2_"
FLEET, POOL, HOST = "fleet", "pool", "host"
Role = Literal["serve", "prefill", "decode", "router", "slurm-submit"]
SHA_RE = re.compile(r"^[0-9a-f]{40}$")
IMAGE_ID_RE = re.compile(r"sha256:[0-9a-f]{64}")

# ======================================================================================
# The grammar of values. Every rule has one owner below: a check function (raising
# ValueError with the user-facing message) wrapped into a reusable Annotated type.
# Values reach systemd units, env files, sshd configs and shell lines, so the types
# are strict (no bool for int, no "9000" for int) and no string anywhere may hold a
# control character.
# ======================================================================================

# C0/C1 controls, DEL, Unicode line/paragraph separators, zero-width and bidi controls;
# beyond ASCII, every character of the categories below (format characters such as U+2060
# WORD JOINER, U+00AD SOFT HYPHEN, U+061C ARABIC LETTER MARK, tag characters; surrogates).
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")
INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
PATH_CHARS_RE = re.compile(r"[A-Za-z0-9._/+-]+")
HOST_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
POSIX_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
IFNAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,15}")
IB_HCA_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}(?::[0-9]{1,3})?")
REPO_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
REPO_ID_MAX = 96
SERVED_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}")
PARSER_RE = re.compile(r"[a-z0-9_.-]{1,64}")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FLAG_NAME_RE = re.compile(r"-{0,2}[A-Za-z0-9][A-Za-z0-9_-]*")
CONFIG_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
VERSION_RE = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+-]{0,31}")
GPU_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
GLOB_RE = re.compile(r"[A-Za-z0-9._*?/+\[\]-]+")
DNS_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# Docker reference grammar (distribution/reference): [domain[:port]/]path[:tag][@digest]
_D_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_D_DOMAIN = rf"(?:{_D_COMPONENT}(?:\.{_D_COMPONENT})*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?"
_D_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_D_NAME = rf"(?:{_D_DOMAIN}/)?{_D_PATH_COMPONENT}(?:/{_D_PATH_COMPONENT})*"
DOCKER_REF_RE = re.compile(
    rf"(?P<name>{_D_NAME})(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
)
# TRT-LLM / engine options that are fractions of GPU memory, wherever they appear.
FRACTION_KEYS = frozenset(
    {"free_gpu_memory_fraction", "kv_cache_free_gpu_memory_fraction", "mem_fraction_static", "gpu_memory_utilization"}
)

# --- secrets --------------------------------------------------------------------------
SECRET_VALUE_RES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"hf_[A-Za-z0-9]{30,}"), "a Hugging Face token"),
    (re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"), "a bearer token"),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "an AWS access key"),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), "a GitHub token"),
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"), "a GitHub token"),
    # credentials in any URL, wherever it appears (k2_hub_endpoint, a proxy or mirror in k2_env, ...)
    (re.compile(r"(?i)\b(?:https?|socks[45]h?|ftps?|wss?)://[^\s/?#@]+@|\b[a-z][a-z0-9+.-]*://[^\s/?#@:]*:[^\s/?#@]*@"),
     "credentials in a URL (user:password@)"),
    (re.compile(r"(?i)[?&;][a-z0-9_.-]*(?:token|key|sig|signature|secret|passw|pwd|auth|credential|session)"
                r"[a-z0-9_.-]*=[^&#\s]"), "a credential in a URL's query (token=, key=, sig=, ...)"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
)
# a secret word as a component anywhere in the name (MY_TOKEN_VALUE, PASSWORD_X, AWS_SECRET_ACCESS_KEY),
# unless the name points to a file (..._FILE, ..._PATH, ..._DIR); TOKENIZERS_PARALLELISM has no such component
SECRET_ENV_RE = re.compile(r"(?i)^(?!.*_(?:FILE|PATH|DIR)$).*(?:^|_)(?:TOKEN|SECRET|PASSWORD|PASSWD|KEY|APIKEY|CREDENTIALS?)(?:_|$)")
SECRET_FLAGS = frozenset({"hf_token", "token", "api_key", "hf_api_token", "admin_api_key"})
API_KEY_NAMES = frozenset({"api_key", "admin_api_key", "vllm_api_key"})  # an endpoint's key: k2_api_key_file
API_KEY_HINT = (
    "an endpoint API key never goes in inventory values or argv; put it in a root-only file on the "
    "control machine and set k2_api_key_file (hosts get it in root-only files: vLLM's EnvironmentFile=, "
    "or the pattern file of k2fleet's API front for the other engines)"
)
SECRET_HINT = (
    "secrets never go in inventory values (they would land in unit files, env files and "
    "the plan); put the Hub token in a root-only file on the control machine and set "
    "k2_hub_token_file (or export HF_TOKEN)"
)


def looks_secret(text: str) -> str | None:
    """What kind of secret ``text`` looks like, or None.

    >>> looks_secret("hf_" + "a" * 34)
    'a Hugging Face token'
    >>> looks_secret("moonshotai/Kimi-K2-Thinking") is None
    True
    """
    for regex, what in SECRET_VALUE_RES:
        if regex.search(text):
            return what
    return None


def mask(text: str) -> str:
    """A secret as it may appear in a message: at most its first 3 characters + ``…``."""
    return text[:3] + "…"


def show(value: Any, limit: int = 40) -> str:
    """``repr`` of a value for a message: secrets masked, long values truncated.

    >>> len(show("x" * 50)), show("x" * 50)[-2:]
    (40, 'x…')
    >>> show("hf_" + "a" * 34)
    'hf_…'
    """
    text = repr(value)
    if looks_secret(text):
        return mask(text.lstrip("'\"{[("))
    if len(text) > limit:
        return text[: limit - 1] + "…"
    return text


def _path_text(parts: tuple[Any, ...] | list[Any]) -> str:
    """A nested location as ``a.b[2].c`` (unsafe pieces shown as a short repr)."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        text = str(part)
        if not re.fullmatch(r"[A-Za-z0-9_.:/+-]{1,64}", text):
            text = show(text, 24)
        out += ("." if out else "") + text
    return out


class _Nested(Exception):
    """A rule broken at ``path`` inside a nested value (converted to a pydantic error)."""

    def __init__(self, path: tuple[Any, ...], message: str) -> None:
        self.path, self.message = path, message
        super().__init__(message)


def _nested_error(path: tuple[Any, ...], message: str) -> PydanticCustomError:
    return PydanticCustomError("k2_nested", "{message}", {"path": _path_text(path), "message": message})


def scan_secrets(value: Any, path: tuple[Any, ...] = (), env_names: bool = False, flag_names: bool = False) -> None:
    """Raise :class:`_Nested` where ``value`` (any depth, keys included) holds a secret."""
    if isinstance(value, str):
        what = looks_secret(value)
        if what:
            raise _Nested(path, f"looks like {what} ({mask(value)}); {SECRET_HINT}")
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                what = looks_secret(k)
                if what:
                    raise _Nested(path, f"a key looks like {what} ({mask(k)}); {SECRET_HINT}")
                hint = API_KEY_HINT if k.lstrip("-").replace("-", "_").lower() in API_KEY_NAMES else SECRET_HINT
                if env_names and SECRET_ENV_RE.search(k) and v not in (None, ""):
                    raise _Nested(path + (k,), f"{k} would carry a secret in the environment; {hint}")
                if flag_names and k.lstrip("-").replace("-", "_").lower() in SECRET_FLAGS and v not in (None, False, ""):
                    raise _Nested(path + (k,), f"--{k.lstrip('-')} would put a secret in argv; {hint}")
            scan_secrets(v, path + (k,))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            scan_secrets(item, path + (i,))


# --- resource bounds ---------------------------------------------------------------------
MAX_STRING_CHARS = 4096  # any string: a value, a dict key, a list item
MAX_ITEMS = 1024  # entries of any one list or dict
MAX_DEPTH = 16  # nesting of lists and dicts inside one key
MAX_NODES = 65_536  # values (and keys) in all k2_* keys of one host, shared references counted each time
MAX_TOTAL_CHARS = 1_048_576  # characters in all of them
MAX_INT = 2**63 - 1
PLAIN_TYPES = (str, bool, int, float, type(None), list, tuple, dict)


def check_bounds(values: dict[str, Any]) -> None:
    """Raise :class:`_Nested` (path from the k2_ key, without prefix) where ``values`` break a
    size limit: string length, list/dict size, nesting depth, total values and characters
    (a structure built from shared references, an alias bomb, is counted as expanded and
    stopped at the budget), integer range, or a type that is not plain data. Iterative and
    run before any other check, so no later check recurses deep or walks long.

    >>> check_bounds({"env": {"A": "x" * 10}})
    >>> try:
    ...     check_bounds({"env": {"A": "x" * 5000}})
    ... except _Nested as exc:
    ...     print(exc.path, exc.message)
    ('env', 'A') is 5000 characters; values are at most 4096 characters
    """
    nodes = chars = 0
    stack: list[tuple[tuple[Any, ...], Any]] = [((k,), v) for k, v in reversed(values.items())]
    while stack:
        path, value = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise _Nested(path[:1], f"holds more than {MAX_NODES} values in all (shared references counted each "
                                    "time they appear); inventory values are settings, not data")
        if not isinstance(value, PLAIN_TYPES):
            raise _Nested(path, f"must be plain data (string, number, boolean, list or mapping), "
                                f"not {type(value).__name__}")
        if isinstance(value, str):
            chars += len(value)
            if len(value) > MAX_STRING_CHARS:
                raise _Nested(path, f"is {len(value)} characters; values are at most {MAX_STRING_CHARS} characters")
        elif isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_INT:
                raise _Nested(path, "is an integer beyond 64 bits; no setting is that large")
        elif isinstance(value, (list, tuple, dict)):
            if len(path) > MAX_DEPTH:
                raise _Nested(path[:MAX_DEPTH], f"nests lists and mappings more than {MAX_DEPTH} deep")
            if len(value) > MAX_ITEMS:
                raise _Nested(path, f"has {len(value)} entries; a list or mapping holds at most {MAX_ITEMS}")
            if isinstance(value, dict):
                for k, v in reversed(value.items()):
                    if not isinstance(k, (str, bool, int, float, type(None))):
                        raise _Nested(path, f"has a key of type {type(k).__name__}; keys are strings")
                    if isinstance(k, str) and len(k) > MAX_STRING_CHARS:
                        raise _Nested(path, f"has a key of {len(k)} characters; keys are at most "
                                            f"{MAX_STRING_CHARS} characters")
                    chars += len(k) if isinstance(k, str) else 0
                    stack.append((path + (k,), v))
            else:
                stack.extend((path + (i,), v) for i, v in reversed(list(enumerate(value))))
        if chars > MAX_TOTAL_CHARS:
            raise _Nested(path[:1], f"holds more than {MAX_TOTAL_CHARS} characters in all (shared references "
                                    "counted each time they appear); inventory values are settings, not data")


# --- check functions (one owner per rule) -----------------------------------------------
def no_control(value: str) -> str:
    """No control character anywhere (newline, CR, NUL, ESC, DEL, bidi/zero-width...)."""
    found = CONTROL_RE.search(value)
    at = found.start() if found else None
    if at is None and not value.isascii():
        at = next((i for i, ch in enumerate(value) if unicodedata.category(ch) in INVISIBLE_CATEGORIES), None)
    if at is not None:
        raise ValueError(
            f"contains a control character (U+{ord(value[at]):04X} at position {at}: a control, zero-width, "
            "bidi or other invisible character); values end up in systemd units, env files and shell lines"
        )
    return value


def _pattern(regex: re.Pattern[str], what: str, max_len: int | None = None):
    def check(value: str) -> str:
        if max_len is not None and len(value) > max_len:
            raise ValueError(f"must be {what}, at most {max_len} characters (got {len(value)})")
        if not regex.fullmatch(value):
            raise ValueError(f"must be {what} (got {show(value)})")
        return value

    return check


def abs_path(value: str) -> str:
    """An absolute, normalised path of ``[A-Za-z0-9._/+-]`` (no `..`, `//`, trailing `/`)."""
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path (got {show(value)})")
    bad = sorted(set(PATH_CHARS_RE.sub("", value)))
    if bad:
        raise ValueError(
            f"may only use letters, digits and . _ / + - (found {''.join(bad)!r} in {show(value)})"
        )
    if value == "/":
        raise ValueError("must not be the root directory")
    if "//" in value or value.endswith("/") or ".." in value.split("/") or posixpath.normpath(value) != value:
        raise ValueError(f"must be a normalised path without `..`, `.`, `//` or a trailing `/` (got {show(value)})")
    return value


def rel_path(value: str) -> str:
    """A normalised relative path of the same characters as :func:`abs_path`."""
    bad = sorted(set(PATH_CHARS_RE.sub("", value)))
    if bad:
        raise ValueError(f"may only use letters, digits and . _ / + - (found {''.join(bad)!r} in {show(value)})")
    if value.startswith("/") or ".." in value.split("/") or posixpath.normpath(value) != value or value == ".":
        raise ValueError(f"must be a normalised relative path without `..` (got {show(value)})")
    return value


def path_or_rel(value: str) -> str:
    if value == "":
        return value
    return abs_path(value) if value.startswith("/") else rel_path(value)


def path_or_empty(value: str) -> str:
    return value if value == "" else abs_path(value)


def address(value: str) -> str:
    """An IPv4/IPv6 literal or an RFC 1123 DNS name."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", value):  # looks like IPv4 but ipaddress refused it (300.1.1.1)
        raise ValueError(f"{show(value)} is not a valid IPv4 address")
    name = value[:-1] if value.endswith(".") else value
    if not name or len(name) > 253 or not all(DNS_LABEL_RE.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"must be an IPv4/IPv6 address or a DNS name (RFC 1123 labels) (got {show(value)})")
    return value


def http_url(value: str) -> str:
    """An http(s) URL with a host and no credentials."""
    if any(ch.isspace() for ch in value):
        raise ValueError("must not contain whitespace")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"must be an http:// or https:// URL (got scheme {parts.scheme!r})")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"must not carry credentials (user:password@); {SECRET_HINT}")
    if not parts.hostname:
        raise ValueError("must name a host (http(s)://HOST[:PORT][/path])")
    if parts.query or parts.fragment or "?" in value or "#" in value:
        raise ValueError(f"must not carry a query or fragment (a token there would reach argv and logs); {SECRET_HINT}")
    address(parts.hostname)
    return value


def mirror_url(value: str) -> str:
    """:func:`http_url` for a package mirror or index hosts and the control machine fetch from:
    https, or plain http only to a loopback address (a test's local mirror)."""
    http_url(value)
    parts = urlsplit(value)
    if parts.scheme != "https" and not is_loopback(parts.hostname or ""):
        raise ValueError(f"must be an https:// URL (plain http only to a loopback address, got {show(value)}): "
                         "packages and wheels must not travel in clear text")
    return value


def is_loopback(host: str) -> bool:
    """A loopback IP literal or ``localhost``.

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("localhost"), is_loopback("10.0.0.1")
    (True, True, True, False)
    """
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def docker_ref(value: str) -> str:
    """A Docker image reference ``[registry[:port]/]name[:tag][@digest]``."""
    match = DOCKER_REF_RE.fullmatch(value)
    first, slash, _ = value.partition("/")
    # the first component is a registry only with a `.` or `:` in it, or `localhost` (as docker parses it)
    registry = bool(slash) and ("." in first or ":" in first or first == "localhost" or first.startswith("["))
    if not match or len(match.group("name")) > 255 or (slash and not registry and first != first.lower()):
        raise ValueError(
            f"must be a Docker image reference [registry[:port]/]name[:tag][@sha256:...] "
            f"with a lowercase name (got {show(value)})"
        )
    return value


def repo_id(value: str) -> str:
    if len(value) > REPO_ID_MAX:
        raise ValueError(f"must be a Hub repo id `org/name` of at most {REPO_ID_MAX} characters")
    if not REPO_ID_RE.fullmatch(value) or "--" in value or ".." in value or value.endswith((".", "-")):
        raise ValueError(
            f"must be a Hub repo id `org/name` (letters, digits, . _ -; no `--` or `..`) (got {show(value)})"
        )
    return value


def ifname(value: str) -> str:
    if value in (".", "..") or not IFNAME_RE.fullmatch(value):
        raise ValueError(f"must be a Linux interface name: 1-15 of A-Z a-z 0-9 _ . : - (got {show(value)})")
    return value


def checkpoint_source(value: str) -> str:
    if value == "hub":
        return value
    if not value.startswith("control:"):
        raise ValueError(f"{show(value)} is neither `hub` nor `control:/absolute/path`")
    abs_path(value[len("control:"):])
    return value


def fetcher(value: str) -> str:
    return value if value in ("auto", "control") else _pattern(HOST_NAME_RE, "`auto`, `control` or an inventory host name")(value)


def gguf_pattern(value: str) -> str:
    if not GLOB_RE.fullmatch(value) or value.startswith("/") or ".." in value.split("/"):
        raise ValueError(f"must be a relative file pattern like `Q4_K_M/*` (got {show(value)})")
    return value


def finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def fraction(value: float) -> float:
    if not math.isfinite(value) or not 0 < value <= 1:
        raise ValueError(f"must be a fraction in (0, 1] (got {value!r})")
    return value


def _scalar(value: Any, path: tuple[Any, ...], what: str) -> None:
    """One plain value inside a nested key: a string without control characters, a
    finite number or a boolean; anything else is refused as ``what``."""
    if isinstance(value, str):
        try:
            no_control(value)
        except ValueError as exc:
            raise _Nested(path, str(exc)) from None
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _Nested(path, "must be a finite number")
    elif not isinstance(value, (bool, int)):
        raise _Nested(path, f"{what}, not {type(value).__name__}")


def _check_config_tree(value: Any, path: tuple[Any, ...] = ()) -> None:
    """Options trees (TRT-LLM LLM API dicts, SLURM sections): plain YAML data only."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str) or not CONFIG_KEY_RE.fullmatch(k):
                raise _Nested(path, f"option name {show(k)} must match [A-Za-z_][A-Za-z0-9_]*")
            if k in FRACTION_KEYS and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1):
                raise _Nested(path + (k,), f"must be a fraction in (0, 1] (got {show(v)})")
            _check_config_tree(v, path + (k,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_config_tree(item, path + (i,))
    elif value is not None:
        _scalar(value, path, "must be a string, number, boolean, list or mapping")


FLAG_LIKE_RE = re.compile(r"-+[A-Za-z_]|--$")  # "-1" and "-0.5" are numbers; "-tp", "--port" and "--" are flags


def _engine_arg(value: Any, path: tuple[Any, ...]) -> None:
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, list):
                raise _Nested(path + (i,), "lists of flag values are flat (no nested lists)")
            _engine_arg(item, path + (i,))
        return
    _scalar(value, path, "a flag value is a string, number, boolean or list of those")
    if isinstance(value, str):
        if FLAG_LIKE_RE.match(value):
            raise _Nested(path, f"{show(value)} looks like a flag: a value would put a second flag in the engine's "
                                "argv; give each flag its own key in k2_engine_args")


def engine_args(value: dict[str, Any]) -> dict[str, Any]:
    """``{flag: value}``: flag names by pattern, values scalars or flat lists, fractions in (0, 1]."""
    try:
        for name, arg in value.items():
            _engine_arg(arg, (name,))
            if name.lstrip("-").replace("-", "_") in FRACTION_KEYS and (
                isinstance(arg, bool) or not isinstance(arg, (int, float)) or not 0 < arg <= 1
            ):
                raise _Nested((name,), f"must be a fraction in (0, 1] (got {show(arg)})")
    except _Nested as exc:
        raise _nested_error(exc.path, exc.message) from None
    return value


def _typed(model: type[BaseModel], tree: bool = True):
    """Validate a nested dict against ``model`` (and the options-tree grammar), keep the dict."""

    def check(value: Any) -> Any:
        if value is None:
            return value
        try:
            if tree:
                _check_config_tree(value)
            model.model_validate(value)
        except _Nested as exc:
            raise _nested_error(exc.path, exc.message) from None
        except ValidationError as exc:
            err = exc.errors()[0]
            msg = _pydantic_message(err)
            raise _nested_error(tuple(err["loc"]), msg) from None
        return value

    return check


def _pydantic_message(err: Any) -> str:
    """A pydantic error as one short line (the input shown masked/truncated)."""
    if err["type"] == "k2_nested":
        return str(err["ctx"]["message"])
    if err["type"] == "missing":
        return "required but not set"
    msg = str(err["msg"])
    if err["type"] == "value_error":
        return msg.removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return "not a known option here"
    return f"{msg} (got {show(err.get('input'))})"


# --- the reusable types ------------------------------------------------------------------
SafeStr = Annotated[str, Strict(), AfterValidator(no_control)]
AbsPath = Annotated[SafeStr, AfterValidator(abs_path)]
RelOrAbsPath = Annotated[SafeStr, AfterValidator(path_or_rel)]
OptionalAbsPath = Annotated[SafeStr, AfterValidator(path_or_empty)]
HostName = Annotated[SafeStr, AfterValidator(_pattern(HOST_NAME_RE, "a host name: 1-63 of A-Z a-z 0-9 . _ -, starting with a letter or digit"))]
PosixUser = Annotated[SafeStr, AfterValidator(_pattern(POSIX_USER_RE, "a POSIX user name [a-z_][a-z0-9_-]{0,31}"))]
IfName = Annotated[SafeStr, AfterValidator(ifname)]
IbHca = Annotated[SafeStr, AfterValidator(_pattern(IB_HCA_RE, "an InfiniBand HCA name like mlx5_0 (optionally :PORT)"))]
RepoId = Annotated[SafeStr, AfterValidator(repo_id)]
ServedName = Annotated[SafeStr, AfterValidator(_pattern(SERVED_NAME_RE, "1-128 of A-Z a-z 0-9 . _ : / + -, starting with a letter or digit"))]
ParserName = Annotated[SafeStr, AfterValidator(_pattern(PARSER_RE, "a name of a-z 0-9 _ . -"))]
EnvName = Annotated[SafeStr, AfterValidator(_pattern(ENV_NAME_RE, "an environment variable name [A-Za-z_][A-Za-z0-9_]*"))]
FlagName = Annotated[SafeStr, AfterValidator(_pattern(FLAG_NAME_RE, "a flag name like max-num-seqs or --max-num-seqs"))]
VersionStr = Annotated[SafeStr, AfterValidator(_pattern(VERSION_RE, "a version like 0.33.0"))]
GpuName = Annotated[SafeStr, AfterValidator(_pattern(GPU_NAME_RE, "a GPU type name"))]
ImageRef = Annotated[SafeStr, AfterValidator(docker_ref)]
MirrorUrl = Annotated[SafeStr, AfterValidator(mirror_url)]
ImageId = Annotated[SafeStr, AfterValidator(_pattern(IMAGE_ID_RE, "an image ID sha256:<64 lowercase hex>, as `docker image inspect --format {{.Id}}` prints it"))]
def reachable_address(value: str) -> str:
    """:func:`address`, and not one peers cannot reach: the unspecified address (0.0.0.0,
    ::, a bind-any, not an address) or a multicast one."""
    address(value)
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return value
    if ip.is_unspecified or ip.is_multicast:
        raise ValueError(f"{value} is {'the unspecified (bind-any)' if ip.is_unspecified else 'a multicast'} address, "
                         "not one peers can reach; give the host's own address on the fleet network")
    return value


Address = Annotated[SafeStr, AfterValidator(reachable_address)]
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr")
SYSTEM_DIRS = frozenset({"/home", "/mnt", "/opt", "/root", "/srv", "/tmp", "/var", "/var/lib", "/var/cache", "/var/tmp"})


def own_dir(value: str) -> str:
    """A directory k2fleet may fill (and empty): not inside the OS's own trees, not one of
    the top directories other software shares (an engine venv at /usr would overwrite
    the system's python).

    >>> own_dir("/opt/k2fleet/venv")
    '/opt/k2fleet/venv'
    """
    if value in SYSTEM_DIRS or any(value == t or value.startswith(t + "/") for t in SYSTEM_TREES):
        raise ValueError(f"{value} is the system's own directory, not one k2fleet may fill; use a directory "
                         "of its own such as /opt/k2fleet/venv or /srv/k2fleet/models")
    return value


OwnDir = Annotated[AbsPath, AfterValidator(own_dir)]


def cidr(value: str) -> str:
    """An IPv4/IPv6 network (``10.0.0.0/8``) or one address, host bits clear.

    >>> cidr("10.1.0.0/16"), cidr("2001:db8::1")
    ('10.1.0.0/16', '2001:db8::1')
    """
    try:
        ipaddress.ip_network(value, strict=True)
    except ValueError as exc:
        raise ValueError(f"must be an IPv4/IPv6 address or network like 10.0.0.0/8 with its host bits clear "
                         f"({exc}; got {show(value)})") from None
    return value


def cidr_list(value: list[str]) -> list[str]:
    if not value:
        raise ValueError("an empty list would let no one reach the API; leave the key unset to let anyone reach it")
    return value


Cidr = Annotated[SafeStr, AfterValidator(cidr)]
HttpUrl = Annotated[SafeStr, AfterValidator(http_url)]
Port = Annotated[int, Strict(), Field(ge=1, le=65535)]
PosInt = Annotated[int, Strict(), Field(ge=1)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
DriverBranch = Annotated[int, Strict(), Field(ge=450, le=999)]
IbGidIndex = Annotated[int, Strict(), Field(ge=0, le=255)]  # a port's GID table index (sysfs ports/N/gids/<k>)
DriverVersion = Annotated[SafeStr, AfterValidator(_pattern(re.compile(r"[0-9]{3}\.[0-9]{1,3}(?:\.[0-9]{1,3})?"),
                                                           "an NVIDIA driver version like 580.95.05"))]
Fraction = Annotated[float, AfterValidator(fraction)]


def non_negative(value: float) -> float:
    finite(value)
    if value < 0:
        raise ValueError(f"must be 0 or more, got {value}")
    return value


NonNegNumber = Annotated[float, AfterValidator(non_negative)]


def unique_hcas(value: list[str]) -> list[str]:
    """Each HCA (or HCA port) once: a device named twice, or whole and by port, lands twice in
    ``NCCL_IB_HCA`` and SGLang's ``--disaggregation-ib-device``.

    >>> unique_hcas(["mlx5_0", "mlx5_1:1", "mlx5_1:2"])
    ['mlx5_0', 'mlx5_1:1', 'mlx5_1:2']
    >>> unique_hcas(["mlx5_0", "mlx5_0:1"])
    Traceback (most recent call last):
    ...
    ValueError: mlx5_0:1 repeats mlx5_0 (the whole device); list each HCA (or HCA:PORT) once
    """
    seen: dict[str, str] = {}
    for hca in value:
        device = hca.split(":", 1)[0]
        clash = seen.get(hca) or seen.get(device) or (next((s for s in seen.values() if s.split(":", 1)[0] == device), None)
                                                       if hca == device else None)
        if clash is not None:
            what = " (the whole device)" if ":" not in clash and clash != hca else ""
            raise ValueError(f"{hca} repeats {clash}{what}; list each HCA (or HCA:PORT) once")
        seen[hca] = hca
    return value


IbHcas = Annotated[list[IbHca], AfterValidator(unique_hcas)]
Number = Annotated[float, AfterValidator(finite)]


# --- nested structures --------------------------------------------------------------------
class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    """Sections owned by another tool: known fields typed, others kept (options-tree grammar)."""

    model_config = ConfigDict(extra="allow", strict=True)


class KtSettings(_Closed):
    """``k2_kt``: what k2fleet.planning.engines.ktransformers.render reads."""

    method: Literal["AMXINT4", "AMXINT8", "LLAMAFILE", "RAWINT4", "FP8"] | None = None
    cpuinfer: PosInt | None = None
    threadpool_count: PosInt | None = None
    gpu_experts: NonNegInt | None = None
    optimize_rules: RelOrAbsPath | None = None
    cache_lens: PosInt | None = None


class KvCacheConfig(_Open):
    free_gpu_memory_fraction: Fraction | None = None
    enable_block_reuse: bool | None = None
    dtype: ParserName | None = None
    max_tokens: PosInt | None = None


class CudaGraphConfig(_Open):
    enable_padding: bool | None = None
    padding_enabled: bool | None = None
    batch_sizes: list[PosInt] | None = None
    max_batch_size: PosInt | None = None


class CacheTransceiverConfig(_Open):
    backend: Annotated[SafeStr, AfterValidator(_pattern(re.compile(r"[A-Za-z0-9_]{1,32}"), "a backend name like UCX"))] | None = None
    max_tokens_in_buffer: PosInt | None = None


class MoeConfig(_Open):
    backend: Annotated[SafeStr, AfterValidator(_pattern(re.compile(r"[A-Za-z0-9_]{1,32}"), "a backend name like WIDEEP"))] | None = None


class LlmApiOptions(_Open):
    """One TRT-LLM LLM API options dict (``k2_trtllm_config``, each ``k2_disagg`` side):
    the keys k2fleet reads or sets typed; option names are checked against TRT-LLM's
    table by k2fleet.planning.engine_flags."""

    tensor_parallel_size: PosInt | None = None
    pipeline_parallel_size: PosInt | None = None
    moe_expert_parallel_size: PosInt | None = None
    enable_attention_dp: bool | None = None
    max_batch_size: PosInt | None = None
    max_num_tokens: PosInt | None = None
    max_seq_len: PosInt | None = None
    trust_remote_code: bool | None = None
    print_iter_log: bool | None = None
    disable_overlap_scheduler: bool | None = None
    kv_cache_config: KvCacheConfig | None = None
    cuda_graph_config: CudaGraphConfig | None = None
    cache_transceiver_config: CacheTransceiverConfig | None = None
    moe_config: MoeConfig | None = None


class DisaggSettings(_Closed):
    """``k2_disagg``: the ctx and gen worker configs of the SLURM disaggregated job."""

    ctx: LlmApiOptions
    gen: LlmApiOptions


class SlurmSection(_Open):
    script_file: Annotated[SafeStr, AfterValidator(path_or_rel)]
    partition: SafeStr
    account: SafeStr
    job_time: SafeStr
    job_name: SafeStr
    numa_bind: bool
    extra_args: SafeStr | None = None


class BenchmarkSection(_Open):
    mode: SafeStr
    input_length: PosInt
    output_length: PosInt
    concurrency_list: SafeStr
    multi_round: PosInt | None = None
    streaming: bool | None = None
    benchmark_ratio: Number | None = None
    dataset_file: SafeStr | None = None


class HardwareSection(_Closed):
    gpus_per_node: PosInt | None = None
    num_ctx_servers: PosInt
    num_gen_servers: PosInt


class EnvironmentSection(_Open):
    container_mount: SafeStr
    work_dir: AbsPath
    trtllm_repo: AbsPath | None = None
    model_path: AbsPath | None = None
    container_image: ImageRef | None = None
    build_wheel: bool | None = None
    trtllm_wheel_path: OptionalAbsPath | None = None
    worker_env_var: SafeStr | None = None
    server_env_var: SafeStr | None = None


class SlurmSettings(_Closed):
    """``k2_slurm``: the sections of submit.py's config.yaml k2fleet takes from the inventory
    (``worker_config`` comes from ``k2_disagg``)."""

    slurm: SlurmSection
    benchmark: BenchmarkSection
    hardware: HardwareSection
    environment: EnvironmentSection


EngineArgs = Annotated[dict[FlagName, Any], AfterValidator(engine_args)]
EnvMap = dict[EnvName, SafeStr]
TrtllmConfig = Annotated[dict[str, Any], AfterValidator(_typed(LlmApiOptions))]
KtConfig = Annotated[dict[str, Any], AfterValidator(_typed(KtSettings, tree=False))]
SlurmConfig = Annotated[dict[str, Any], AfterValidator(_typed(SlurmSettings))]
DisaggConfig = Annotated[dict[str, Any], AfterValidator(_typed(DisaggSettings))]


def _key(scope: str, description: str, **kw: Any) -> Any:
    return Field(json_schema_extra={"scope": scope}, description=description, **kw)


GlobPattern = Annotated[SafeStr, AfterValidator(gguf_pattern)]
CheckpointSource = Annotated[SafeStr, AfterValidator(checkpoint_source)]
Fetcher = Annotated[SafeStr, AfterValidator(fetcher)]


class HostSettings(BaseModel):
    """All ``k2_*`` keys of one host (names without the ``k2_`` prefix)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    # --- model -----------------------------------------------------------------
    model: RepoId = _key(FLEET, "Hub repo id of the checkpoint, e.g. `moonshotai/Kimi-K2-Thinking`.")
    revision: SafeStr = _key(
        FLEET, "Pinned 40-hex commit sha of `k2_model` (never a branch or tag)."
    )
    served_model_name: ServedName | None = _key(
        FLEET, "Name clients use in requests; default: `k2_model`.", default=None
    )
    checkpoint_bytes: PosInt | None = _key(
        FLEET,
        "Checkpoint size in bytes, for the memory-fit check; default from k2fleet's catalog.",
        default=None,
    )
    quantization: Literal["int4", "fp8", "nvfp4", "gguf", "bf16"] | None = _key(
        FLEET, "Weight format; default from the catalog (required for unknown models).", default=None
    )
    model_type_override: ParserName | None = _key(
        FLEET,
        "Serve through a config overlay with this `model_type` (e.g. `deepseek_v3` for "
        "engines without Kimi support); the verified files are never edited.",
        default=None,
    )
    gguf_repo: RepoId | None = _key(FLEET, "KTransformers: Hub repo id of the GGUF weights.", default=None)
    gguf_revision: SafeStr | None = _key(FLEET, "KTransformers: pinned commit of `k2_gguf_repo`.", default=None)
    gguf_pattern: GlobPattern | None = _key(
        FLEET, "KTransformers: files of `k2_gguf_repo` to fetch, e.g. `Q4_K_M/*`.", default=None
    )
    checkpoint_source: CheckpointSource = _key(
        FLEET,
        "Where the checkpoint comes from: `hub` (huggingface-hub at `k2_revision`) or "
        "`control:/path` (a directory on the control machine holding the files and "
        "`.k2fleet/manifest.json`, e.g. made by `hf download` on a connected machine).",
        default="hub",
    )
    gguf_source: CheckpointSource = _key(
        FLEET,
        "Where the `k2_gguf_repo` files come from: `hub` (at `k2_gguf_revision`, only those "
        "matching `k2_gguf_pattern`) or `control:/path` (a directory holding them and "
        "`.k2fleet/manifest.json`).",
        default="hub",
    )
    checkpoint_cache: AbsPath = _key(
        FLEET,
        "Control-machine directory the `hub` source downloads into and verifies "
        "(`DIR/<org>--<name>/<revision>`); the fleet then receives it from there once.",
        default="/var/cache/k2fleet/checkpoints",
    )
    hub_endpoint: HttpUrl | None = _key(
        FLEET,
        "Hub URL for the `hub` source (an internal mirror); default: env `HF_ENDPOINT`, "
        "else huggingface.co.",
        default=None,
    )
    hub_token_file: AbsPath | None = _key(
        FLEET,
        "File on the control machine holding the Hub token; default: env `HF_TOKEN`. "
        "It must be the deploying user's, not empty and readable by no one else (0600), checked at validate; "
        "the token is read at execution time, never put in argv, logs or the plan.",
        default=None,
    )
    checkpoint_fetcher: Fetcher = _key(
        FLEET,
        "Who talks to the Hub for the `hub` source: `auto` (chosen by what can reach the Hub: "
        "before the deploy changes anything, each host that loads weights is asked, over the deploy's "
        "own connection, to open `k2_hub_endpoint` (default huggingface.co:443); the first in "
        "inventory order that does is the fetcher; the control machine only when none does, or with a "
        "`control:` source, `k2_bundle`, a loopback endpoint, or `k2_egress: mirrors-only` without "
        "`k2_hub_endpoint`), `control` (the control machine downloads into `k2_checkpoint_cache`, "
        "verifies, and sends the fleet one copy through the deploy's own SSH — through a bastion when "
        "the hosts are behind one) or the name of one inventory host that loads weights (it downloads "
        "into `k2_model_dir` itself, with huggingface_hub from an offline wheelhouse the control "
        "machine ships; the token goes there as a root-only file, removed after the download). A "
        "fetcher host feeds the others file by file as it verifies each (they receive from peers "
        "while it downloads), so the fleet is ready about when the download ends. `k2fleet plan` "
        "says which it is or how `auto` decides.",
        default="auto",
    )
    shared_storage: bool = _key(
        FLEET,
        "`k2_model_dir` is shared storage (NFS, Lustre) seen by every host: only the first "
        "host fetches and verifies the checkpoint, the others only pass the gate.",
        default=False,
    )
    model_dir: OwnDir = _key(
        FLEET, "Where checkpoints live on hosts: `DIR/<org>--<name>/<revision>`.", default="/srv/k2fleet/models"
    )
    keep_revisions: PosInt = _key(
        FLEET,
        "Revisions of `k2_model` (and of `k2_gguf_repo`) each host keeps under `k2_model_dir`, the pinned one "
        "included, the others in the order they were last served: 2 (default) keeps the previous one, so "
        "going back re-pins without a download. Older ones are removed after a deploy's health gate passed "
        "on the pinned one; engine venvs of releases other than the pinned one are kept to the same count.",
        default=2,
    )
    # --- engine ----------------------------------------------------------------
    engine: Literal["vllm", "sglang", "trtllm", "ktransformers"] = _key(
        FLEET, "Serving engine: `vllm`, `sglang`, `trtllm` or `ktransformers`."
    )
    engine_version: VersionStr | None = _key(
        FLEET,
        "Engine release to pin; default today's (vLLM 0.33.0, SGLang 0.5.23, TRT-LLM 1.2.0, "
        "KTransformers 0.7.2). Flag names are rendered for this version.",
        default=None,
    )
    runtime: Literal["venv", "container"] | None = _key(
        FLEET,
        "`venv` (engine installed in `k2_venv`) or `container` (Docker image `k2_image`); "
        "default: container for TRT-LLM and ROCm, venv otherwise.",
        default=None,
    )
    image: ImageRef | None = _key(FLEET, "Container image; default per engine, version and platform.", default=None)
    image_id: ImageId | None = _key(
        FLEET,
        "Image ID (`sha256:...`) `k2_image` must be: hosts pull the reference and check it, and each container "
        "unit refuses to start any other image under it. Sandbox: the engine test double image's own ID.",
        default=None,
    )
    venv: OwnDir = _key(
        FLEET,
        "Directory of the engine's Python virtual environments (venv runtime), one per release: "
        "`DIR/<engine>-<version>`, so a `k2_engine_version` change installs beside the running one.",
        default="/opt/k2fleet/venv",
    )
    platform: Literal["cuda", "rocm"] | None = _key(
        FLEET, "Engine build: `cuda` or `rocm`; default from the GPU vendor.", default=None
    )
    package_source: Literal["apt", "bundle"] = _key(
        FLEET,
        "Host packages (rsync, OpenMPI, ...) from `apt` (hosts reach a mirror) or `bundle` "
        "(an offline .deb bundle with its full dependency closure, built on the control machine).",
        default="apt",
    )
    bundle: AbsPath | None = _key(
        FLEET,
        "Air-gapped: a directory made by `k2fleet bundle INVENTORY --out DIR` (with its `k2fleet.lock`). "
        "Packages, wheels, images and the Hub checkpoint come from it alone, each sha256-checked against "
        "the lock; needs `k2_package_source: bundle`.",
        default=None,
    )
    os_mirror: MirrorUrl | None = _key(
        FLEET,
        "Mirror of the hosts' distribution (`k2_package_source: apt`): its base URL, e.g. "
        "`https://mirror.corp/ubuntu` (apt: suites and components from the OS table; dnf: "
        "`BaseOS/<arch>/os` and `AppStream/<arch>/os` under it). k2fleet writes it as its own apt "
        "`.sources` / dnf `.repo` file; `k2fleet bundle` resolves against it too. https (http only to "
        "loopback), no credentials. Default: the hosts' own sources.",
        default=None,
    )
    os_security_mirror: MirrorUrl | None = _key(
        FLEET,
        "Debian hosts: mirror of Debian's security archive (`https://security.debian.org/debian-security`), "
        "e.g. `https://mirror.corp/debian-security`, read with `k2_os_mirror`'s key: its `<codename>-security` "
        "suite is listed beside `k2_os_mirror`'s in the hosts' source file and in `k2fleet bundle`. Without it a "
        "host that took security updates can hold packages newer than the mirror's, and apt cannot install "
        "those pinned to them (python3-venv); `k2fleet plan` notes a Debian fleet with `k2_os_mirror` and "
        "not this key. Needs `k2_os_mirror`; Ubuntu's `-security` pocket is in "
        "`k2_os_mirror` itself.",
        default=None,
    )
    os_mirror_keyring: AbsPath | None = _key(
        FLEET,
        "Control-machine file with the OpenPGP key(s) `k2_os_mirror` is signed with (binary `.gpg` or "
        "armored `.asc`; dnf: armored), uploaded to the hosts and named in the source's `Signed-By`/`gpgkey`. "
        "Default: the distribution's own archive key (a mirror of the signed archive).",
        default=None,
    )
    nvidia_repo: MirrorUrl | None = _key(
        FLEET,
        "Mirror of NVIDIA's CUDA repository tree (`https://developer.download.nvidia.com/compute/cuda/repos`, "
        "the default): k2fleet appends `/<os>/<arch>/` from the OS table. Needs `k2_nvidia_repo_keyring`.",
        default=None,
    )
    nvidia_repo_keyring: AbsPath | None = _key(
        FLEET,
        "Control-machine file with NVIDIA's repository key (e.g. `cuda-archive-keyring.gpg` from "
        "`cuda-keyring`, or the armored `.pub` the repository serves) for `k2_nvidia_repo`.",
        default=None,
    )
    # --- issue 34: mirrors of the container toolkit's and Docker's repositories (k2fleet.planning.mirrors)
    container_toolkit_repo: MirrorUrl | None = _key(
        FLEET,
        "Mirror of the NVIDIA Container Toolkit's repository (`https://nvidia.github.io/libnvidia-container`, the "
        "default), for NVIDIA hosts that run containers: k2fleet appends `/stable/deb/<amd64|arm64>/` (apt, a flat "
        "repository) or `/stable/rpm/<x86_64|aarch64>/` (dnf). Needs `k2_container_toolkit_repo_keyring`.",
        default=None,
    )
    container_toolkit_repo_keyring: AbsPath | None = _key(
        FLEET,
        "Control-machine file with the key the toolkit's repository is signed with (the `gpgkey` file it serves; "
        "dnf: armored) for `k2_container_toolkit_repo`.",
        default=None,
    )
    docker_repo: MirrorUrl | None = _key(
        FLEET,
        "Mirror of Docker CE's RHEL repository (`https://download.docker.com/linux/rhel`, the default), for "
        "RHEL-family hosts that run containers (Ubuntu and Debian hosts take `docker.io` from the distribution: "
        "`k2_os_mirror`): k2fleet appends `/$releasever/$basearch/stable`. Needs `k2_docker_repo_keyring`.",
        default=None,
    )
    docker_repo_keyring: AbsPath | None = _key(
        FLEET,
        "Control-machine file with Docker's armored repository key (the `gpg` file beside its `docker-ce.repo`) "
        "for `k2_docker_repo`.",
        default=None,
    )
    pypi_index: MirrorUrl | None = _key(
        FLEET,
        "PyPI simple index (`pip --index-url`) for the control machine's wheelhouse builds (`k2fleet bundle` "
        "too) and the hosts' engine venv installs. Default: pip's own configuration (PyPI).",
        default=None,
    )
    egress: Literal["open", "mirrors-only"] = _key(
        FLEET,
        "Outbound traffic of the hosts when `k2_firewall` is on: `open` (default: untouched) or `mirrors-only` "
        "(k2fleet's table lets a host open connections only to the fleet, the hosts of the repositories, mirrors "
        "and indexes its plan uses, resolved to IPs on the control machine, DNS, NTP and DHCP; everything else is "
        "rejected). Validate refuses mirrors-only while a host would still fetch from a vendor's own server "
        "(naming the mirror key to set: `k2fleet plan` lists every place each host fetches from).",
        default="open",
    )
    config_dir: AbsPath = _key(FLEET, "Where rendered config files go on hosts.", default="/etc/k2fleet")
    # --- hardware --------------------------------------------------------------
    gpu: GpuName = _key(FLEET, "GPU type: h100, h800, h20, h200, b200, b300, gb200, gb300, mi300x, mi325x, mi355x.")
    gpus_per_node: PosInt | None = _key(FLEET, "GPUs per host; default 8 (4 on GB200/GB300).", default=None)
    simulated_gpus: bool = _key(
        FLEET,
        "Sandbox only: hosts have no GPUs and run engine test doubles. Requires "
        "`k2_engine_doubles` (or `k2_engine_cpu_build`); refused on any other inventory.",
        default=False,
    )
    engine_doubles: bool = _key(
        FLEET, "Sandbox only: install k2fleet's engine test doubles instead of real engines.", default=False
    )
    engine_cpu_build: bool = _key(
        FLEET,
        "Sandbox only, with `k2_simulated_gpus`: the real engine's CPU build instead of the test doubles (vLLM in "
        "a venv), installed as the pinned release from the sandbox's engine wheelhouse with no package index.",
        default=False,
    )
    # --- host bootstrap (driver, fabric, container runtime) --------------------------
    os: Literal["ubuntu-22.04", "ubuntu-24.04", "debian-12", "debian-13", "rhel-9", "rocky-9"] | None = _key(
        HOST,
        "The host's OS release, which selects the bootstrap's package table; default "
        "`ubuntu-22.04` (the deploy compares it with the host's /etc/os-release). Engine venvs use the "
        "release's Python (ubuntu-22.04: python3.11 from universe; rhel-9: python3.12).",
        default=None,
    )
    driver_branch: DriverBranch | None = _key(
        FLEET,
        "NVIDIA driver branch, e.g. 580; default: the first data-center branch at or above the "
        "minimum of the engine's CUDA build and the GPU (vLLM 0.33/SGLang 0.5.23: 580). Lower is refused.",
        default=None,
    )
    driver_flavour: Literal["open", "proprietary"] | None = _key(
        FLEET, "NVIDIA kernel modules: `open` (default; required on Blackwell) or `proprietary`.", default=None
    )
    driver_version: DriverVersion | None = _key(
        FLEET,
        "Exact NVIDIA driver version within the branch (e.g. `580.95.05`); fabric manager, NSCQ and "
        "IMEX are pinned to it. Default: the branch's newest, fabric packages at the installed driver's version.",
        default=None,
    )
    reboot: Literal["never", "if-needed", "rolling"] = _key(
        FLEET,
        "Reboots after a driver change: `never` (stop, naming the hosts that need one), `if-needed`, "
        "`rolling` (one host at a time).",
        default="if-needed",
    )
    # --- k2_gpu_stack: hosts as delivered (one block) ----------------------------------
    gpu_stack: Literal["install", "provided"] = _key(
        FLEET,
        "Who owns the GPU stack: `install` (k2fleet installs the driver at its branch, fabric manager, container "
        "toolkit and Docker, holds them and reboots for a driver change) or `provided` (hosts as delivered: DGX OS, "
        "a cloud GPU image, a golden image): k2fleet installs, removes, holds and starts none of them and never "
        "reboots for them; it reads the loaded driver against the engine's CUDA build (and `k2_driver_branch`/"
        "`k2_driver_version` when set), the fabric manager, the toolkit, Docker and the kernel modules, and refuses "
        "a host that cannot serve in one line. The GPU gate and the fabric gate run as with `install`.",
        default="install",
    )
    imex_address: Address | None = _key(
        HOST,
        "GB200/GB300: this host's IP in IMEX's nodes_config.cfg; default `k2_address` (must be an IP).",
        default=None,
    )
    # --- serving features --------------------------------------------------------
    tool_parser: ParserName | None = _key(
        FLEET, "Tool-call parser (`--tool-call-parser`); the default `kimi_k2` means the catalog's parser of a "
        "known model (`kimi_k3` for Kimi-K3).", default="kimi_k2")
    reasoning_parser: ParserName | None = _key(
        FLEET, "Reasoning parser; default the catalog's for thinking models (`kimi_k2`; `kimi_k3` for Kimi-K3), "
        "none otherwise.", default=None
    )
    auto_tool_choice: bool = _key(FLEET, "vLLM `--enable-auto-tool-choice`.", default=True)
    max_model_len: PosInt | None = _key(FLEET, "Context length cap (`--max-model-len`, `--context-length`).", default=None)
    profile: Literal["default", "latency", "throughput", "long-context"] = _key(
        FLEET,
        "Tuning profile from the seeds, rendered per engine and pinned version (docs/engines.md, \"Tuning profiles\"): "
        "`default` (the engine's defaults), `latency`, `throughput` or `long-context` (batch, chunked-prefill "
        "and CUDA-graph sizes; TRT-LLM LLM API options). `k2_engine_args` / `k2_trtllm_config` win over it; "
        "it never changes the context length (`k2_max_model_len`).",
        default="default",
    )
    # --- ports -------------------------------------------------------------------
    port: Port = _key(FLEET, "OpenAI API port of each serving process.", default=8000)
    api_key_file: AbsPath | None = _key(
        FLEET,
        "File on the control machine holding the API key clients must send (`Authorization: Bearer KEY`); "
        "default: endpoints are open. Like `k2_hub_token_file` it must be the deploying user's, not empty and "
        "0600, checked at validate; hosts get it in root-only files (vLLM: an env file the unit reads, "
        "`EnvironmentFile=`; the others: the front's pattern file), never in argv, logs or the plan. vLLM reads "
        "it itself (`VLLM_API_KEY`); SGLang (its PD router), TRT-LLM and KTransformers get k2fleet's "
        "authenticating front (`k2-api-front.service`, HAProxy on `k2_port`/`k2_router_port`, the engine on "
        "127.0.0.1:`k2_api_backend_port`).",
        default=None,
    )
    api_backend_port: Port = _key(
        FLEET,
        "With `k2_api_key_file` and an engine that cannot take the key itself (SGLang, its PD router, "
        "TRT-LLM, KTransformers), or with `k2_tls_cert_file` (every engine): the port the engine (or router) "
        "listens on, on 127.0.0.1 only, behind the API front that took its place on `k2_port` (`k2_router_port`).",
        default=8001,
    )
    tls_cert_file: AbsPath | None = _key(
        FLEET,
        "PEM certificate on the control machine (the server's first, then any intermediates) the endpoints "
        "serve over HTTPS; with `k2_tls_key_file` and `k2_tls_ca_file` (all three or none). Every endpoint "
        "clients call is then k2fleet's HAProxy front terminating TLS (`k2-api-front.service` before each "
        "engine and the PD router, the engine on 127.0.0.1:`k2_api_backend_port`; vLLM too) and the load "
        "balancer (`k2_load_balancer`) serves HTTPS and calls the replicas over HTTPS. It must verify against "
        "`k2_tls_ca_file` and name every endpoint host's fleet address (the IP clients call) in its "
        "subjectAltName, checked at validate. Default: plain HTTP (`k2fleet plan` says so).",
        default=None,
    )
    tls_key_file: AbsPath | None = _key(
        FLEET,
        "PEM private key of `k2_tls_cert_file` on the control machine: the deploying user's, 0600 and "
        "unencrypted, matching the certificate (checked at validate). Hosts that serve HTTPS get certificate "
        "and key as one root-only (0600) file created with that mode, read by HAProxy alone.",
        default=None,
    )
    tls_ca_file: AbsPath | None = _key(
        FLEET,
        "PEM CA certificate(s) on the control machine that every k2fleet client verifies the endpoints "
        "against, with the address it calls checked against the certificate: the deploy's health gate (hosts "
        "get it as a root-only file), the load balancer's calls to the replicas, `k2fleet status --completion`, "
        "`bench` and `eval` (`SSL_CERT_FILE`), and the printed `curl --cacert` line.",
        default=None,
    )
    router_port: Port = _key(FLEET, "PD router's API port (router host).", default=8000)
    master_port: Port = _key(FLEET, "vLLM `--master-port` (multi-node without Ray).", default=29501)
    dp_rpc_port: Port = _key(FLEET, "vLLM `--data-parallel-rpc-port`.", default=13345)
    ray_port: Port = _key(FLEET, "Ray head GCS port.", default=6379)
    dist_init_port: Port = _key(FLEET, "SGLang `--dist-init-addr` port.", default=50000)
    bootstrap_port: Port = _key(FLEET, "SGLang PD `--disaggregation-bootstrap-port`.", default=8998)
    mesh_port: Port = _key(FLEET, "Port of k2fleet's own sshd for the SSH mesh (mpirun).", default=2233)
    relay_port: Port = _key(
        FLEET,
        "Port of the checkpoint relay while the fleet receives the checkpoint: each host serves its verified "
        "shards to its peers on its address, and the control machine's copy reaches a host on its own "
        "127.0.0.1 at this port through the deploy's SSH connection.",
        default=29700,
    )
    firewall: bool = _key(
        FLEET,
        "k2fleet's nftables table (`table inet k2fleet`, its own unit `k2-firewall.service`) on every host: "
        "rendezvous and control ports (Ray, torch store, DP RPC, dist-init, mesh sshd, relay, PD backends, "
        "the engines' ephemeral ports) only from the fleet's addresses, the API port from `k2_api_clients`, "
        "the SSH port pyinfra uses always open, nothing else touched. Its rules hold the fleet's IPs (DNS "
        "names resolved on the control machine). `False` removes the table and its unit.",
        default=True,
    )
    api_clients: Annotated[list[Cidr], AfterValidator(cidr_list)] | None = _key(
        FLEET,
        "Who may reach the API port (`k2_port`, the PD router's `k2_router_port`) when `k2_firewall` is on: "
        "IPv4/IPv6 addresses or networks, e.g. `['10.0.0.0/8']` (the fleet always may). Default: anyone.",
        default=None,
    )
    metrics: bool = _key(
        FLEET,
        "Metrics on (docs/operations.md, \"Metrics\"): SGLang (and sglang-kt) get `--enable-metrics` (vLLM and TRT-LLM serve "
        "`/metrics` on the API port anyway), GPU hosts' dcgm-exporter port 9400 (real GPUs, or `k2_gpu_exporter`) and, with `k2_node_exporter`, "
        "port 9100 are opened to `k2_metrics_scrapers` and the fleet; `k2fleet metrics` writes the scrape "
        "configuration.",
        default=False,
    )
    metrics_scrapers: Annotated[list[Cidr], AfterValidator(cidr_list)] | None = _key(
        FLEET,
        "With `k2_metrics`: who may scrape when `k2_firewall` is on: IPv4/IPv6 addresses or networks of the "
        "Prometheus servers, e.g. `['10.0.9.5']`. They reach the exporter ports and the API port's `/metrics` "
        "(added to `k2_api_clients` when that is set). Default: the fleet only.",
        default=None,
    )
    node_exporter: bool = _key(
        FLEET,
        "Install the OS's Prometheus node exporter (Debian/Ubuntu `prometheus-node-exporter`, its own unit, "
        "port 9100) on every host; RHEL 9 has no such package in its base repositories: refused there.",
        default=False,
    )
    gpu_exporter: bool = _key(
        FLEET,
        "With `k2_metrics`: run NVIDIA's dcgm-exporter on every GPU host as `k2-dcgm-exporter.service` "
        "(the pinned `k2_gpu_exporter_image` under Docker and the NVIDIA container toolkit, which the bootstrap "
        "adds on venv-runtime hosts; port 9400, opened to `k2_metrics_scrapers` and the fleet; a `dcgm` target "
        "of `k2fleet metrics`). NVIDIA GPUs only: refused on AMD. Sandbox: a TEST DOUBLE image.",
        default=False,
    )
    gpu_exporter_image: ImageRef = _key(
        FLEET,
        "The dcgm-exporter image `k2_gpu_exporter` runs (NVIDIA's README's tag: "
        "`<DCGM version>-<exporter version>-ubuntu22.04`).",
        default="nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04",
    )
    gpu_exporter_image_id: ImageId | None = _key(
        FLEET,
        "Image ID (`sha256:...`) `k2_gpu_exporter_image` must be: hosts pull the reference and check it, and "
        "`k2-dcgm-exporter.service` refuses to start any other image under it (as `k2_image_id` for the engine). "
        "Sandbox: the TEST DOUBLE image's own ID.",
        default=None,
    )
    mesh_user: PosixUser = _key(FLEET, "User mpirun connects as over the mesh.", default="root")
    bind_address: Literal["all", "fleet"] = _key(
        FLEET,
        "Where the engines, the PD router, the load balancer and dcgm-exporter listen: `all` (default: 0.0.0.0, every interface, as the "
        "vendor guides run them; k2_firewall still limits who reaches the API port) or `fleet` (each host's "
        "own fleet address only, `k2_address`; the health gate then calls that address, not 127.0.0.1).",
        default="all",
    )
    mesh_after_deploy: Literal["keep", "stop"] = _key(
        FLEET,
        "The SSH mesh's sshd (only on the hosts mpirun logs into) after a healthy deploy: `keep` "
        "(default: a crashed mpirun service can restart by itself) or `stop` (no listener between "
        "deploys; the running job keeps its sessions; a restart of the mpirun service then needs a "
        "deploy, which starts the mesh for its duration).",
        default="keep",
    )
    health_timeout: PosInt = _key(FLEET, "Seconds to wait for a real completion before failing.", default=3600)
    # --- rolling changes -------------------------------------------------------------
    rollout: Literal["rolling", "all-at-once"] = _key(
        FLEET,
        "How a change restarts serving instances that are running: `rolling` (default: one instance at a time "
        "— drained at `k2_load_balancer` when there is one, restarted, health-gated, put back — while the "
        "others keep serving; under `k2_reboot: rolling` driver reboots go instance by instance too) or "
        "`all-at-once` (every changed instance restarts together: faster, with an outage).",
        default="rolling",
    )
    load_balancer: HostName | None = _key(
        FLEET,
        "Inventory host that runs k2fleet's load balancer in front of the `serve` replicas (`k2-lb.service`: "
        "HAProxy from the OS package, health checks on the engines' health path, drained through its "
        "root-only admin socket during a rolling change), listening on that host's bind address and "
        "`k2_load_balancer_port`. Default: none (clients call the replicas themselves). Not with PD roles "
        "(the SGLang router balances) or `slurm-submit`.",
        default=None,
    )
    load_balancer_port: Port = _key(
        FLEET, "Port of `k2_load_balancer` (the replicas' endpoint clients call).", default=8080
    )
    drain_timeout: PosInt = _key(
        FLEET,
        "Rolling change: seconds to wait, at most, for a drained replica's requests in flight to finish at the "
        "load balancer before its units restart anyway (an LLM stream can run for minutes).",
        default=300,
    )
    # --- topology ------------------------------------------------------------------
    role: Role = _key(
        POOL,
        "What this host runs: `serve` (default), `prefill`, `decode`, `router` (SGLang PD), "
        "`slurm-submit` (TRT-LLM SLURM login node).",
        default="serve",
    )
    tp: PosInt | None = _key(POOL, "Tensor parallel size; default `k2_gpus_per_node`.", default=None)
    pp: PosInt = _key(POOL, "Pipeline parallel size.", default=1)
    dp: PosInt = _key(POOL, "Data parallel size (vLLM DP ranks / SGLang `--dp-size`).", default=1)
    ep: PosInt = _key(POOL, "Expert parallel size; 1 = off. vLLM: must equal tp×dp.", default=1)
    dcp: PosInt = _key(POOL, "vLLM decode context parallel size; must divide `k2_tp`.", default=1)
    attn_dp: bool = _key(POOL, "DP attention (SGLang `--enable-dp-attention`, TRT-LLM `enable_attention_dp`).", default=False)
    multinode_backend: Literal["ray", "mp"] = _key(
        POOL, "vLLM across nodes: `ray` (Ray cluster) or `mp` (`--nnodes/--node-rank`, headless ranks).", default="mp"
    )
    engine_args: EngineArgs = _key(
        POOL,
        "Extra engine flags `{flag: value}` (`True` = bare flag). Renamed flags are translated "
        "for the pinned version.",
        default_factory=dict,
    )
    env: EnvMap = _key(POOL, "Extra environment for the engine process.", default_factory=dict)
    gpu_memory_utilization: Fraction | None = _key(
        POOL, "Fraction of GPU memory the engine may use (vLLM `--gpu-memory-utilization`, SGLang "
        "`--mem-fraction-static`); default the engine's own at its pin (vLLM 0.92 at 0.33.0, 0.9 before; SGLang "
        "computes it from its runtime reserve).", default=None
    )
    expected_concurrency: PosInt = _key(
        POOL,
        "Requests of the full context length (`k2_max_model_len`, default the model's) each serving instance "
        "must hold in its KV cache at once; validate refuses a context length the predicted KV cache cannot "
        "hold this many times (`k2fleet plan` shows the prediction). Default 1: what the engine needs to start.",
        default=1,
    )
    trtllm_config: TrtllmConfig = _key(
        POOL, "TRT-LLM extra LLM API options YAML (`--config`), merged over k2fleet's parallel keys.", default_factory=dict
    )
    slurm: SlurmConfig | None = _key(
        POOL, "TRT-LLM SLURM submit: `slurm`, `benchmark`, `hardware`, `environment` sections of config.yaml.", default=None
    )
    disagg: DisaggConfig | None = _key(
        POOL, "TRT-LLM SLURM disaggregation: `{ctx: {...LLM API...}, gen: {...}}` worker configs.", default=None
    )
    kt: KtConfig = _key(
        POOL,
        "KTransformers settings: `method` (AMXINT4, AMXINT8, LLAMAFILE), `cpuinfer`, "
        "`threadpool_count`, `gpu_experts`, `optimize_rules` (legacy server), `cache_lens`.",
        default_factory=dict,
    )
    # --- engine flags and capacity (issue 34 items 4 and 5) ------------------------------
    moe_a2a_backend: ParserName | None = _key(
        POOL,
        "All-to-all backend of expert parallel (`k2_ep` > 1): SGLang `--moe-a2a-backend`, vLLM "
        "`--all2all-backend` (0.33) or `VLLM_ALL2ALL_BACKEND` (0.10, 0.11), unused while `k2_ep` is 1; checked "
        "against the pin's choices "
        "(`k2fleet.planning.engine_flags.A2A_BACKENDS`). Default: SGLang `deepep`, vLLM its own "
        "(`allgather_reducescatter`). DeepEP across nodes needs RDMA: `k2_ib_hcas` on every host of the instance.",
        default=None,
    )
    runtime_reserve_gib: NonNegNumber | None = _key(
        POOL,
        "GPU memory (GiB per GPU) the engine uses beside weights and KV cache (activations, CUDA graphs, "
        "NCCL/library workspaces), as the capacity prediction subtracts it; default per engine, pin and GPU "
        "(`k2fleet plan` names it and its source). Set it from your engine's own start-up log.",
        default=None,
    )
    # --- per host --------------------------------------------------------------------
    address: Address | None = _key(
        HOST, "Fleet-internal address (IP or DNS name); default `ssh_hostname`, else the host name. A name is "
        "resolved once per run on the control machine to one IP, which every engine, mesh and firewall value "
        "uses; set an IP here when the name has several addresses or resolves only inside the fleet.",
        default=None)
    nic: IfName | None = _key(HOST, "Interface for NCCL/Gloo sockets (`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`).", default=None)
    ib_hcas: IbHcas = _key(HOST, "InfiniBand HCAs (`NCCL_IB_HCA`, SGLang `--disaggregation-ib-device`), each once.",
                           default_factory=list)
    # --- the RDMA fabric (issue 34 item 2): what the preflight's fabric gate expects of each k2_ib_hcas port ---
    ib_link_layer: Literal["InfiniBand", "Ethernet"] | None = _key(
        HOST, "Link layer every `k2_ib_hcas` port must have (sysfs `ports/N/link_layer`: `InfiniBand`, or "
        "`Ethernet` for RoCE); unset: either. An Ethernet (RoCE) port always needs a non-zero RoCE v2 GID.",
        default=None)
    ib_rate_gbps: PosInt | None = _key(
        HOST, "Least rate in Gb/s every `k2_ib_hcas` port must run at (sysfs `ports/N/rate`, e.g. 400 for "
        "`400 Gb/sec (4X NDR)`): a link trained down is refused before any engine starts; unset: any rate.",
        default=None)
    ib_gid_index: IbGidIndex | None = _key(
        HOST, "RoCE GID index (`NCCL_IB_GID_INDEX`, `NVSHMEM_IB_GID_INDEX`): the gate needs a non-zero RoCE v2 "
        "GID there on every Ethernet port; unset: NCCL and NVSHMEM pick one themselves.", default=None)


def scope_of(name: str) -> str:
    extra = HostSettings.model_fields[name].json_schema_extra
    assert isinstance(extra, dict)
    return str(extra["scope"])


class SpecError(Exception):
    """A bad inventory: ``key`` is the inventory key to fix, the message says how."""

    def __init__(self, key: str, message: str, where: str = "") -> None:
        self.key, self.message, self.where = key, message, where
        super().__init__(str(self))

    def __str__(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        return f"{prefix}{self.key}: {self.message}"


@dataclass(frozen=True)
class HostEntry:
    """One inventory host: its name, pyinfra data it connects with, its k2 settings."""

    name: str
    settings: HostSettings
    ssh_hostname: str | None = None
    groups: tuple[str, ...] = ()
    ssh_port: int | None = None  # pyinfra's port (None: 22); the firewall never closes it
    ip: str | None = None  # the IP the control machine resolved a DNS-name address to (k2fleet.control.addresses)

    @property
    def configured_address(self) -> str:
        """The fleet address as the inventory gives it: ``k2_address``, else ``ssh_hostname``,
        else the host name (an IP literal or a DNS name)."""
        return self.settings.address or self.ssh_hostname or self.name

    @property
    def address_key(self) -> str:
        """The inventory key :attr:`configured_address` comes from (``inventory``: the host name)."""
        return "k2_address" if self.settings.address else "ssh_hostname" if self.ssh_hostname else "inventory"

    @property
    def address(self) -> str:
        """The host's fleet address: what engines, the mesh and the firewall use. Planning
        receives fleets whose names were resolved to IPs once per run by the gate
        (:func:`k2fleet.control.addresses.resolve_addresses`); ``ssh_hostname`` stays what
        pyinfra connects to."""
        return self.ip or self.configured_address


@dataclass
class Fleet:
    """A validated inventory: hosts in inventory order, grouped into role pools."""

    source: str
    hosts: list[HostEntry]
    pools: dict[str, list[HostEntry]] = field(default_factory=dict)
    # `k2_egress: mirrors-only`: each repository/mirror/index host name the plan reaches → its IPs,
    # resolved once per run on the control machine (k2fleet.control.addresses.resolve_egress)
    egress_ips: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def settings(self) -> HostSettings:
        """Fleet-scope settings (identical on every host by construction)."""
        return self.hosts[0].settings


def _loc_key(loc: tuple[Any, ...], err: Any) -> str:
    """The inventory key a pydantic error is about, with its nested path (``k2_kt.cpuinfer``)."""
    parts = [p for p in loc if p != "[key]"]
    if err.get("type") == "k2_nested" and err["ctx"].get("path"):
        return PREFIX + _path_text(parts) + "." + str(err["ctx"]["path"])
    return PREFIX + _path_text(parts) if parts else "inventory"


def check_host_identity(name: Any, ssh_hostname: Any, where: str = "") -> None:
    """The inventory host name and its ``ssh_hostname`` (the default ``k2_address``)."""
    if not isinstance(name, str):
        raise SpecError("inventory", f"host name {show(name)} is not a string", where)
    try:
        _pattern(HOST_NAME_RE, "a host name: 1-63 of A-Z a-z 0-9 . _ -, starting with a letter or digit")(name)
    except ValueError as exc:
        raise SpecError("inventory", f"host name {exc}", where) from None
    if ssh_hostname is not None:
        if not isinstance(ssh_hostname, str):
            raise SpecError("ssh_hostname", f"must be a string (got {show(ssh_hostname)} on host {name})", where)
        try:
            address(no_control(ssh_hostname))
        except ValueError as exc:
            raise SpecError("ssh_hostname", f"{exc} on host {name}", where) from None


class _ConnectionKeys(BaseModel):
    """pyinfra's own connection keys that k2fleet passes on (the checkpoint push's ssh
    and rsync argv): checked like every k2_* value."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=False)
    ssh_user: PosixUser | None = None
    ssh_port: Port | None = None
    ssh_key: RelOrAbsPath | None = None
    ssh_known_hosts_file: RelOrAbsPath | None = None
    ssh_config_file: RelOrAbsPath | None = None  # the side channels' ssh -F (a ProxyJump there is honoured)
    sudo_user: PosixUser | None = Field(None, alias="_sudo_user")


CONNECTION_KEYS = ("ssh_user", "ssh_port", "ssh_key", "ssh_known_hosts_file", "ssh_config_file", "_sudo_user")


def check_connection_keys(name: str, data: dict[str, Any], where: str = "") -> None:
    """``ssh_user``, ``ssh_port``, ``ssh_key``, ``ssh_known_hosts_file``, ``ssh_config_file``,
    ``_sudo_user`` of one host.

    >>> check_connection_keys("n1", {"ssh_user": "root", "ssh_port": 22})
    >>> try:
    ...     check_connection_keys("n1", {"ssh_port": True})
    ... except SpecError as exc:
    ...     print(exc)
    ssh_port: Input should be a valid integer (got True) on host n1
    >>> for bad in ({"_sudo_user": "bad user"}, {"ssh_config_file": "x" * 5000}):
    ...     try:
    ...         check_connection_keys("n1", bad)
    ...     except SpecError as exc:
    ...         print(str(exc)[:60])
    _sudo_user: must be a POSIX user name [a-z_][a-z0-9_-]{0,31}
    ssh_config_file: is 5000 characters; values are at most 4096
    """
    given = {k: v for k, v in data.items() if k in CONNECTION_KEYS and v is not None}
    for key, value in given.items():
        if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
            raise SpecError(key, f"is {len(value)} characters; values are at most {MAX_STRING_CHARS} characters "
                                 f"(on host {name})", where)
    try:
        _ConnectionKeys(**given)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise SpecError(str(err["loc"][0]), f"{_pydantic_message(err)} on host {name}", where) from None


def parse_host(name: str, data: dict[str, Any], where: str = "", groups: tuple[str, ...] = ()) -> HostEntry:
    """Type-check one host's ``k2_*`` keys.

    >>> parse_host("n1", {"k2_model": "m/x", "k2_revision": "0"*40, "k2_engine": "vllm",
    ...                   "k2_gpu": "h200"}).settings.port
    8000
    """
    keys = {k[len(PREFIX):]: v for k, v in data.items() if isinstance(k, str) and k.startswith(PREFIX)}
    for key in keys:
        if key not in HostSettings.model_fields:
            close = difflib.get_close_matches(key, HostSettings.model_fields, n=1)
            hint = f"did you mean {PREFIX}{close[0]}?" if close else "see `k2fleet keys` for the list"
            raise SpecError(PREFIX + _path_text([key]), f"unknown key on host {name}; {hint}", where)
    try:  # bounds first: every later check may recurse into and walk a value
        check_bounds(keys)
    except _Nested as exc:
        raise SpecError(PREFIX + _path_text(exc.path), f"{exc.message} (on host {name})", where) from None
    check_host_identity(name, data.get("ssh_hostname"), where)
    check_connection_keys(name, data, where)
    for key, value in keys.items():  # secrets first: their message never echoes the value
        try:
            scan_secrets(value, (), env_names=key == "env", flag_names=key == "engine_args")
        except _Nested as exc:
            path = PREFIX + _path_text((key, *exc.path))
            raise SpecError(path, f"{exc.message} (on host {name})", where) from None
    try:
        settings = HostSettings(**keys)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc_key = _loc_key(tuple(err["loc"]), err)
        if err["type"] == "missing" and len(err["loc"]) == 1:
            msg = f"required on host {name} but not set; {HostSettings.model_fields[str(err['loc'][0])].description}"
        else:
            msg = f"{_pydantic_message(err)} on host {name}"
        raise SpecError(loc_key, msg, where) from None
    return HostEntry(name=name, settings=settings, ssh_hostname=data.get("ssh_hostname"), groups=groups,
                     ssh_port=data.get("ssh_port"))


def build_fleet(source: str, entries: list[HostEntry]) -> Fleet:
    """Group hosts into pools, check host names and addresses are unique and that
    fleet/pool scoped keys agree."""
    if not entries:
        raise SpecError("inventory", "no hosts", source)
    seen_names: dict[str, HostEntry] = {}
    seen_addresses: dict[str, HostEntry] = {}
    for entry in entries:
        check_host_identity(entry.name, entry.ssh_hostname, source)
        twice = sorted({g for g in entry.groups if entry.groups.count(g) > 1})
        if entry.name in seen_names or twice:
            where_twice = f" in group {', '.join(twice)}" if twice else ""
            raise SpecError("inventory", f"host name {entry.name} is listed twice{where_twice}; host names must be "
                            "unique (pyinfra would merge the two into one host)", source)
        seen_names[entry.name] = entry
        addr = entry.address
        key = entry.address_key
        try:
            address(addr)
        except ValueError as exc:
            raise SpecError(key, f"{exc} (address of host {entry.name})", source) from None
        canonical = addr.lower().rstrip(".")
        try:
            canonical = str(ipaddress.ip_address(addr))
        except ValueError:
            pass
        other = seen_addresses.get(canonical)
        if other is not None:
            raise SpecError(
                key,
                f"hosts {other.name} and {entry.name} both have address {addr}; every host needs its own "
                "address (set k2_address or ssh_hostname)",
                source,
            )
        seen_addresses[canonical] = entry
    first = entries[0]
    pools: dict[str, list[HostEntry]] = {}
    for entry in entries:
        pools.setdefault(entry.settings.role, []).append(entry)
    for name in HostSettings.model_fields:
        scope = scope_of(name)
        if scope == HOST:
            continue
        for entry in entries:
            ref = first if scope == FLEET else pools[entry.settings.role][0]
            a, b = getattr(ref.settings, name), getattr(entry.settings, name)
            if a != b:
                what = "every host" if scope == FLEET else f"every {entry.settings.role} host"
                raise SpecError(
                    PREFIX + name,
                    f"must be the same on {what}, but {ref.name} has {show(a)} and {entry.name} has {show(b)}; "
                    "set it in group data",
                    source,
                )
    return Fleet(source=source, hosts=entries, pools=pools)


def keys_markdown() -> str:
    """The Markdown table of every inventory key (docs/inventory-keys.md holds it)."""
    lines = ["| key | scope | default | meaning |", "|---|---|---|---|"]
    for name, info in HostSettings.model_fields.items():
        if info.is_required():
            default = "**required**"
        elif info.default_factory is not None:
            default = f"`{info.default_factory()!r}`"
        else:
            default = f"`{info.default!r}`"
        lines.append(f"| `{PREFIX}{name}` | {scope_of(name)} | {default} | {info.description} |")
    return "\n".join(lines) + "\n"
