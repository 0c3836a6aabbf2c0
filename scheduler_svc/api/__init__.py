"""Front doors of the scheduler service: the OpenAI-compatible HTTP API."""
