"""The services of the distributed stack, each its own asyncio process:
scheduler, prefill, model-slice worker and attention worker (the gateway is in
`gateway/`). Control plane: gRPC (services/protos/lamina.proto). Data plane:
tensors over a transport chosen by configuration (transports/)."""
