import json
from importlib import resources

import pytest
import yaml

from lamina.planner.hardware import THIS_MACHINE, CatalogueError, device_from_entry, load_catalogue, parse_hardware

REQUIRED = ("H100", "H200", "H20", "A100", "L40S", "CPU")


def _figures(entry):
    for key, value in entry.items():
        if key == "tflops":
            yield from ((f"tflops.{k}", v) for k, v in value.items())
        elif key != "description":
            yield key, value


def test_catalogue_has_the_required_devices(catalogue):
    assert set(REQUIRED) <= set(catalogue)


def test_every_figure_has_a_value_and_a_source():
    raw = yaml.safe_load(resources.files("lamina.planner").joinpath("catalogue.yaml").read_text())
    for name, entry in raw.items():
        for key, fig in _figures(entry):
            assert isinstance(fig, dict) and fig.get("value", 0) > 0, (name, key)
            assert isinstance(fig.get("source"), str) and len(fig["source"]) > 10, (name, key)
        # Prices are never vendor specifications: they must say they are assumptions.
        assert entry["usd_per_hour"].get("assumption") is True, name


def test_units_are_converted(catalogue):
    h100 = catalogue["H100"]
    assert h100.memory_bw == pytest.approx(3.35e12)
    assert h100.flops["bf16"] == pytest.approx(989.4e12)
    assert h100.network_bw == pytest.approx(50e9)  # 400 Gb/s
    assert h100.cores is None and catalogue["CPU"].cores == 96


def test_a_figure_without_source_is_refused():
    raw = yaml.safe_load(resources.files("lamina.planner").joinpath("catalogue.yaml").read_text())
    entry = dict(raw["H20"])
    entry["memory_tb_s"] = {"value": 4.0}
    with pytest.raises(CatalogueError, match="memory_tb_s has no source"):
        device_from_entry("H20", entry)


def test_profile_adds_this_machine(tmp_path):
    raw = yaml.safe_load(resources.files("lamina.planner").joinpath("catalogue.yaml").read_text())
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"device": raw["CPU"]}))
    devices = load_catalogue(profile)
    assert devices[THIS_MACHINE].memory_bw == devices["CPU"].memory_bw


def test_parse_hardware(catalogue):
    offer = parse_hardware("h100:8, H20", catalogue)
    assert offer.limits == {"H100": 8, "H20": None}
    assert offer.allows("H100", 8) and not offer.allows("H100", 9) and offer.allows("H20", 1000)
    assert not offer.allows("A100", 1)
    for bad in ("TPU", "H100:0", "H100:x", ""):
        with pytest.raises(ValueError):
            parse_hardware(bad, catalogue)
    with pytest.raises(ValueError, match="lamina profile"):
        parse_hardware("this-machine", catalogue)


def _profiled_entry(raw):
    entry = dict(raw["CPU"])
    entry["linear_s_per_param"] = {"value": {"1": 1e-9, "8": 2e-9}, "source": "measured"}
    entry["attention_tb_s"] = {"value": 0.002, "source": "measured"}
    return entry


def test_a_profile_measured_table_is_read_and_interpolated():
    raw = yaml.safe_load(resources.files("lamina.planner").joinpath("catalogue.yaml").read_text())
    dev = device_from_entry(THIS_MACHINE, _profiled_entry(raw))
    assert dev.attention_bw == pytest.approx(2e9)
    assert dev.measured_linear_s(1e6, 1) == pytest.approx(1e-3)
    assert dev.measured_linear_s(1e6, 4.5) == pytest.approx(1.5e-3)  # halfway from 1 to 8
    assert dev.measured_linear_s(1e6, 16) == pytest.approx(4e-3)  # beyond: proportional to the batch
    assert device_from_entry("CPU", raw["CPU"]).measured_linear_s(1e6, 1) is None
    bad = _profiled_entry(raw)
    bad["linear_s_per_param"] = {"value": 1e-9, "source": "measured"}
    with pytest.raises(CatalogueError, match="linear_s_per_param"):
        device_from_entry(THIS_MACHINE, bad)
