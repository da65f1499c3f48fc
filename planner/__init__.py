"""The planner: performance models, a hardware catalogue, a configuration search and a
discrete-event simulator that predict which deployment (colocated or model-attention
disaggregated), quantization and thread counts serve a workload fastest and cheapest.

Everything here is pure Python over typed frozen dataclasses; nothing imports torch, so
`lamina plan` starts fast and the tests run in seconds. See docs/planner.md.
"""
