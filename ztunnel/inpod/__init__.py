"""In-pod mode (SPEC §9): the ZDS client, the per-pod proxies, and sockets inside pod namespaces."""
