"""One ext_proc stream: one request from its body to its `Outcome`, through serve's request path.

How it works: Envoy opens an ext_proc stream per HTTP request and closes it when the request
is over, however it ended (answered, failed, the client gone, a timeout). An `Exchange` reads
the stream's messages (`handle`): once the request body is whole it runs the front half of
serve's request path (`controller.proxy.ticket.Tickets`: parse, describe, fingerprint, admit,
then view + decide + reserve in one step) and answers with the chosen server, or with the error
serve would give (429 with Retry-After, 503, 400) as an immediate response. The answer's
messages, if the gateway sends them, and the stream's end (`closed`) are what it saw of the
answer (`controller.picker.outcomes.Seen`); the ticket finishes then -- or, when the gateway
reports answers through its access log, once that entry has arrived too
(`controller.picker.picker.Picker.logged`), within
`controller.picker.picker.Picker.outcome_wait_s` of the stream's end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from controller.picker import extproc
from controller.picker.extproc import BUFFERED, FULL_DUPLEX, NONE, STREAMED
from controller.picker.outcomes import Seen
from controller.proxy.config import Settings
from controller.proxy.errors import PayloadTooLarge, SpecrouteError
from controller.proxy.sse import Holdback, drop_usage_events
from controller.proxy.ticket import Ticket, Tickets

log = logging.getLogger("specroute.picker")


class Picker(Protocol):
    """What an exchange needs of the picker that runs it (`controller.picker.picker.Picker` is
    the one implementation): a protocol, so this module does not import the one importing it."""

    settings: Settings
    tickets: Tickets
    clock: Callable[[], float]

    def register(self, exchange: Exchange) -> str: ...
    def any_endpoint(self) -> list[str]: ...
    def allowed(self, subset: frozenset[str] | None) -> frozenset[str] | None: ...
    def keep_within(self, ticket: Ticket, allowed: frozenset[str] | None) -> None: ...
    def endpoints_for(self, ticket: Ticket, allowed: frozenset[str] | None) -> list[str]: ...
    def ask_for_usage(self, raw: bytes, body: Any) -> tuple[bytes, Any] | None: ...
    def for_pool(self, ticket: Ticket, raw: bytes, body: Any) -> bytes: ...
    def await_log(self, exchange: Exchange) -> None: ...
    def finish(self, exchange: Exchange, ticket: Ticket, seen: Seen, ended_at: float, cut: bool) -> None: ...


class Exchange:
    """One request's ext_proc stream (see the module's note)."""

    __slots__ = (
        "body",
        "closed_at",
        "cut",
        "decided",
        "headers",
        "held",
        "id",
        "path",
        "peer",
        "picker",
        "request_body_mode",
        "response_body_mode",
        "seen",
        "ticket",
    )

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.headers: dict[str, str] = {}
        self.path: str | None = None
        self.peer: str | None = None
        """The client's address (without port), when the gateway sends `source.address`."""
        self.body = bytearray()
        self.request_body_mode = BUFFERED
        self.response_body_mode = NONE
        self.decided = False
        self.held: Holdback | None = None
        """The answer's unfinished event, when the picker strips the usage event it relays."""
        self.ticket: Ticket | None = None
        self.seen: Seen | None = None
        self.id = ""
        self.closed_at: float | None = None
        self.cut = False

    # -- the request --

    async def handle(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """The answers to one message (none in observability mode)."""
        out = await self._handle(req)
        return [] if req.observability_mode else out

    async def _handle(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if req.HasField("protocol_config"):
            self.request_body_mode = req.protocol_config.request_body_mode
            self.response_body_mode = req.protocol_config.response_body_mode
        if kind == "request_headers":
            self.headers = extproc.header_values(req.request_headers.headers)
            self.path = self.headers.get(":path")
            self.peer = extproc.attribute_request(req)[2]  # attributes come with the first message
            if req.request_headers.end_of_stream or self.request_body_mode in (NONE, STREAMED):
                # No body will come before the headers are answered: decide on what there is.
                return await self._decide(req, ep.ProcessingResponse(request_headers=ep.HeadersResponse()))
            if self.request_body_mode == FULL_DUPLEX:
                return []  # answered with the body
            return [extproc.CONTINUE_REQUEST_HEADERS]
        if kind == "request_body":
            if self.decided:
                return [self._passed_body(req.request_body)]
            chunk = req.request_body.body
            if len(self.body) + len(chunk) > self.picker.settings.body_limit_bytes:
                return [
                    self._refuse(
                        PayloadTooLarge(f"request body over {self.picker.settings.body_limit_bytes} bytes")
                    )
                ]
            self.body += chunk
            if not req.request_body.end_of_stream and self.request_body_mode == FULL_DUPLEX:
                return []
            if self.path is None:  # only the body was sent: path and headers came as attributes
                self.path, self.headers, self.peer = extproc.attribute_request(req)
            return await self._decide(req, None)
        if kind == "request_trailers":
            if not self.decided:
                return [*await self._decide(req, None), extproc.CONTINUE_REQUEST_TRAILERS]
            return [extproc.CONTINUE_REQUEST_TRAILERS]
        seen = self.seen
        if kind == "response_headers":
            if seen is not None:
                seen.response_headers(extproc.status_of(extproc.header_values(req.response_headers.headers)))
                seen.served = extproc.served(req) or seen.served
                if req.response_headers.end_of_stream:
                    seen.body_ended = True
            return [extproc.CONTINUE_RESPONSE_HEADERS]
        if kind == "response_body":
            body = req.response_body
            if seen is not None:
                seen.response_chunk(body.body, self.picker.clock(), body.end_of_stream)
            if self.response_body_mode != FULL_DUPLEX:
                return [extproc.CONTINUE_RESPONSE_BODY]
            chunk = body.body
            if self.held is not None:  # the usage event the picker asked for goes no further
                chunk = drop_usage_events(self.held.push(chunk))
                if body.end_of_stream:
                    chunk += drop_usage_events(self.held.rest())
            return [extproc.streamed_body("response_body", chunk, body.end_of_stream)]
        if kind == "response_trailers":
            if seen is not None:
                seen.body_ended = True
            return [extproc.CONTINUE_RESPONSE_TRAILERS]
        return []

    def _passed_body(self, body: ep.HttpBody) -> ep.ProcessingResponse:
        if self.request_body_mode == FULL_DUPLEX:
            return extproc.streamed_body("request_body", body.body, body.end_of_stream)
        return extproc.CONTINUE_REQUEST_BODY

    def _refuse(self, error: SpecrouteError) -> ep.ProcessingResponse:
        self.decided = True
        return extproc.immediate(error.http_status, error.body(), error.headers)

    async def _decide(
        self, req: ep.ProcessingRequest, headers_answer: ep.ProcessingResponse | None
    ) -> list[ep.ProcessingResponse]:
        """Route the request (its body is whole, or none will come); answer the message."""
        self.decided = True
        picker = self.picker
        raw = bytes(self.body)
        self.body = bytearray()
        arrived = picker.clock()
        endpoint = extproc.endpoint_of(self.path or "")
        meta: dict[str, Any] = {}
        new_body: bytes | None = None
        try:
            if endpoint is None:  # not an inference route (/v1/models, /health, ...): any server
                endpoints = picker.any_endpoint()
            else:
                endpoints, meta, new_body = await self._ticket(req, raw, endpoint, arrived)
        except SpecrouteError as e:
            return [extproc.immediate(e.http_status, e.body(), e.headers)]
        common = extproc.routed_common(
            endpoints, body=new_body if self.request_body_mode != FULL_DUPLEX else None
        )
        metadata = extproc.route_metadata(endpoints, meta)
        if headers_answer is not None:
            headers_answer.request_headers.response.CopyFrom(common)
            headers_answer.dynamic_metadata.CopyFrom(metadata)
            return [headers_answer]
        if self.request_body_mode == FULL_DUPLEX:
            sent = raw if new_body is None else new_body
            return [
                ep.ProcessingResponse(
                    request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
                ),
                extproc.streamed_body("request_body", sent, True),
            ]
        return [
            ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)
        ]

    async def _ticket(
        self, req: ep.ProcessingRequest, raw: bytes, endpoint: Any, arrived: float
    ) -> tuple[list[str], dict[str, Any], bytes | None]:
        picker = self.picker
        tickets = picker.tickets
        described = await tickets.describe(raw or b"{}", endpoint, self.headers, self.peer)
        body, info = described.body, described.info
        await tickets.admit(info)
        allowed = picker.allowed(extproc.subset(req))
        source = extproc.metadata_field(req, extproc.GATEWAY_NAMESPACE, "outcomes")
        self.seen = Seen(
            endpoint=endpoint,
            stream=info.stream,
            arrived_at=arrived,
            source="access_log" if source == "access_log" else "stream",
        )
        # From here the ticket holds a slot: whatever happens next, the stream's end finishes it.
        ticket = self.ticket = tickets.issue(info, described.blocks, arrived)
        self.id = picker.register(self)
        picker.keep_within(ticket, allowed)
        meta: dict[str, Any] = {
            "ticket": self.id,
            "pool": ticket.decision.pool,
            "reason": ticket.decision.reason,
        }
        sent, sent_body = raw, body
        # The usage counts, asked for on the client's behalf where the picker learns the answer
        # (serve does so on every stream); the event is taken out again before the client: by
        # the Lua tap, or here when the answer streams through (FULL_DUPLEX_STREAMED).
        relayed = self.response_body_mode == FULL_DUPLEX
        if (self.seen.source == "access_log" or relayed) and endpoint != "generate":
            asked = picker.ask_for_usage(raw, dict(body))
            if asked is not None:
                (sent, sent_body), meta["strip_usage"] = asked, True
                if relayed:
                    self.held = Holdback()
        sent = picker.for_pool(ticket, sent, sent_body)
        return picker.endpoints_for(ticket, allowed), meta, None if sent is raw else sent

    # -- the end --

    def closed(self, cut: bool) -> None:
        """The ext_proc stream ended (`cut`: reset rather than closed): the request is over."""
        if self.ticket is None or self.closed_at is not None:
            return
        self.closed_at = self.picker.clock()
        self.cut = cut
        seen = self.seen
        if seen is not None and seen.source == "access_log" and not seen.informed:
            self.picker.await_log(self)  # the access-log entry finishes it (or the wait ends)
            return
        self.finish()

    def finish(self) -> None:
        """Finish the ticket with what was seen (once)."""
        ticket, seen = self.ticket, self.seen
        if ticket is None or seen is None or ticket.outcome is not None:
            return
        self.picker.finish(self, ticket, seen, self.closed_at or self.picker.clock(), self.cut)
