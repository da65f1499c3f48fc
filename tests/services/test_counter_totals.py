"""services/counter_totals.CounterTotals: counters advanced by what running totals grew
between reports, from a start value where a total existed before counting began."""

from __future__ import annotations

import prometheus_client

from lamina.services.counter_totals import CounterTotals


def test_each_counter_grows_by_its_totals_growth_since_the_last_report():
    registry = prometheus_client.CollectorRegistry()
    sent = prometheus_client.Counter("sent_seconds", "", registry=registry)
    waited = prometheus_client.Counter("waited_seconds", "", registry=registry)
    totals = CounterTotals({"sent": sent, "waited": waited, "local": None}, start={"waited": 5.0})
    assert totals.report({"sent": 1.5, "waited": 7.0, "local": 0.25}) == {"sent": 1.5, "waited": 2.0, "local": 0.25}
    assert totals.report({"sent": 1.5, "waited": 8.0, "local": 1.0}) == {"sent": 0.0, "waited": 1.0, "local": 0.75}
    assert registry.get_sample_value("sent_seconds_total") == 1.5
    assert registry.get_sample_value("waited_seconds_total") == 3.0  # what grew after the start, not the 5 before
