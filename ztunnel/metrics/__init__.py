"""The proxy's metrics: its families and their exposition, our own registry, the series a
workload leaves behind, and the process gauges."""
