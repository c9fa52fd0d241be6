"""The OpenAI-compatible HTTP server: `novainfer serve MODEL`."""
