"""The proxy's metrics: each concern's families in a module of its own, composed per process
(`families`), our own registry and its exposition, the series a workload leaves behind, and the
process gauges."""
