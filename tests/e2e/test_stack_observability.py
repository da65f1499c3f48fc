"""What a person looks at, against the real stack: the gateway's web chat and live
dashboard in headless Chromium, and the Grafana dashboard's queries against the metrics
every service exports.

Chromium is Debian's `chromium`, driven by the `playwright` package (its own browser
downloads are never used). The stack has an API key, so the pages must take it from
their key field. Screenshots of each page are saved under the test's temporary directory.
The stack is the one the API tests share (shared_stacks.API).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from shared_stacks import API

from lamina.services.cluster_status import KINDS

pytestmark = [pytest.mark.timeout(600), pytest.mark.stack(API)]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
API_KEY = API.api_key
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
QUESTION = "What is the capital of France?"
MAX_TOKENS = 24


@dataclass
class Browser:
    context: Any  # playwright's BrowserContext
    requested: list[str]  # the URL of every request its pages made

    def new_page(self):
        return self.context.new_page()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Chromium with a fresh profile."""
    if not CHROMIUM.exists():
        pytest.skip(f"Debian's chromium is not installed ({CHROMIUM} is missing; apt-get install chromium): "
                    "the web page tests need a browser")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                                   "(pip install -c constraints.txt playwright): it drives chromium")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 900})
        b = Browser(context, [])
        context.on("request", lambda request: b.requested.append(request.url))
        try:
            yield b
        finally:
            context.close()


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=API_KEY, max_retries=0)


def _wait_for(page, expression: str, timeout_s: float = 30.0) -> None:
    """Until the JavaScript `expression` is true in the page. Polled from here: playwright's
    own wait_for_function evaluates strings with eval, which the pages' CSP forbids."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s:g} s: {expression}")
        time.sleep(0.05)


def _enter_key(page) -> None:
    page.fill("#api-key", API_KEY)
    page.locator("#api-key").blur()  # the field is read on `change`


def _metric(stack, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _tokens_table(page) -> list[tuple[int, float]]:
    """(token id, arrival in ms) of the last answer's tokens, as its panel shows them."""
    rows = page.locator("article.assistant").last.locator("details.tokens tbody tr")
    out = []
    for cells in rows.evaluate_all("rows => rows.map(r => [...r.cells].map(c => c.textContent))"):
        out.append((int(cells[1]), float(cells[4].removesuffix(" ms"))))
    return out


def test_chat_streams_the_same_answer_as_the_api(stack, browser, tmp_path):
    page = browser.new_page()
    page.goto(stack.base_url + "/")
    # Without the key the gateway refuses the page's first call, and the page says so.
    _wait_for(page, "document.getElementById('status').textContent.includes('API key')")
    page.screenshot(path=str(tmp_path / "chat-no-key.png"))
    _enter_key(page)
    model = _client(stack).models.list().data[0].id
    _wait_for(page, f"document.getElementById('model').textContent === {model!r}")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#prompt", QUESTION)
    page.press("#prompt", "Enter")
    answer = page.locator("article.assistant").last
    page.wait_for_selector("article.assistant[data-state=done]", timeout=120_000)
    text = answer.locator(".content").text_content()
    answer.locator("details.tokens summary").click()
    page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)

    expected = _client(stack).chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True}).choices[0]
    assert text == expected.message.content and text
    tokens = _tokens_table(page)
    assert [t for t, _ in tokens] == expected.model_extra["token_ids"]  # token for token
    arrivals = [ms for _, ms in tokens]
    assert arrivals == sorted(arrivals) and len(set(arrivals)) > 1  # streamed: they came at different times
    summary = answer.locator("details.tokens summary").text_content()
    assert f"tokens: {len(tokens)}" in summary and "first token" in summary and "finish:" in summary
    # Nothing was fetched from anywhere but the gateway.
    assert browser.requested and all(u.startswith(stack.base_url + "/") for u in browser.requested)
    page.close()


def test_stop_ends_the_answer_and_its_request(stack, browser, tmp_path):
    page = browser.new_page()
    page.goto(stack.base_url + "/")
    _enter_key(page)
    model = _client(stack).models.list().data[0].id
    _wait_for(page, f"document.getElementById('model').textContent === {model!r}")
    cancelled = _metric(stack, "lamina_gateway_requests_total", '{route="/v1/chat/completions",status="499"}')
    page.fill("#max-tokens", "400")
    page.fill("#prompt", "Write a long story about a dragon who learns to bake bread.")
    page.click("#send")
    _wait_for(page, "Number(document.querySelector('article.assistant')?.dataset.tokens || 0) >= 3", 120)
    page.click("#stop")
    page.wait_for_selector("article.assistant[data-state=stopped]", timeout=10_000)
    page.screenshot(path=str(tmp_path / "chat-stopped.png"), full_page=True)
    num_tokens = int(page.locator("article.assistant").last.get_attribute("data-tokens"))
    assert 3 <= num_tokens < 400
    # The gateway saw the client go (status 499) and holds nothing for it.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if (_metric(stack, "lamina_gateway_requests_total", '{route="/v1/chat/completions",status="499"}')
                > cancelled and _metric(stack, "lamina_gateway_requests_in_flight") == 0):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the stopped request was not cancelled in the gateway")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    page.close()


def _tile(page, key: str) -> float | None:
    value = page.get_attribute(f'.tile[data-figure="{key}"]', "data-value")
    return float(value) if value else None


