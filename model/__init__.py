"""LLaMA-family model code: configuration, the plain decoder, checkpoint loading,
the attention operator and the automated splitter.

The decoder is plain PyTorch and knows nothing of how it is served: attention is
the one stateful operator and is injected through an `AttentionContext`, so the
same module runs in one process, is split into slices for model workers, and is
checked against Hugging Face `transformers` in tests.
"""
