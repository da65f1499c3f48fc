"""The gateway service: the OpenAI-compatible HTTP front end (lamina.gateway) over the scheduler."""
