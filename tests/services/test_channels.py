"""A service's client channels: one per peer, the one a peer's new address replaces closed
after its grace, every channel closed with the service (lamina.services.channels.Channels)."""

from __future__ import annotations

import asyncio

import grpc

from lamina.services.channels import Channels

SHUTDOWN = grpc.ChannelConnectivity.SHUTDOWN


async def test_a_replaced_channel_closes_after_its_grace_and_the_rest_with_the_service():
    channels = Channels(token="t", grace_s=0.05)
    first = channels.open(("model", "model-0"), "127.0.0.1:1")
    other = channels.open(("attention", 0), "127.0.0.1:2")
    # The peer came back elsewhere (a restart): its new channel replaces the old one.
    second = channels.open(("model", "model-0"), "127.0.0.1:3")
    assert len(channels) == 2 and first.get_state() is not SHUTDOWN
    for _ in range(100):  # the old one closes once its grace is over
        if first.get_state() is SHUTDOWN:
            break
        await asyncio.sleep(0.01)
    assert first.get_state() is SHUTDOWN
    assert second.get_state() is not SHUTDOWN and other.get_state() is not SHUTDOWN
    # Restarts do not pile channels up.
    for port in range(4, 24):
        channels.open(("model", "model-0"), f"127.0.0.1:{port}")
    assert len(channels) == 2
    await channels.close()
    assert second.get_state() is SHUTDOWN and other.get_state() is SHUTDOWN


async def test_a_channel_opened_elsewhere_is_kept_and_replaced_alike():
    from lamina.services.channels import open_channel

    channels = Channels(token=None, grace_s=0.01)
    ready = open_channel("127.0.0.1:5")
    channels.replace("scheduler", ready)
    channels.replace("scheduler", ready)  # the same channel again: nothing to close
    await asyncio.sleep(0.05)
    assert ready.get_state() is not SHUTDOWN
    await channels.close()
    assert ready.get_state() is SHUTDOWN
