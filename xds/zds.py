"""The ZDS wire format, shared by ztunnel (client side) and the node agent (server side).

A ZDS socket is `AF_UNIX` + `SOCK_SEQPACKET`: one protobuf message per packet, no framing, and the pod's
network-namespace fd as `SCM_RIGHTS` ancillary data on `AddWorkload`. This module only encodes, decodes,
and moves one packet with its fds; the conversations live with each side (`ztunnel.inpod`, `cni.agent`).
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Sequence
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from xds.gen.istio.workload.zds import zds_pb2

WorkloadRequest = zds_pb2.WorkloadRequest
WorkloadResponse = zds_pb2.WorkloadResponse
WorkloadInfo = zds_pb2.WorkloadInfo
ZdsHello = zds_pb2.ZdsHello
V1 = zds_pb2.V1
M = TypeVar("M", bound=Message)

MAX_PACKET = 1024  # the reference's read buffer; a larger packet is an error
_FD_SIZE = array.array("i").itemsize
_MAX_FDS = 8  # room to receive (and close) more fds than a valid message carries


class ZdsError(Exception):
    """A packet that cannot be read: truncated, or not the message it should be."""


def hello() -> bytes:
    return ZdsHello(version=V1).SerializeToString()


def ack(error: str = "") -> bytes:
    """`WorkloadResponse{ack: Ack{error}}`: an empty error is an ACK, anything else a NACK."""
    resp = WorkloadResponse()
    resp.ack.error = error
    return resp.SerializeToString()


def add(uid: str, name: str, namespace: str, service_account: str) -> bytes:
    req = WorkloadRequest()
    req.add.uid = uid
    req.add.workload_info.name = name
    req.add.workload_info.namespace = namespace
    req.add.workload_info.service_account = service_account
    return req.SerializeToString()


def keep(uid: str) -> bytes:
    req = WorkloadRequest()
    req.keep.uid = uid
    return req.SerializeToString()


def delete(uid: str) -> bytes:
    req = WorkloadRequest()
    getattr(req, "del").uid = uid  # `del` is a Python keyword
    return req.SerializeToString()


def snapshot_sent() -> bytes:
    req = WorkloadRequest()
    req.snapshot_sent.SetInParent()
    return req.SerializeToString()


def _parse(message: M, data: bytes) -> M:
    try:
        message.ParseFromString(data)
    except DecodeError as e:
        raise ZdsError(f"invalid {type(message).__name__}: {e}") from None
    return message


def decode_request(data: bytes) -> WorkloadRequest:
    req = _parse(WorkloadRequest(), data)
    if req.WhichOneof("payload") is None:
        raise ZdsError("WorkloadRequest without a payload")
    return req


def decode_response(data: bytes) -> WorkloadResponse:
    resp = _parse(WorkloadResponse(), data)
    if resp.WhichOneof("payload") != "ack":
        raise ZdsError("WorkloadResponse without an ack")
    return resp


def decode_hello(data: bytes) -> ZdsHello:
    return _parse(ZdsHello(), data)


# -- one packet on a non-blocking SOCK_SEQPACKET socket ------------------------------------------


def send_packet(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """Send one message, with `fds` as SCM_RIGHTS. Raises BlockingIOError if the socket is full."""
    if len(data) > MAX_PACKET:
        raise ZdsError(f"message of {len(data)} bytes exceeds the {MAX_PACKET}-byte packet limit")
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([data], ancillary)


def recv_packet(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """Receive one message and its fds (close-on-exec); None at end of stream.

    A truncated packet or control block is a `ZdsError` (its fds are closed first)."""
    data, ancdata, flags, _ = sock.recvmsg(
        MAX_PACKET, socket.CMSG_SPACE(_MAX_FDS * _FD_SIZE), socket.MSG_CMSG_CLOEXEC
    )
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % _FD_SIZE
            fds.extend(array.array("i", payload[:usable]))
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        close_fds(fds)
        raise ZdsError("truncated ZDS packet")
    if not data and not fds:
        return None
    return data, fds


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
