"""The `istio_xds_*` families: the xDS client's messages, their bytes, and its streams' ends."""

from __future__ import annotations

from ztunnel.metrics.registry import CounterFamily, Families


class XdsCounters:
    """The `istio_xds_*` families; the xDS client's metrics hook (`xds.client.XdsMetrics`)."""

    def __init__(self) -> None:
        self.terminations = CounterFamily(
            "istio_xds_connection_terminations",
            "The total number of completed connections to xds server (unstable)",
            ("reason",),
        )
        self.messages = CounterFamily(
            "istio_xds_message", "Total number of messages received (unstable)", ("url",)
        )
        self.message_bytes = CounterFamily(
            "istio_xds_message_bytes", "Total number of bytes received (unstable)", ("url",)
        )

    def collector(self) -> Families:
        return Families((self.terminations, self.messages, self.message_bytes))

    def message(self, type_url: str, n_bytes: int) -> None:
        self.messages.cell((type_url,)).inc()
        self.message_bytes.cell((type_url,)).inc(n_bytes)

    def termination(self, reason: str) -> None:
        self.terminations.cell((reason,)).inc()
