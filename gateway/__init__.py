"""The OpenAI-compatible HTTP front end (chat and text completions, SSE, metrics).

`lamina.gateway.app.create_app(config, backend, tokenizer, model_name, context_length)`
builds the aiohttp app in front of any `lamina.gateway.backend.Backend` (the stack's is the
scheduler over gRPC, services/gateway/scheduler_client.py). See docs/api.md for the HTTP API.
"""
