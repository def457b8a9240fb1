"""The endpoint picker's shared state and its gRPC services.

`Picker` holds what every ext_proc stream (`controller.picker.exchange.Exchange`) shares: serve's
request path (`Tickets`, `AttemptReports`, the `LoadTracker`), each backend's `ip:port` (the
gateway knows its servers by address), the requests waiting for their access-log entry, and
the one place a request finishes. The services: Envoy's `ExternalProcessor` (a stream per
request), its `AccessLogService` (the answers of specroute's own Envoy configuration) and the
gRPC health service the endpoint-picker protocol asks for (`liveness`, `readiness` and the
ext_proc service's name).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from controller.picker import extproc
from controller.picker.exchange import Exchange
from controller.picker.outcomes import Seen
from controller.proxy.config import Settings
from controller.proxy.errors import NoBackendAvailable
from controller.proxy.load import LoadTracker
from controller.proxy.ticket import AttemptReports, Ticket, Tickets

log = logging.getLogger("specroute.picker")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
OUTCOME_WAIT_S = 5.0
"""How long after its stream's end a request waits for its access-log entry (Envoy sends each
entry at once in deploy/gateway/envoy.yaml: it usually comes with the stream's end; a busy
machine delays it); then it finishes with what the picker saw, and says so once."""


class Addresses:
    """Each backend's `ip:port`, the gateway's name for it (a host name in a backend's URL is
    resolved, again at every `refresh`: a Kubernetes pod's address changes when it restarts)."""

    def __init__(self, tracker: LoadTracker) -> None:
        self.urls = {b.name: b.url for b in tracker}
        self.by_name: dict[str, str] = {}
        self.by_address: dict[str, str] = {}
        for name, url in self.urls.items():
            parts = urlsplit(url)
            self._set(name, f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}")

    def _set(self, name: str, address: str) -> None:
        old = self.by_name.get(name)
        if old is not None:
            self.by_address.pop(old, None)
        self.by_name[name] = address
        self.by_address[address] = name

    async def refresh(self) -> None:
        loop = asyncio.get_running_loop()
        for name, url in self.urls.items():
            parts = urlsplit(url)
            host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
            try:
                socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
                continue  # an address already
            except OSError:
                pass
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                log.warning(
                    "backend %s: %s does not resolve (%s): the gateway cannot be told its address",
                    name,
                    host,
                    e,
                )
                continue
            if infos:
                self._set(name, f"{infos[0][4][0]}:{port}")


class Picker:
    """See the module's note."""

    def __init__(
        self,
        settings: Settings,
        tickets: Tickets,
        reports: AttemptReports,
        tracker: LoadTracker,
        *,
        clock: Callable[[], float],
        ask_for_usage: Callable[[bytes, Any], tuple[bytes, Any] | None],
        for_pool: Callable[[Ticket, bytes, Any], bytes],
    ) -> None:
        self.settings = settings
        self.tickets = tickets
        self.reports = reports
        self.tracker = tracker
        self.clock = clock
        self._ask_for_usage = ask_for_usage
        self._for_pool = for_pool
        self.addresses = Addresses(tracker)
        self.outcome_wait_s = OUTCOME_WAIT_S
        self.open: dict[str, Exchange] = {}
        """Routed requests not finished yet, by the id written into their metadata."""
        self._ids = itertools.count(1)
        self._said_unlogged = False
        self._prefix = f"{os.getpid():x}{os.urandom(3).hex()}"

    # -- the front half's helpers --

    def register(self, exchange: Exchange) -> str:
        key = f"{self._prefix}.{next(self._ids)}"
        self.open[key] = exchange
        return key

    def any_endpoint(self) -> list[str]:
        """For a request that is no inference (`/v1/models`, ...): the least loaded usable server."""
        usable = sorted(self.tracker.usable(self.clock()), key=lambda b: (b.pool != "baseline", b.in_flight))
        if not usable:
            raise NoBackendAvailable("no healthy backend")
        return [self.addresses.by_name[usable[0].name]]

    def allowed(self, subset: frozenset[str] | None) -> frozenset[str] | None:
        """The backends a gateway's subset hint allows (None: all); none of them usable: 503."""
        if subset is None:
            return None
        names = frozenset(n for a in subset if (n := self.addresses.by_address.get(a)) is not None)
        if not any(b.name in names for b in self.tracker.usable(self.clock())):
            raise NoBackendAvailable("none of the endpoints the gateway allows is a healthy backend")
        return names

    def keep_within(self, ticket: Ticket, allowed: frozenset[str] | None) -> None:
        """A subset hint that excludes the policy's choice: the request goes to the least loaded
        allowed backend instead (a move, so its outcome does not teach the policy)."""
        if allowed is None or ticket.backend.name in allowed:
            return
        usable = [b for b in self.tracker.usable(self.clock()) if b.name in allowed]
        target = min(usable, key=lambda b: b.in_flight)
        ticket.move(target)

    def endpoints_for(self, ticket: Ticket, allowed: frozenset[str] | None) -> list[str]:
        """The chosen server, then where a retry goes (the routing core's failover target)."""
        names = [ticket.backend.name]
        alt = ticket.failover_target(names)
        if alt is not None and (allowed is None or alt.name in allowed):
            names.append(alt.name)
        return [self.addresses.by_name[n] for n in names]

    def ask_for_usage(self, raw: bytes, body: Any) -> tuple[bytes, Any] | None:
        """serve's: the stream's request with `stream_options.include_usage` on, when the client
        did not ask (the tap removes the event from what the client receives)."""
        return self._ask_for_usage(raw, body)

    def for_pool(self, ticket: Ticket, raw: bytes, body: Any) -> bytes:
        """serve's: the body as the chosen pool gets it (its model name); `raw` when unchanged."""
        return self._for_pool(ticket, raw, body)

    # -- the back half --

    def await_log(self, exchange: Exchange) -> None:
        asyncio.get_running_loop().call_later(self.outcome_wait_s, self._unlogged, exchange)

    def _unlogged(self, exchange: Exchange) -> None:
        """No access-log entry came for a finished request: it finishes with what the stream
        showed; said once, since a gateway whose log goes elsewhere holds every slot this long."""
        if exchange.id in self.open and not self._said_unlogged:
            self._said_unlogged = True
            log.warning(
                "no access-log entry arrived within %g s of a request's end: its outcome is unknown. "
                "Does the gateway's access log (envoy.access_loggers.http_grpc) reach this picker?",
                self.outcome_wait_s,
            )
        exchange.finish()

    def logged(self, entry: Any) -> None:
        """An access-log entry: the answer of a request this picker routed (others are skipped)."""
        meta = entry.common_properties.metadata.filter_metadata
        ours = meta.get(extproc.NAMESPACE)
        if ours is None or "ticket" not in ours.fields:
            return
        exchange = self.open.get(ours.fields["ticket"].string_value)
        if exchange is None or exchange.seen is None:
            return
        tap = meta.get(extproc.TAP_NAMESPACE)
        fields = {k: extproc._plain(v) for k, v in tap.fields.items()} if tap is not None else {}
        exchange.seen.access_log(entry, fields)
        if exchange.closed_at is not None:
            exchange.finish()

    def finish(self, exchange: Exchange, ticket: Ticket, seen: Seen, ended_at: float, cut: bool) -> None:
        """The request's end: the attempt's fate to the outlier detector, a retry the gateway
        made to the next server as the ticket's move, then `Ticket.finish`."""
        self.open.pop(exchange.id, None)
        served = self.addresses.by_address.get(seen.served or "")
        first = ticket.backend
        if served is not None and served != first.name:
            self.reports.failed(first, "refused the connection (the gateway retried the next server)")
            ticket.move(self.tracker.get(served))
        result = seen.result(ended_at, cut)
        backend = ticket.backend
        if result.status == "timeout":
            self.reports.timed_out(backend, result.sent_at, "the gateway timed the request out")
        elif result.status == "error" and (seen.upstream_failed or result.http_status >= 500):
            self.reports.failed(backend, f"answered {result.http_status or 'nothing'}")
        elif result.status in ("ok", "client_error"):
            self.reports.succeeded(backend)
        ticket.finish(result)

    def close_all(self) -> None:
        """Finish whatever is still open (the picker is stopping)."""
        for exchange in list(self.open.values()):
            if exchange.closed_at is None:
                exchange.closed(cut=True)
            exchange.finish()


class ExtProcService(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Envoy's ext_proc: one stream per HTTP request."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[ep.ProcessingResponse]:
        exchange = Exchange(self.picker)
        cut = True
        try:
            async for req in request_iterator:
                for answer in await exchange.handle(req):
                    yield answer
            cut = False
        finally:
            exchange.closed(cut)


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Envoy's access log (`envoy.access_loggers.http_grpc`): each entry ends a request."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                try:
                    self.picker.logged(entry)
                except Exception:  # one bad entry must not end the stream of every other one
                    log.exception("reading an access-log entry failed")
        return als_pb2.StreamAccessLogsResponse()


class Health:
    """gRPC health (the endpoint-picker protocol's `liveness`, `readiness` and the ext_proc
    service): ready while a backend is usable."""

    def __init__(self, tracker: LoadTracker, clock: Callable[[], float]) -> None:
        self.servicer = health.aio.HealthServicer()
        self.tracker = tracker
        self.clock = clock

    async def update(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        ready = (
            serving
            if any(True for _ in self.tracker.usable(self.clock()))
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.servicer.set("liveness", serving)
        await self.servicer.set("", serving)
        await self.servicer.set("readiness", ready)
        await self.servicer.set(EXT_PROC_SERVICE, ready)

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)


def build_server(picker: Picker, health_: Health, max_message_bytes: int) -> grpc.aio.Server:
    """The gRPC server with the three services (not started)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    server = grpc.aio.server(options=options)
    ep_grpc.add_ExternalProcessorServicer_to_server(ExtProcService(picker), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogService(picker), server)
    health_.add_to(server)
    return server
