"""A gRPC client of our own on HBONE's sans-IO HTTP/2 core (`hbone.h2core`): what Delta ADS and the
CA's `CreateCertificate` need, and no more. `wire.py` is the protocol without I/O (message framing,
request headers, statuses, one call's life as events in and results out); `connection.py` carries
it over one asyncio connection (TCP or TLS), with keepalive PINGs, deadlines and the calls'
readers and writers.
"""
