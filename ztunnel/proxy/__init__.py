"""The listeners of one proxy instance (one workload): outbound 15001, inbound HBONE 15008,
inbound plaintext 15006 and SOCKS5 15080; below them what they share (the context, the upstreams,
the tracker, the task set), above them the instance that builds and drains them (`instance.py`).
"""
