"""Envoy's ext_proc messages as the endpoint picker reads and writes them: plain values in,
protobuf messages out. No gRPC and no I/O here (`controller.picker.service` runs the streams).

The protocol is the Gateway API Inference Extension's endpoint-picker protocol, version 1.0.0
(its `docs/proposals/004-endpoint-picker-protocol`):
- the chosen endpoints, `ip:port` comma-separated, first the one to use, then where a retry goes
  next, are written both as the request header and as the dynamic metadata
  `envoy.lb / x-gateway-destination-endpoint`, with the same value;
- the gateway may restrict the choice to `envoy.lb.subset_hint /
  x-gateway-destination-endpoint-subset` (a list of `ip:port`); none of them eligible: 503;
- no ready endpoint: an immediate 503; a request to shed: an immediate 429;
- the gateway may report the endpoint that served in `envoy.lb /
  x-gateway-destination-endpoint-served` on the response's messages.

The request's path and headers come from the request-headers message or, when the gateway sends
only the body (specroute's own Envoy configuration), from the body message's attributes:
`request.path` and one `request.headers['NAME']` per header the picker reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from policies.base import EndpointKind

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
NAMESPACE = "specroute"
"""specroute's own dynamic metadata: the ticket (for the access log), the pool and reason (for
response headers), whether the tap strips the usage event."""
TAP_NAMESPACE = "specroute.tap"
"""What the Lua tap (deploy/gateway/specroute-tap.lua) wrote of the answer."""
GATEWAY_NAMESPACE = "specroute.gateway"
"""What the gateway's configuration says of itself (`outcomes: access_log`)."""
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"

Mode = processing_mode_pb2.ProcessingMode
BUFFERED = Mode.BUFFERED
BUFFERED_PARTIAL = Mode.BUFFERED_PARTIAL
STREAMED = Mode.STREAMED
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED
NONE = Mode.NONE

ROUTES: dict[str, EndpointKind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/generate": "generate",
}
"""The inference paths the picker routes with the policy (serve's)."""


def endpoint_of(path: str) -> EndpointKind | None:
    """The endpoint kind of a request path (its query string ignored), None for any other path."""
    return ROUTES.get(path.split("?", 1)[0])


def header_values(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Header names (lower case, as Envoy sends them) to values; a repeated name keeps its first."""
    out: dict[str, str] = {}
    for h in headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out.setdefault(h.key.lower(), value)
    return out


HEADER_ATTRIBUTE = "request.headers['"
"""How a request header is named among the attributes: `request.headers['x-specroute-hint']`
(Envoy sends no map as an attribute value: each header the picker reads is one attribute)."""
SOURCE_ATTRIBUTE = "source.address"
"""The client's address among the attributes (its host is the peer serve would see)."""


def attribute_request(req: ep.ProcessingRequest) -> tuple[str | None, dict[str, str], str | None]:
    """(path, headers, peer) from the `request.path`, `request.headers['NAME']` and
    `source.address` attributes; peer is the client's address without its port, as serve reads
    it (`client_of`: the client a request without an API key is known by)."""
    attrs = req.attributes.get(ATTRIBUTES_KEY)
    if attrs is None:
        return None, {}, None
    path: str | None = None
    peer: str | None = None
    headers: dict[str, str] = {}
    for key, value in attrs.fields.items():
        if not value.HasField("string_value"):
            continue
        if key == "request.path":
            path = value.string_value
        elif key == SOURCE_ATTRIBUTE:
            peer = host_of(value.string_value)
        elif key.startswith(HEADER_ATTRIBUTE) and key.endswith("']"):
            headers[key[len(HEADER_ATTRIBUTE) : -2].lower()] = value.string_value
    return path, headers, peer


def host_of(address: str) -> str | None:
    """The host of Envoy's `source.address` ("10.0.0.7:51234", "[::1]:51234"; a pipe's path as
    it is), None when empty."""
    if address.startswith("["):
        end = address.find("]")
        return address[1:end] if end > 1 else None
    host, colon, port = address.rpartition(":")
    if colon and host and port.isdigit() and ":" not in host:
        return host
    return address or None


def metadata_field(req: ep.ProcessingRequest, namespace: str, key: str) -> Any:
    """The value of `key` in the untyped dynamic metadata `namespace` Envoy forwarded, or None."""
    ns = req.metadata_context.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    return _plain(ns.fields[key])


def _plain(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        return value.number_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "list_value":
        return [_plain(v) for v in value.list_value.values]
    if kind == "struct_value":
        return {k: _plain(v) for k, v in value.struct_value.fields.items()}
    return None


def subset(req: ep.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the gateway restricts the choice to, None when it does not restrict it."""
    value = metadata_field(req, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    items = value if isinstance(value, list) else str(value).split(",")
    return frozenset(str(v).strip() for v in items if str(v).strip())


def served(req: ep.ProcessingRequest) -> str | None:
    """The endpoint the gateway reports as the one that served (the first of a list)."""
    value = metadata_field(req, LB_NAMESPACE, SERVED)
    return str(value).split(",", 1)[0].strip() or None if value is not None else None


def _struct(values: Mapping[str, Mapping[str, Any]]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update({ns: dict(fields) for ns, fields in values.items()})
    return s


def _set_headers(headers: Mapping[str, str]) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in headers.items()
        ]
    )


def routed_common(
    endpoints: list[str], body: bytes | None = None, headers: Mapping[str, str] | None = None
) -> ep.CommonResponse:
    """The destination header (and any other `headers`), a new request body when given, and a
    cleared route cache (the route may depend on the header)."""
    mutation = _set_headers({DESTINATION: ",".join(endpoints), **(headers or {})})
    common = ep.CommonResponse(clear_route_cache=True, header_mutation=mutation)
    if body is not None:
        common.body_mutation.body = body
    return common


def route_metadata(endpoints: list[str], specroute: Mapping[str, Any]) -> struct_pb2.Struct:
    """The protocol's metadata (the same value as the header) and specroute's own."""
    return _struct({LB_NAMESPACE: {DESTINATION: ",".join(endpoints)}, NAMESPACE: specroute})


def immediate(
    status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> ep.ProcessingResponse:
    """An answer Envoy gives the client at once (an error specroute decided: 429, 503, 400),
    OpenAI-shaped JSON."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_set_headers({"content-type": "application/json", **(headers or {})}),
            body=json.dumps(body).encode(),
            details=f"specroute_{status}",
        )
    )


CONTINUE_REQUEST_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
CONTINUE_REQUEST_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse())
CONTINUE_REQUEST_TRAILERS = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
CONTINUE_RESPONSE_HEADERS = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
CONTINUE_RESPONSE_BODY = ep.ProcessingResponse(response_body=ep.BodyResponse())
CONTINUE_RESPONSE_TRAILERS = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


def streamed_body(phase: str, body: bytes, end: bool) -> ep.ProcessingResponse:
    """A body chunk handed back in FULL_DUPLEX_STREAMED mode (`phase`: request_body or
    response_body)."""
    common = ep.CommonResponse(
        body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=end))
    )
    return ep.ProcessingResponse(**{phase: ep.BodyResponse(response=common)})


def status_of(headers: Mapping[str, str]) -> int:
    """The `:status` of response headers (0 when absent or not a number)."""
    value = headers.get(":status", "")
    return int(value) if value.isdigit() else 0
