"""Putting `ztunnel-cni` on the node, as istio-cni's installer does (`ztunnel cni-agent` with
`--cni-bin-dir` and `--cni-conf-dir`; `--uninstall` to take it off).

Install writes the plugin into the host's CNI bin directory and chains it, last, into the node's
primary network configuration: the lexically first `.conflist`, `.conf` or `.json` file of the CNI
conf directory (a single-plugin `.conf` is rewritten as a `.conflist`, as libcni reads both). The
node's primary CNI may rewrite its file at any time; `ChainKeeper.ensure()`, called periodically by
the agent, chains the plugin again, and moves it when another file becomes the primary. Uninstall
takes the plugin out of every configuration of the directory and removes the executable.

The plugin runs on the node, not in the agent's container, so what is copied is a self-contained
executable zip of the standard-library-only plugin (`cni.plugin`, `cni.events`, `cni/__init__.py`),
run by the node's `python3` (3.11 or later). Every file is replaced atomically (written beside, then
renamed), so the container runtime never reads half a configuration or half a plugin.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("cni.install")

PLUGIN_TYPE = "ztunnel-cni"
PLUGIN_FILE = "ztunnel-cni"
CONF_SUFFIXES = (".conflist", ".conf", ".json")
DEFAULT_INTERPRETER = "/usr/bin/env python3"
_PLUGIN_SOURCES = ("__init__.py", "events.py", "plugin.py")
_ZIP_MAIN = "import sys\nfrom cni.plugin import main\n\nsys.exit(main())\n"


class InstallError(Exception):
    """The plugin cannot be installed or removed; the message names the file and the reason."""


@dataclass(frozen=True)
class InstallConfig:
    bin_dir: Path
    conf_dir: Path
    agent_socket: str  # the agent's CNI socket as the node sees it (the plugin runs on the node)
    interpreter: str = DEFAULT_INTERPRETER
    exclude_namespaces: tuple[str, ...] = ()  # pods the plugin passes through


def plugin_executable(interpreter: str = DEFAULT_INTERPRETER) -> bytes:
    """The plugin as one executable file: a `#!` line, then a zip of the plugin's modules."""
    package = Path(__file__).parent
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("__main__.py", _ZIP_MAIN)
        for name in _PLUGIN_SOURCES:
            zf.write(package / name, f"cni/{name}")
    return f"#!{interpreter}\n".encode() + buffer.getvalue()


def primary_conf(conf_dir: Path) -> Path | None:
    """The node's primary network configuration: the lexically first, as the kubelet's runtime picks."""
    try:
        names = sorted(
            entry.name
            for entry in os.scandir(conf_dir)
            if entry.name.endswith(CONF_SUFFIXES) and not entry.name.startswith(".") and entry.is_file()
        )
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InstallError(f"cannot list {conf_dir}: {e.strerror or e}") from None
    return conf_dir / names[0] if names else None


def plugin_entry(agent_socket: str, exclude_namespaces: tuple[str, ...] = ()) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": PLUGIN_TYPE, "agentSocket": agent_socket}
    if exclude_namespaces:
        entry["excludeNamespaces"] = list(exclude_namespaces)
    return entry


