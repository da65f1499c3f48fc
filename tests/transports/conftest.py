"""Shared fixtures of the transport conformance suite: one parameter per transport that
this machine can run; the others are skipped with the reason."""

from __future__ import annotations

import pytest
from transport_helpers import CONFORMANCE_SCHEMES, address_for

from lamina import transports


@pytest.fixture(params=CONFORMANCE_SCHEMES)
def scheme(request) -> str:
    reason = transports.availability(request.param)
    if reason is not None:
        pytest.skip(f"{request.param} transport unavailable: {reason}")
    return request.param


@pytest.fixture
def address(scheme) -> str:
    return address_for(scheme)
