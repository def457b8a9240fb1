"""The running sidecar: aiohttp app, forwarding, load tracking, health, metrics, config, CLI."""
