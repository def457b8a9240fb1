"""The routing proxy: aiohttp app, forwarding, load tracking, scraping, health, metrics, admin,
shadow policies, decision log and settings. Imports `policies`, never the simulator."""
