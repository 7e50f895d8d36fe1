"""The HTTP front process: OpenAI-compatible HTTP and SSE over the core's ZMQ API, its protocol,
tool calls, limits and metrics."""
