"""The OpenAI-compatible HTTP front end (chat and text completions, SSE, metrics).

`gateway.app.create_app(config, backend, tokenizer, model_name, context_length)`
builds the aiohttp app in front of any `gateway.backend.Backend`: the local engine
in-process or the scheduler over gRPC. See docs/api.md for the HTTP API.
"""
