"""Connection handshake: wire version check and optional mutual shared-secret auth.

    server -> client  b"LMNH" u8 version  u8 auth_required  16B server_nonce      (22 B)
    client -> server  b"LMNC" u8 version  u8 0  16B client_nonce  32B client_mac  (54 B)
    server -> client  b"LMNR" u8 status  32B server_mac                           (37 B)

client_mac = HMAC-SHA256(token, b"c" + server_nonce + client_nonce) (zeros without a token),
server_mac = HMAC-SHA256(token, b"s" + client_nonce + server_nonce). The server refuses a
client without the token; a client with a token refuses a server that cannot prove it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Awaitable, Callable

from .errors import AuthError, FrameError

HANDSHAKE_VERSION = 1
_SERVER_HELLO = struct.Struct("<4sBB16s")
_CLIENT_HELLO = struct.Struct("<4sBB16s32s")
_SERVER_REPLY = struct.Struct("<4sB32s")
SERVER_HELLO_SIZE, CLIENT_HELLO_SIZE, SERVER_REPLY_SIZE = (
    _SERVER_HELLO.size, _CLIENT_HELLO.size, _SERVER_REPLY.size)
OK, AUTH_FAILED, VERSION_MISMATCH = 0, 1, 2
_ZERO = bytes(32)

Send = Callable[[bytes], Awaitable[None]]
RecvExact = Callable[[int], Awaitable[bytes]]


def _mac(token: str | None, tag: bytes, a: bytes, b: bytes) -> bytes:
    if token is None:
        return _ZERO
    return hmac.new(token.encode(), tag + a + b, hashlib.sha256).digest()


async def server_handshake(send: Send, recv_exact: RecvExact, token: str | None) -> None:
    nonce_s = os.urandom(16)
    await send(_SERVER_HELLO.pack(b"LMNH", HANDSHAKE_VERSION, token is not None, nonce_s))
    magic, version, _, nonce_c, mac_c = _CLIENT_HELLO.unpack(await recv_exact(CLIENT_HELLO_SIZE))
    if magic != b"LMNC":
        raise FrameError(f"peer is not a Lamina transport client (magic {magic!r})")
    if version != HANDSHAKE_VERSION:
        await send(_SERVER_REPLY.pack(b"LMNR", VERSION_MISMATCH, _ZERO))
        raise FrameError(f"peer speaks handshake version {version}, this side {HANDSHAKE_VERSION}")
    if token is not None and not hmac.compare_digest(mac_c, _mac(token, b"c", nonce_s, nonce_c)):
        await send(_SERVER_REPLY.pack(b"LMNR", AUTH_FAILED, _ZERO))
        raise AuthError("peer did not present the cluster token")
    await send(_SERVER_REPLY.pack(b"LMNR", OK, _mac(token, b"s", nonce_c, nonce_s)))


async def client_handshake(send: Send, recv_exact: RecvExact, token: str | None) -> None:
    magic, version, auth_required, nonce_s = _SERVER_HELLO.unpack(await recv_exact(SERVER_HELLO_SIZE))
    if magic != b"LMNH":
        raise FrameError(f"peer is not a Lamina transport server (magic {magic!r})")
    if version != HANDSHAKE_VERSION:
        raise FrameError(f"server speaks handshake version {version}, this side {HANDSHAKE_VERSION}")
    if auth_required and token is None:
        raise AuthError("server requires a cluster token and none is configured")
    nonce_c = os.urandom(16)
    await send(_CLIENT_HELLO.pack(b"LMNC", HANDSHAKE_VERSION, 0, nonce_c,
                                  _mac(token, b"c", nonce_s, nonce_c)))
    magic, status, mac_s = _SERVER_REPLY.unpack(await recv_exact(SERVER_REPLY_SIZE))
    if magic != b"LMNR":
        raise FrameError(f"bad handshake reply magic {magic!r}")
    if status == AUTH_FAILED:
        raise AuthError("server refused the cluster token")
    if status != OK:
        raise FrameError(f"server refused the handshake (status {status})")
    if token is not None and not hmac.compare_digest(mac_s, _mac(token, b"s", nonce_c, nonce_s)):
        raise AuthError("server could not prove it knows the cluster token")
