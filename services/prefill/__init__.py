"""The prefill service: prompts through the model, their KV to the attention workers, prefix KV between peers."""
