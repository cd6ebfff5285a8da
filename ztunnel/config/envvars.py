"""The syntax of the proxy's environment variables: typed reads, value parsers, one-line errors.

`Env` reads one variable through a parser; a parser takes the text and returns the value or raises
`ValueError` with the reason, which `Env` turns into a `ConfigError` naming the variable and value.
"""

from __future__ import annotations

import ipaddress
import re
import ssl
import sys
from collections.abc import Callable, Mapping
from typing import TypeVar
from urllib.parse import urlsplit

from ztunnel.logs.lines import parse_filter

Address = tuple[str, int]

T = TypeVar("T")


class ConfigError(Exception):
    """A startup configuration error; its message is one line, fit for a user."""


class Env:
    """Typed access to the environment; every failure is a one-line ConfigError naming the variable."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    def raw(self, name: str) -> str | None:
        return self.environ.get(name)

    def text(self, name: str) -> str | None:
        """A string variable where the empty string means unset."""
        value = self.environ.get(name)
        return value if value else None

    def parse(self, name: str, parser: Callable[[str], T], default: T) -> T:
        value = self.environ.get(name)
        if value is None:
            return default
        try:
            return parser(value)
        except ValueError as e:
            raise env_error(name, value, str(e)) from None

    def error(self, name: str, reason: str) -> ConfigError:
        return env_error(name, self.environ.get(name, ""), reason)


def env_error(name: str, value: str, reason: str) -> ConfigError:
    one_line = value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return ConfigError(f"invalid env var {name}={one_line} ({reason})")


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered == "true":
        return True
    if lowered == "false":
        return False
    raise ValueError("expected true or false")


_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h|d)")
_PLAIN_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")


def parse_duration(value: str) -> float:
    """Seconds from `500ms`, `30s`, `5m`, `24h`, `1h30m`, or a plain number of seconds."""
    text = value.strip()
    if _PLAIN_NUMBER.fullmatch(text):
        return float(text)
    total = 0.0
    pos = 0
    while pos < len(text):
        m = _DURATION_PART.match(text, pos)
        if m is None:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if pos == 0 or pos != len(text):
        raise ValueError("expected a duration such as 500ms, 30s, 5m, 24h or 1h30m")
    return total


def int_parser(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            n = int(value.strip(), 10)
        except ValueError:
            raise ValueError("expected an integer") from None
        if n < minimum:
            raise ValueError(f"must be at least {minimum}")
        if maximum is not None and n > maximum:
            raise ValueError(f"must be at most {maximum}")
        return n

    return parse


def positive_duration(value: str) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError("must be greater than zero")
    return seconds


def ip_text(value: str) -> str:
    """An IP address setting in its canonical text."""
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        raise ValueError("expected an IP address") from None


def parse_address(value: str, *, allow_localhost: bool = False) -> Address:
    """`ip:port` or `[ipv6]:port` (and `localhost:port` where the reference accepts it)."""
    text = value.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep or ":" not in host:
            raise ValueError("expected ip:port")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host:
            raise ValueError("expected ip:port")
    if not (allow_localhost and host == "localhost"):
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            raise ValueError("expected ip:port") from None
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected ip:port with a port in 0-65535")
    return host, int(port)


def parse_compliance_policy(value: str) -> str:
    """The policy named ("" for none). Only `pqc` changes the reference's TLS, and it is refused here
    rather than silently ignored; any other value (Istio's `fips-140-2`, `fips-140-3`) is taken and
    not enforced, as by the reference, and the proxy warns of it once at start.

    `pqc` restricts key exchange to X25519MLKEM768 alone. `cryptography`'s bundled OpenSSL (3.5 or
    later) has that group, and HBONE's TLS can run on it through pyOpenSSL, but no public pyOpenSSL
    API restricts a context's groups: `SSL.Context` has no `set_groups` (OpenSSL's
    `SSL_CTX_set1_groups_list`), and `set_tmp_ecdh` takes elliptic curves only. Python's `ssl`
    gains `SSLContext.set_groups` in 3.15, and runs on the system's OpenSSL."""
    if value == "pqc":
        raise ValueError(pqc_unsupported())
    return value


def pqc_unsupported() -> str:
    """Why `COMPLIANCE_POLICY=pqc` cannot be honoured here: the missing API, named with the versions
    that lack it."""
    from importlib.metadata import version

    from cryptography.hazmat.backends.openssl import backend
    from OpenSSL import SSL

    engine = f"pyOpenSSL {version('pyopenssl')} on {backend.openssl_version_text()}"
    if hasattr(SSL.Context, "set_groups"):
        missing = f"{engine} has SSL.Context.set_groups, which this build does not use yet"
    else:
        missing = f"{engine} has no SSL.Context.set_groups (SSL_CTX_set1_groups_list)"
    python = f"Python {sys.version_info.major}.{sys.version_info.minor}"
    stdlib = "" if hasattr(ssl.SSLContext, "set_groups") else " has no SSLContext.set_groups and"
    return (
        f"not supported: it restricts key exchange to X25519MLKEM768 alone, and no public API here "
        f"selects key-exchange groups: {missing}; {python}'s ssl{stdlib} runs on {ssl.OPENSSL_VERSION}"
    )


def parse_log_level(value: str) -> str:
    parse_filter(value)
    return value


def parse_control_plane_uri(value: str) -> str:
    """A gRPC server URI; a value without scheme gets `https://` as in the reference."""
    uri = value.strip()
    if "://" not in uri:
        uri = "https://" + uri
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        raise ValueError("expected an http:// or https:// address")
    try:
        host, _ = parts.hostname, parts.port
    except ValueError:
        raise ValueError("invalid port") from None
    if not host:
        raise ValueError("missing host")
    return uri


_HEADER_KEY = re.compile(r"[0-9a-z_.-]+")


def grpc_headers(env: Env, prefix: str) -> tuple[tuple[str, str], ...]:
    headers = []
    for name in sorted(env.environ):
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :].lower()
        value = env.environ[name]
        if not _HEADER_KEY.fullmatch(key) or key.endswith("-bin"):
            raise env_error(name, value, "invalid gRPC metadata key")
        if not all(0x20 <= ord(c) < 0x7F for c in value):
            raise env_error(name, value, "invalid gRPC metadata value")
        headers.append((key, value))
    return tuple(headers)
