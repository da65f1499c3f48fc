"""Lamina: LLM serving with model-attention disaggregation."""

__version__ = "0.1.0"
