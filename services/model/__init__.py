"""The model-slice service: the split model's slices, decode micro-batches and rotational pipelining."""
