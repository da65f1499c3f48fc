"""The web pages' routes and the dashboard's JSON, on a gateway over the scripted backend.

The pages themselves run in a real browser against a real stack in
tests/e2e/test_web_pages.py; here: what the server sends, the figures it reads from its
own metrics, the API key on the dashboard's figures, and the cluster reader's cache.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from gateway_helpers import MODEL, serve

from lamina.gateway.config import GatewayConfig
from lamina.gateway.dashboard import ClusterView

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


async def _get(url: str, headers: dict | None = None) -> tuple[int, dict, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=headers or {}) as r:
            return r.status, dict(r.headers), await r.text()


async def test_pages_and_their_files_are_served_from_the_gateway_alone(tokenizer, make_backend):
    async with serve(make_backend(), tokenizer) as srv:
        for path, script in (("/", "/static/chat.js"), ("/dashboard", "/static/dashboard.js")):
            status, headers, html = await _get(srv.url + path)
            assert status == 200 and headers["Content-Type"].startswith("text/html")
            assert "default-src 'self'" in headers["Content-Security-Policy"]
            # Every file the page loads is on this gateway (no CDN), and it is there.
            refs = re.findall(r'(?:src|href)="([^"]+)"', html)
            assert script in refs and "/static/style.css" in refs
            for ref in refs:
                assert ref.startswith("/"), f"{path} loads {ref} from elsewhere"
                if ref.startswith("/static/"):
                    code, file_headers, _ = await _get(srv.url + ref)
                    assert code == 200, ref
                    kind = "javascript" if ref.endswith(".js") else "css"
                    assert kind in file_headers["Content-Type"], ref


async def test_dashboard_status_reads_the_gateway_metrics(tokenizer, make_backend, script_ids):
    async with serve(make_backend(), tokenizer) as srv:
        client = srv.client()
        status, _, _ = await _get(srv.url + "/dashboard/status")
        assert status == 200
        before = await _status(srv.url)
        await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
        await client.close()
        after = await _status(srv.url)
        _, _, metrics = await _get(srv.url + "/metrics")
    g0, g1 = before["gateway"], after["gateway"]
    # Generation requests only: the dashboard's own polls are not counted.
    assert (g0["requests"], g1["requests"]) == (0, 2)
    assert g1["generation_tokens"] - g0["generation_tokens"] == len(script_ids) + 1 + 3  # the EOS counted
    assert g1["time_to_first_token"]["count"] == 2 and g1["time_to_first_token"]["sum"] > 0
    assert g1["inter_token_latency"]["count"] == len(script_ids) + 2
    assert g1["in_flight"] == 0 and g1["running"] == 0
    # The same figures as /metrics shows.
    assert f'lamina_gateway_generation_tokens_total{{model="{MODEL}"}} {g1["generation_tokens"]}' in metrics
    # A gateway built without a cluster reader says why there is no cluster.
    assert after["cluster"] is None and "without a cluster" in after["cluster_error"]
    assert after["time"] >= before["time"]


async def _status(url: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/dashboard/status", headers=headers) as r:
            assert r.status == 200
            return await r.json()


async def test_dashboard_status_needs_the_api_key_when_one_is_set(tokenizer, make_backend):
    config = GatewayConfig(host="127.0.0.1", port=0, api_key="sekrit", shutdown_timeout=2.0)
    async with serve(make_backend(), tokenizer, config) as srv:
        status, _, body = await _get(srv.url + "/dashboard/status")
        assert status == 401 and "missing_api_key" in body
        status, _, _ = await _get(srv.url + "/dashboard/status", {"Authorization": "Bearer wrong"})
        assert status == 401
        assert (await _status(srv.url, "sekrit"))["gateway"]["requests"] == 0
        # The pages themselves hold no secret: they load, and ask for the key.
        for path in ("/", "/dashboard", "/static/common.js"):
            assert (await _get(srv.url + path))[0] == 200


async def test_cluster_view_reads_at_most_once_per_max_age_and_reports_failures():
    calls = 0

    async def reader() -> dict:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return {"services": [], "n": calls}

    view = ClusterView(reader, max_age_s=60.0)
    readings = await asyncio.gather(*(view.read() for _ in range(5)))
    assert calls == 1 and all(r.status == {"services": [], "n": 1} and r.error is None for r in readings)
    fresh = ClusterView(reader, max_age_s=0.0)
    await fresh.read()
    await fresh.read()
    assert calls == 3

    async def down() -> dict:
        raise ConnectionRefusedError("Connection refused")

    reading = await ClusterView(down).read()
    assert reading.status is None and reading.error == "ConnectionRefusedError: Connection refused"

    async def stuck() -> dict:
        await asyncio.Event().wait()
        return {}

    reading = await ClusterView(stuck, timeout_s=0.05).read()
    assert reading.status is None and "did not answer within 0.05 s" in reading.error


@pytest.mark.parametrize("path", ["/dashboard/status", "/"])
async def test_pages_refuse_other_methods(tokenizer, make_backend, path):
    async with serve(make_backend(), tokenizer) as srv:
        async with aiohttp.ClientSession() as session:
            async with session.post(srv.url + path, json={}) as r:
                assert r.status == 405
                assert (await r.json())["error"]["type"] == "invalid_request_error"
