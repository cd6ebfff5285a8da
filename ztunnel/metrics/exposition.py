"""The stats endpoint's body: OpenMetrics text with each family's labels in the order the
reference emits them, and the content type an `Accept` header asks for."""

from __future__ import annotations

from ztunnel.metrics.registry import CollectorRegistry, go_float

TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text;charset=utf-8;version=1.0.0"


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if isinstance(value, int) or (value.is_integer() and abs(value) < 2**53):
        return str(int(value))
    return go_float(value)


def render_openmetrics(registry: CollectorRegistry) -> bytes:
    """OpenMetrics text keeping each family's label order (prometheus_client's own exposition sorts
    labels alphabetically; the reference's order is fixed) and leaving out families without samples."""
    out: list[str] = []
    for family in registry.collect():
        if not family.samples:
            continue
        out.append(f"# HELP {family.name} {_escape_label_value(family.documentation)}\n")
        out.append(f"# TYPE {family.name} {family.type}\n")
        if family.unit:
            out.append(f"# UNIT {family.name} {family.unit}\n")
        for sample in family.samples:
            if sample.labels:
                labels = ",".join(f'{k}="{_escape_label_value(v)}"' for k, v in sample.labels.items())
                out.append(f"{sample.name}{{{labels}}} {_format_value(sample.value)}\n")
            else:
                out.append(f"{sample.name} {_format_value(sample.value)}\n")
    out.append("# EOF\n")
    return "".join(out).encode()


def wants_openmetrics(accept_header: str | None) -> bool:
    if not accept_header:
        return False
    for entry in accept_header.split(","):
        media_type = entry.split(";", 1)[0].strip().lower()
        if media_type == "application/openmetrics-text":
            return True
    return False


def render_negotiated(registry: CollectorRegistry, accept_header: str | None) -> tuple[bytes, str]:
    """The exposition body and its content type, negotiated from an `Accept` header.

    The body is OpenMetrics text either way (as the reference); only the content type differs.
    """
    body = render_openmetrics(registry)
    return body, OPENMETRICS_CONTENT_TYPE if wants_openmetrics(accept_header) else TEXT_CONTENT_TYPE
