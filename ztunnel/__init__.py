"""ztunnel in Python: the per-node L4 proxy of Istio's ambient mesh."""

__version__ = "0.1.0"
