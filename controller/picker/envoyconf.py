"""deploy/gateway/envoy.yaml placed at other addresses: the tests' and the benchmark's Envoy is the
shipped configuration, with only its listener, admin, picker and server addresses (and the Lua
tap's path) changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

Address = tuple[str, int]


def _endpoint(host: str, port: int) -> dict[str, Any]:
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}


def place(
    config_file: Path,
    *,
    pickers: list[Address],
    backends: list[Address],
    listener: Address = ("127.0.0.1", 0),
    admin: Address = ("127.0.0.1", 0),
    tap: Path | None = None,
    ext_proc: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The configuration in `config_file` with these addresses (port 0: any free one), the Lua
    tap read from `tap` (default: beside `config_file`), and `ext_proc`'s fields set on the
    ext_proc filter (e.g. message_timeout)."""
    config: dict[str, Any] = yaml.safe_load(config_file.read_text())
    config["admin"]["address"]["socket_address"] = {"address": admin[0], "port_value": admin[1]}
    (lst,) = config["static_resources"]["listeners"]
    lst["address"]["socket_address"] = {"address": listener[0], "port_value": listener[1]}
    hcm = lst["filter_chains"][0]["filters"][0]["typed_config"]
    for f in hcm["http_filters"]:
        if f["name"] == "envoy.filters.http.lua":
            lua = tap if tap is not None else config_file.parent / "specroute-tap.lua"
            f["typed_config"]["default_source_code"] = {"filename": str(lua.resolve())}
        if f["name"] == "envoy.filters.http.ext_proc" and ext_proc:
            f["typed_config"].update(ext_proc)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    clusters["specroute_picker"]["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [_endpoint(h, p) for h, p in pickers]}
    ]
    clusters["inference_pool"]["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [_endpoint(h, p) for h, p in backends]}
    ]
    return config


def router_only(
    config_file: Path, *, backends: list[Address], listener: Address = ("127.0.0.1", 0)
) -> dict[str, Any]:
    """The same Envoy without the picker: only the router (and the pool's fallback balancing),
    the reference for what the picker adds."""
    config = place(config_file, pickers=[("127.0.0.1", 1)], backends=backends, listener=listener)
    (lst,) = config["static_resources"]["listeners"]
    hcm = lst["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.router"]
    hcm.pop("access_log", None)
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    route.pop("response_headers_to_add", None)
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["name"] != "specroute_picker"
    ]
    return config
