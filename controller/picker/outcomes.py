"""What the gateway saw of one routed request, and the `Result` its ticket finishes with.

How it works: the picker learns of an answer from one of two places, whichever the gateway is
configured to give (`Seen.source`):
- the ext_proc stream itself, when the gateway sends the answer's headers and body to the
  picker (a Gateway API gateway in FULL_DUPLEX_STREAMED mode, say): `Seen.response_headers` and
  `Seen.response_chunk` note the status, the time of the first body bytes and the body's tail;
- the access log (specroute's own Envoy configuration, deploy/gateway/envoy.yaml): the Lua tap
  noted when the first body bytes passed and kept the body's tail, Envoy adds its timings and
  response flags, and `Seen.access_log` reads them. No chunk of the answer passes through Python.
In both cases the tail is read with serve's own functions (usage counts, `[DONE]`), and the end
of the ext_proc stream is the end of the request.

Times in an access-log entry are on Envoy's clock; the picker's are on its own. They are put on
the picker's clock through one shared instant: the request body's last byte, which Envoy stamps
(`time_to_last_rx_byte`) and the picker sees arrive (`Seen.arrived_at`), a loopback or
in-cluster gRPC hop apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2

from controller.proxy.generate import generate_completion_tokens
from controller.proxy.prefixes import last_count, reported_cached_tokens, reported_prompt_tokens
from controller.proxy.sse import ends_with_done
from controller.proxy.ticket import Result
from policies.base import EndpointKind, OutcomeStatus

TAIL_BYTES = 4096
"""Bytes of an answer's end kept (the Lua tap keeps as many): the usage counts and `[DONE]`."""

_TIMED_OUT = ("upstream_request_timeout", "stream_idle_timeout", "duration_timeout",
              "upstream_max_stream_duration_reached")  # fmt: skip
_FAILED = (
    "no_healthy_upstream", "local_reset", "upstream_remote_reset", "upstream_connection_failure",
    "upstream_connection_termination", "upstream_overflow", "upstream_retry_limit_exceeded",
    "upstream_protocol_error", "no_cluster_found", "dns_resolution_failure", "overload_manager",
)  # fmt: skip
_CLIENT_GONE = ("downstream_connection_termination", "downstream_remote_reset", "downstream_protocol_error")


