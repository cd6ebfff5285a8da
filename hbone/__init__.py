"""HBONE: TCP tunnelled in HTTP/2 CONNECT streams over mutual TLS 1.3 with SPIFFE identities.

This package owns the tunnel only: TLS contexts and SPIFFE peer checks, the HTTP/2 CONNECT client
and server, the connection pool, keepalive and flow control. It imports no other package of the
project: workloads, policies and ports are the caller's business.
"""

from hbone import build

build.guard()  # before any module of the compiled hot path is imported
