"""controller/picker/extproc.py: the endpoint-picker protocol's messages, read and written
(GIE's docs/proposals/004-endpoint-picker-protocol, version 1.0.0), on real protobuf messages."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from controller.picker import extproc


def _headers(**values: str) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode()) for k, v in values.items()
        ]
    )


def test_request_headers_are_read_by_lower_case_name() -> None:
    msg = _headers(
        **{":path": "/v1/chat/completions"}, X_Specroute_Hint="code", content_type="application/json"
    )
    values = extproc.header_values(msg)
    assert values == {
        ":path": "/v1/chat/completions",
        "x-specroute-hint": "code",
        "content-type": "application/json",
    }
    legacy = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="x-a", value="old-style")])
    assert extproc.header_values(legacy) == {"x-a": "old-style"}


def test_path_and_headers_come_from_the_body_message_attributes() -> None:
    req = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"{}", end_of_stream=True))
    attrs = struct_pb2.Struct()
    attrs.update(
        {
            "request.path": "/v1/completions?x=1",
            "request.headers['X-Specroute-Mode']": "eagle",
            "source.address": "10.1.2.3:51234",
        }
    )
    req.attributes[extproc.ATTRIBUTES_KEY].CopyFrom(attrs)
    path, headers, peer = extproc.attribute_request(req)
    assert path == "/v1/completions?x=1" and headers == {"x-specroute-mode": "eagle"}
    assert peer == "10.1.2.3"  # the host alone, as serve's peer (the port changes per connection)
    assert extproc.endpoint_of(path) == "completions"
    assert extproc.attribute_request(ep.ProcessingRequest()) == (None, {}, None)


def test_the_peer_is_the_source_address_without_its_port() -> None:
    assert extproc.host_of("127.0.0.1:80") == "127.0.0.1"
    assert extproc.host_of("[2001:db8::1]:443") == "2001:db8::1"
    assert extproc.host_of("2001:db8::1") == "2001:db8::1"  # no port: as it is
    assert extproc.host_of("/run/envoy.sock") == "/run/envoy.sock"
    assert extproc.host_of("") is None and extproc.host_of("[]:1") is None


def test_inference_paths() -> None:
    assert extproc.endpoint_of("/v1/chat/completions") == "chat"
    assert extproc.endpoint_of("/generate") == "generate"
    assert extproc.endpoint_of("/v1/models") is None
    assert extproc.endpoint_of("/v1/chat/completions/extra") is None


def test_subset_hint_and_served_endpoint_are_read_from_the_metadata() -> None:
    req = ep.ProcessingRequest()
    hint = struct_pb2.Struct()
    hint.update({extproc.SUBSET: ["10.0.0.1:8000", "10.0.0.2:8000"]})
    req.metadata_context.filter_metadata[extproc.SUBSET_NAMESPACE].CopyFrom(hint)
    assert extproc.subset(req) == frozenset({"10.0.0.1:8000", "10.0.0.2:8000"})
    as_text = ep.ProcessingRequest()
    hint = struct_pb2.Struct()
    hint.update({extproc.SUBSET: "10.0.0.3:8000, 10.0.0.4:8000"})
    as_text.metadata_context.filter_metadata[extproc.SUBSET_NAMESPACE].CopyFrom(hint)
    assert extproc.subset(as_text) == frozenset({"10.0.0.3:8000", "10.0.0.4:8000"})
    assert extproc.subset(ep.ProcessingRequest()) is None

    served = ep.ProcessingRequest()
    lb = struct_pb2.Struct()
    lb.update({extproc.SERVED: "10.0.0.2:8000"})
    served.metadata_context.filter_metadata[extproc.LB_NAMESPACE].CopyFrom(lb)
    assert extproc.served(served) == "10.0.0.2:8000"
    assert extproc.served(ep.ProcessingRequest()) is None


def test_the_header_and_the_metadata_name_the_same_endpoints_in_order() -> None:
    endpoints = ["10.0.0.1:8000", "10.0.0.2:8000"]
    common = extproc.routed_common(endpoints, body=b'{"x":1}', headers={"x-extra": "1"})
    set_headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert set_headers == {extproc.DESTINATION: "10.0.0.1:8000,10.0.0.2:8000", "x-extra": "1"}
    assert common.clear_route_cache and common.body_mutation.body == b'{"x":1}'
    meta = extproc.route_metadata(endpoints, {"ticket": "t.1", "pool": "eagle"})
    lb = meta.fields[extproc.LB_NAMESPACE].struct_value.fields[extproc.DESTINATION].string_value
    assert lb == set_headers[extproc.DESTINATION]
    ours = meta.fields[extproc.NAMESPACE].struct_value.fields
    assert ours["ticket"].string_value == "t.1" and ours["pool"].string_value == "eagle"


def test_an_immediate_answer_is_openai_shaped_json_with_its_headers() -> None:
    body = {"error": {"message": "all servers busy", "type": "x", "param": None, "code": "overloaded"}}
    resp = extproc.immediate(429, body, {"Retry-After": "1"})
    imm = resp.immediate_response
    assert imm.status.code == 429
    headers = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert headers == {"content-type": "application/json", "Retry-After": "1"}
    assert json.loads(imm.body) == body


def test_full_duplex_chunks_go_back_as_streamed_responses() -> None:
    resp = extproc.streamed_body("response_body", b"data: x\n\n", True)
    streamed = resp.response_body.response.body_mutation.streamed_response
    assert streamed.body == b"data: x\n\n" and streamed.end_of_stream
    assert extproc.status_of({":status": "429"}) == 429 and extproc.status_of({}) == 0