def chained(conf: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """`conf` as a configuration list with `entry` as its last plugin (any earlier copy dropped)."""
    if "plugins" in conf:
        plugins = conf["plugins"]
        if not isinstance(plugins, list):
            raise ValueError("plugins is not a list")
        result = dict(conf)
    else:
        # A single-plugin `.conf`: its name and version move to the list, the rest is the plugin.
        if not isinstance(conf.get("type"), str):
            raise ValueError("neither a plugins list nor a plugin type")
        plugin = {k: v for k, v in conf.items() if k not in ("name", "cniVersion")}
        result = {k: conf[k] for k in ("cniVersion", "name") if k in conf}
        plugins = [plugin]
    result["plugins"] = [p for p in plugins if not _is_ours(p)] + [entry]
    return result


def unchained(conf: dict[str, Any]) -> dict[str, Any]:
    """`conf` without our plugin."""
    plugins = conf.get("plugins")
    if not isinstance(plugins, list):
        return conf
    return {**conf, "plugins": [p for p in plugins if not _is_ours(p)]}


def _is_ours(plugin: object) -> bool:
    return isinstance(plugin, dict) and plugin.get("type") == PLUGIN_TYPE


def _read_conf(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except OSError as e:
        raise InstallError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InstallError(f"{path} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InstallError(f"{path} is not a JSON object")
    return doc


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _dump(conf: dict[str, Any]) -> bytes:
    return (json.dumps(conf, indent=2) + "\n").encode()


def install_plugin(config: InstallConfig) -> Path:
    """Write the plugin executable into the bin directory (replaced only when it differs)."""
    target = config.bin_dir / PLUGIN_FILE
    data = plugin_executable(config.interpreter)
    try:
        config.bin_dir.mkdir(parents=True, exist_ok=True)
        try:
            current = target.read_bytes()
        except FileNotFoundError:
            current = None
        if current != data or not os.access(target, os.X_OK):
            _write_atomically(target, data, 0o755)
            log.info("installed the CNI plugin at %s", target)
    except OSError as e:
        raise InstallError(f"cannot install the CNI plugin in {config.bin_dir}: {e.strerror or e}") from None
    return target


class ChainKeeper:
    """Keeps the plugin chained into the primary configuration; `ensure()` is cheap when nothing changed."""

    def __init__(self, config: InstallConfig) -> None:
        self.config = config
        self.chained_into: Path | None = None
        self._waiting_logged = False

    def ensure(self) -> bool:
        """Chain the plugin into the current primary configuration; True when a file was written."""
        primary = primary_conf(self.config.conf_dir)
        if primary is None:
            if not self._waiting_logged:
                log.info("no CNI network configuration in %s yet; waiting for one", self.config.conf_dir)
                self._waiting_logged = True
            return False
        self._waiting_logged = False
        wrote = False
        if self.chained_into is not None and self.chained_into != primary:
            # Another file became the primary: ours must not stay in one the runtime no longer reads.
            wrote = _remove_from(self.chained_into)
        try:
            conf = _read_conf(primary)
        except FileNotFoundError:
            return wrote  # replaced under us; the next call sees the new one
        try:
            new = chained(conf, plugin_entry(self.config.agent_socket, self.config.exclude_namespaces))
        except ValueError as e:
            raise InstallError(f"{primary}: not a CNI network configuration ({e})") from None
        target = primary if primary.suffix == ".conflist" else primary.with_suffix(".conflist")
        if new != conf or target != primary:
            try:
                _write_atomically(target, _dump(new), 0o644)
                if target != primary:
                    primary.unlink()
            except OSError as e:
                raise InstallError(f"cannot write {target}: {e.strerror or e}") from None
            log.info("chained %s into %s", PLUGIN_TYPE, target)
            wrote = True
        self.chained_into = target
        return wrote


def _remove_from(path: Path) -> bool:
    try:
        conf = _read_conf(path)
    except FileNotFoundError:
        return False
    new = unchained(conf)
    if new == conf:
        return False
    try:
        _write_atomically(path, _dump(new), 0o644)
    except OSError as e:
        raise InstallError(f"cannot write {path}: {e.strerror or e}") from None
    log.info("removed %s from %s", PLUGIN_TYPE, path)
    return True


def uninstall(config: InstallConfig) -> list[Path]:
    """Take the plugin out of every configuration in the conf directory and delete the executable;
    the files changed."""
    changed: list[Path] = []
    try:
        names = sorted(os.listdir(config.conf_dir))
    except FileNotFoundError:
        names = []
    except OSError as e:
        raise InstallError(f"cannot list {config.conf_dir}: {e.strerror or e}") from None
    for name in names:
        path = config.conf_dir / name
        if name.endswith(CONF_SUFFIXES) and not name.startswith(".") and path.is_file():
            try:
                if _remove_from(path):
                    changed.append(path)
            except InstallError as e:
                log.warning("left %s alone: %s", path, e)
    plugin = config.bin_dir / PLUGIN_FILE
    try:
        plugin.unlink()
        log.info("removed the CNI plugin %s", plugin)
        changed.append(plugin)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise InstallError(f"cannot remove {plugin}: {e.strerror or e}") from None
    return changed
