"""The listeners of one proxy instance (one workload): outbound 15001, inbound HBONE 15008,
inbound plaintext 15006 and SOCKS5 15080, and what they share (pool, sockets, connection tracking).
"""