def test_dashboard_shows_the_cluster_and_changes_under_load(stack, browser, tmp_path):
    page = browser.new_page()
    page.goto(stack.base_url + "/dashboard")
    page.wait_for_selector("#error:not([hidden])")  # no key yet: 401, and the page says so
    assert "API key" in page.text_content("#error")
    _enter_key(page)
    _wait_for(page, "Number(document.body.dataset.updates || 0) >= 2")
    services = page.locator("#services tbody tr")
    names = services.evaluate_all("rows => rows.map(r => [r.dataset.name, r.dataset.healthy])")
    assert sorted(names) == sorted([[n, "true"] for n in ("attention-0", "attention-1", "model-0", "prefill-0",
                                                          "scheduler-0", "gateway-0")])
    assert page.locator("#attention tbody tr").count() == 2
    assert page.locator("#prefix-cache tbody tr[data-name=prefill-0]").count() == 1
    assert page.is_hidden("#cluster-error")
    idle_tokens_per_s = _tile(page, "tokens_per_s")

    # Eight streams of 48 tokens while the page polls.
    model = _client(stack).models.list().data[0].id
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            for _ in _client(stack).completions.create(
                    model=model, prompt=f"Story number {i}: once upon a time", max_tokens=48, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}):
                pass
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    seen: dict[str, list[float]] = {k: [] for k in ("tokens_per_s", "in_flight", "itl", "decode_batch", "ttft")}
    kv_tokens: list[int] = []
    shot = False
    while any(t.is_alive() for t in threads):
        for key in seen:
            value = _tile(page, key)
            if value is not None:
                seen[key].append(value)
        kv_tokens += [int(n) for n in page.locator("#attention tbody tr").evaluate_all(
            "rows => rows.map(r => r.dataset.tokens || '0')")]
        if not shot and seen["tokens_per_s"] and max(seen["tokens_per_s"]) > 0:
            page.screenshot(path=str(tmp_path / "dashboard-under-load.png"), full_page=True)
            shot = True
        time.sleep(0.25)
    for t in threads:
        t.join()
    assert not errors, errors
    assert idle_tokens_per_s in (None, 0.0)
    assert max(seen["tokens_per_s"]) > 0 and max(seen["in_flight"]) > 0
    assert seen["ttft"] and seen["itl"] and seen["decode_batch"] and max(seen["decode_batch"]) >= 1
    assert max(kv_tokens) > 0  # the attention workers held the streams' KV
    # Once the streams are done, the page shows none in flight.
    _wait_for(page, "document.querySelector('.tile[data-figure=in_flight]').dataset.value === '0'", 15)
    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert all((tmp_path / f).stat().st_size > 0 for f in ("dashboard.png", "dashboard-under-load.png"))
    page.close()


# --- Grafana -------------------------------------------------------------------------------

# Series Prometheus makes itself for every target, which no service exports.
PROMETHEUS_OWN = {"up"}
_SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                    "summary": ("_sum", "_count", "_created")}


def _dashboard_metrics() -> dict[str, set[str]]:
    """Every metric name a panel of deploy/grafana/lamina.json queries -> those panels' titles."""
    promql = pytest.importorskip("promql_parser", reason="the promql-parser package is not installed "
                                 "(pip install -c constraints.txt promql-parser): it parses the panels' queries")
    dashboard = json.loads((REPO / "deploy" / "grafana" / "lamina.json").read_text())
    panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
    out: dict[str, set[str]] = {}
    for panel in panels:
        for target in panel.get("targets", []):
            names: list[str | None] = []

            def visit(node, names: list[str | None] = names) -> None:
                if isinstance(node, promql.VectorSelector):
                    names.append(node.name)

            # Grafana's interval variables ($__rate_interval, ...) stand for a duration.
            promql.walk(promql.parse(re.sub(r"\$__\w+", "1m", target["expr"])), visit)
            assert names and None not in names, f"{panel['title']}: {target['expr']} names no metric"
            for name in names:
                out.setdefault(name, set()).add(panel["title"])
    return out


def _exported(text: str) -> set[str]:
    """The series names a /metrics text offers: its samples', and those of each family it
    declares (a labelled family with no series yet is only declared)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",)))
    return names


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


async def _metrics_urls(stack) -> dict[str, str]:
    """Each registered gRPC service's metrics URL, by service id (from its registration)."""
    from lamina.kvstore.metadata import MetadataConfig, MetadataStore

    store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
    try:
        infos = [i for kind in KINDS if kind != "gateway" for i in await store.list_services(kind)]
    finally:
        await store.close()
    return {i.service_id: f"http://{stack.config.host}:{i.meta['metrics_port']}/metrics" for i in infos}


def test_grafana_panels_query_only_metrics_the_services_export(stack):
    queried = _dashboard_metrics()
    # In a thread of its own: playwright's sync API keeps an event loop running in this one.
    with ThreadPoolExecutor(1) as pool:
        registered = pool.submit(asyncio.run, _metrics_urls(stack)).result()
    urls = {**registered, "gateway-0": stack.base_url + "/metrics"}
    exported = {service: _exported(_fetch(url)) for service, url in urls.items()}
    assert {s.rsplit("-", 1)[0] for s in exported} == set(KINDS)  # every kind of service was scraped
    every = set().union(*exported.values())
    missing = {name: sorted(panels) for name, panels in queried.items() if name not in every | PROMETHEUS_OWN}
    assert not missing, f"panels query metrics no service exports: {missing}"
    # And the dashboard shows something of every service.
    for service, names in exported.items():
        assert names & set(queried), f"no panel queries a metric of {service}"
