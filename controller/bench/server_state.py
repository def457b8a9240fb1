"""What a server says of its own state, read over HTTP: every sample of its `/metrics` page, and
the requests an SGLang server (or the emulator) runs or queues by its `/v1/loads`.

In the package, not in tests/ or benchmarks/, because both read servers this way and neither
folder can import the other.
"""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
"""A sample's labels, sorted by name."""


async def metric_values(url: str) -> dict[tuple[str, Labels], float]:
    """Every sample of `url`'s `/metrics`, keyed by (sample name, its sorted labels)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        r.raise_for_status()
        text = await r.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def sglang_load(url: str) -> int:
    """Requests the SGLang server at `url` runs or queues, from its `/v1/loads`."""
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/loads") as r:
        r.raise_for_status()
        load = (await r.json())["loads"][0]
    return int(load["num_running_reqs"]) + int(load["num_waiting_reqs"])
