"""controller/picker/outcomes.py: what the gateway saw of an answer, as serve judges it -- from
an access-log entry (real protobuf messages, as Envoy sends them) or from the ext_proc messages."""

from __future__ import annotations

from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2

from controller.picker.outcomes import Seen

TAIL = (
    b'data: {"id":"x","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":12,'
    b'"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":5}}}\n\ndata: [DONE]\n\n'
)


def _entry(
    status: int, *, start_s: int = 1000, rx_ms: int = 2, flags: tuple[str, ...] = (), upstream: str = ""
) -> Any:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.response.response_code.value = status
    common = entry.common_properties
    common.start_time.seconds = start_s
    common.time_to_last_rx_byte.nanos = rx_ms * 1_000_000
    for f in flags:
        setattr(common.response_flags, f, True)
    if upstream:
        host, port = upstream.split(":")
        common.upstream_remote_address.socket_address.address = host
        common.upstream_remote_address.socket_address.port_value = int(port)
    return entry


def _seen(stream: bool = True) -> Seen:
    return Seen(endpoint="chat", stream=stream, arrived_at=50.0, source="access_log")


def test_a_streamed_answer_from_the_access_log() -> None:
    seen = _seen()
    # first body bytes 150 ms after the request body was whole (Envoy's clock)
    first_us = 1000 * 1_000_000 + 2_000 + 150_000
    seen.access_log(_entry(200, upstream="10.0.0.2:8000"), {"first_us": str(first_us), "tail": TAIL.decode()})
    result = seen.result(ended_at=51.0)
    assert result.status == "ok" and result.http_status == 200
    assert result.first_byte_at is not None and abs(result.first_byte_at - 50.150) < 1e-9
    assert (result.completion_tokens, result.prompt_tokens, result.cached_tokens) == (7, 12, 5)
    assert seen.served == "10.0.0.2:8000" and result.sent_at == 50.0


def test_the_first_byte_never_lands_after_what_envoys_own_interval_to_the_end_allows() -> None:
    """Placed by the body's arrival (a busy picker reads it late) the first byte would leave 25 ms
    to the end, where Envoy measured 30 ms from first byte to end: Envoy's interval wins."""
    seen = _seen()
    entry = _entry(200)
    first_us = 1000 * 1_000_000 + 2_000 + 10_000
    entry.common_properties.time_to_last_downstream_tx_byte.nanos = (2 + 10 + 30) * 1_000_000
    seen.access_log(entry, {"first_us": str(first_us), "tail": TAIL.decode()})
    result = seen.result(ended_at=50.035)  # the end reached the picker 35 ms after its arrival
    assert result.first_byte_at is not None and abs(result.first_byte_at - 50.005) < 1e-9


def test_the_time_the_gateway_waited_on_the_client_is_the_clients() -> None:
    """Issue 37, finding 1 behind a gateway: Envoy's last byte to the client came 2.5 s after the
    backend's last byte (a client reading slowly): that time is `client_blocked_s`, which the
    decode rate leaves out and which keeps the outcome from teaching (`policies.routing.teaches`)."""
    seen = _seen()
    entry = _entry(200)
    entry.common_properties.time_to_last_upstream_rx_byte.seconds = 1
    entry.common_properties.time_to_last_downstream_tx_byte.seconds = 3
    entry.common_properties.time_to_last_downstream_tx_byte.nanos = 500_000_000
    seen.access_log(entry, {"tail": TAIL.decode()})
    assert seen.result(ended_at=54.0).client_blocked_s == 2.5
    prompt = _seen()  # a client that took the answer as it came
    entry.common_properties.time_to_last_downstream_tx_byte.seconds = 1
    entry.common_properties.time_to_last_downstream_tx_byte.nanos = 1_000_000
    prompt.access_log(entry, {"tail": TAIL.decode()})
    assert prompt.result(ended_at=52.0).client_blocked_s == 0.001


def test_statuses_as_serve_gives_them() -> None:
    cases = [
        (_entry(200, flags=("downstream_connection_termination",)), "client_closed"),
        (_entry(504, flags=("upstream_request_timeout",)), "timeout"),
        (_entry(200, flags=("stream_idle_timeout",)), "timeout"),
        (_entry(503, flags=("upstream_connection_failure",)), "error"),
        (_entry(500), "error"),
        (_entry(400), "client_error"),
    ]
    for entry, status in cases:
        seen = _seen()
        seen.access_log(entry, {"tail": '{"error": {}}'})
        assert seen.result(1.0).status == status, entry.common_properties.response_flags
    broken = _seen()  # a stream that ended without [DONE]
    broken.access_log(_entry(200), {"tail": TAIL[: TAIL.index(b"data: [DONE]")].decode()})
    assert broken.result(1.0).status == "error"
    whole = _seen(stream=False)
    whole.access_log(_entry(200), {"tail": '{"usage": {"completion_tokens": 3}}'})
    result = whole.result(1.0)
    assert (result.status, result.completion_tokens, result.first_byte_at) == ("ok", 3, None)


def test_from_the_ext_proc_messages() -> None:
    seen = Seen(endpoint="chat", stream=True, arrived_at=10.0)
    seen.response_headers(200)
    seen.response_chunk(TAIL[:100], 10.2, False)
    seen.response_chunk(TAIL[100:], 10.5, True)
    result = seen.result(11.0)
    assert (result.status, result.first_byte_at, result.completion_tokens) == ("ok", 10.2, 7)
    cut = Seen(endpoint="chat", stream=True, arrived_at=10.0)
    cut.response_headers(200)
    cut.response_chunk(TAIL[:100], 10.2, False)
    assert cut.result(11.0).status == "client_closed"  # the gateway ended it before its end
    silent = Seen(endpoint="chat", stream=True, arrived_at=10.0)
    assert silent.result(11.0).status == "ok" and silent.result(11.0, cut=True).status == "client_closed"
