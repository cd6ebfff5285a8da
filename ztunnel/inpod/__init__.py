"""In-pod mode: the ZDS client, the per-pod proxies, and sockets inside pod namespaces."""
