"""One exception hierarchy for every transport.

Services catch ``TransportError`` (or a subclass) and never an implementation's own
exception type: each transport translates its library's errors at its boundary.
"""


class TransportError(Exception):
    """Base of every error raised by ``transports``."""


class FrameError(TransportError):
    """A frame on the wire is corrupted, truncated, oversized or of an unknown version.

    The connection that produced it is closed; other connections are unaffected.
    """


class PeerClosed(TransportError):
    """The peer closed the connection or vanished (possibly in the middle of a frame)."""


class TransportTimeout(TransportError, TimeoutError):
    """A configured timeout expired (connect, handshake, send or receive)."""


class AuthError(TransportError):
    """The peer failed the shared-secret handshake (missing or wrong cluster token)."""


class TransportUnavailable(TransportError):
    """The transport cannot run on this machine (missing library, device or driver)."""
