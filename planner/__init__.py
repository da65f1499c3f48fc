"""The planner: performance models, a hardware catalogue, a configuration search and a
discrete-event simulator that predict which deployment (colocated or model-attention
disaggregated), quantization and thread counts serve a workload fastest and cheapest.

The models are pure Python over typed frozen dataclasses and import no torch, so
`lamina plan` starts fast and the tests run in seconds; only `lamina.planner.profile` (what
`lamina profile` runs) measures, with torch. See docs/planner.md.
"""