@dataclass(slots=True)
class Seen:
    """What the picker saw of one request on its ext_proc stream (and later its access log)."""

    endpoint: EndpointKind
    stream: bool
    arrived_at: float
    """When the request's body reached the picker (its clock)."""
    source: str = "stream"
    """Where the answer is learnt: "stream" (ext_proc messages) or "access_log"."""
    http_status: int = 0
    first_byte_at: float | None = None
    tail: bytes = b""
    body_ended: bool = False
    """The answer's body reached its end (ext_proc's end_of_stream)."""
    served: str | None = None
    """The endpoint the gateway says served (`ip:port`), when it said."""
    upstream_failed: bool = False
    """The access log says the backend failed (connection, reset, protocol)."""
    first_to_end_s: float | None = None
    """From the first body bytes to the answer's last byte, on Envoy's clock (access log)."""
    client_blocked_s: float = 0.0
    """From the backend's last byte to the client's (access log): the time the gateway waited on
    a client slower than the answer, which is the client's, not the backend's."""
    informed: bool = False
    """Anything of the answer reached the picker (a response message, an access-log entry)."""
    flags: tuple[str, ...] = field(default_factory=tuple)

    def response_headers(self, status: int) -> None:
        self.informed = True
        self.http_status = status

    def response_chunk(self, chunk: bytes, now: float, end: bool) -> None:
        self.informed = True
        if chunk and self.first_byte_at is None:
            self.first_byte_at = now
        if chunk:
            self.tail = (self.tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]
        self.body_ended = self.body_ended or end

    def access_log(self, entry: accesslog_pb2.HTTPAccessLogEntry, tap: dict[str, object]) -> None:
        """Read an access-log entry of this request and what the Lua tap wrote (`tap`)."""
        self.informed = True
        common = entry.common_properties
        self.http_status = entry.response.response_code.value
        flags = common.response_flags
        self.flags = tuple(name for name in (*_TIMED_OUT, *_FAILED, *_CLIENT_GONE) if getattr(flags, name))
        self.upstream_failed = any(getattr(flags, name) for name in _FAILED)
        address = common.upstream_remote_address.socket_address
        if address.address:
            self.served = f"{address.address}:{address.port_value}"
        tail = tap.get("tail")
        if isinstance(tail, str):
            self.tail = tail.encode()
            self.body_ended = not any(getattr(flags, name) for name in (*_TIMED_OUT, *_FAILED, *_CLIENT_GONE))
        if common.HasField("time_to_last_downstream_tx_byte") and common.HasField(
            "time_to_last_upstream_rx_byte"
        ):
            waited = _us(common.time_to_last_downstream_tx_byte) - _us(common.time_to_last_upstream_rx_byte)
            self.client_blocked_s = max(0, waited) / 1e6
        first = tap.get("first_us")
        if isinstance(first, str) and first.isdigit() and self.stream:
            start_us = common.start_time.seconds * 1_000_000 + common.start_time.nanos // 1000
            body_in_us = start_us + _us(common.time_to_last_rx_byte)
            self.first_byte_at = self.arrived_at + max(0, int(first) - body_in_us) / 1e6
            if common.HasField("time_to_last_downstream_tx_byte"):
                end_us = start_us + _us(common.time_to_last_downstream_tx_byte)
                self.first_to_end_s = max(0, end_us - int(first)) / 1e6

    def status(self, cut: bool = False) -> OutcomeStatus:
        """serve's verdict on what was seen (`controller.proxy.phases`): a client that left, a
        timeout, a failed backend, an error answer, a stream without its `[DONE]`, else ok. A
        gateway that tells the picker nothing of the answer: ok, or client_closed when the
        ext_proc stream was cut (`cut`) rather than closed."""
        if not self.informed:
            return "client_closed" if cut else "ok"
        if any(f in _CLIENT_GONE for f in self.flags):
            return "client_closed"
        if any(f in _TIMED_OUT for f in self.flags):
            return "timeout"
        if self.upstream_failed:
            return "error"
        if self.http_status == 0:
            return "error"
        if not self.body_ended:  # the gateway cut the answer short: most likely its client left
            return "client_closed" if self.source == "stream" else "error"
        if self.http_status >= 500:
            return "error"
        if self.http_status >= 400:
            return "client_error"
        if self.stream and self.http_status == 200 and not ends_with_done(self.tail):
            return "error"
        return "ok"

    def _first_byte_at(self, ended_at: float) -> float | None:
        """The first byte on the picker's clock. From the access log it is placed after the body's
        arrival by Envoy's own interval, which is late by the gRPC hop that brought the body (a busy
        picker reads it late); it is never later than Envoy's interval before the end allows, so
        the decode time (first byte to end) stays Envoy's measure."""
        first = self.first_byte_at
        if first is not None and self.first_to_end_s is not None:
            first = max(self.arrived_at, min(first, ended_at - self.first_to_end_s))
        return first

    def result(self, ended_at: float, cut: bool = False) -> Result:
        """The `Result` the request's ticket finishes with."""
        status = self.status(cut)
        ok = self.http_status == 200
        tail = self.tail
        if not ok or not tail:
            tokens = cached = prompt = None
        elif self.endpoint == "generate":
            tokens, cached, prompt = generate_completion_tokens(tail), reported_cached_tokens(tail), None
        else:
            tokens = last_count(tail, b"completion_tokens")
            cached, prompt = reported_cached_tokens(tail), reported_prompt_tokens(tail)
        return Result(
            status=status,
            ended_at=ended_at,
            http_status=self.http_status,
            sent_at=self.arrived_at,
            first_byte_at=self._first_byte_at(ended_at) if self.stream else None,
            completion_tokens=tokens,
            cached_tokens=cached,
            prompt_tokens=prompt,
            client_blocked_s=self.client_blocked_s,
        )


def _us(duration: Any) -> int:
    """A protobuf Duration in microseconds."""
    return int(duration.seconds) * 1_000_000 + int(duration.nanos) // 1000
