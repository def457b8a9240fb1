"""The request path without its transport (`controller.proxy.ticket`, `controller.proxy.phases`):
the front half from body bytes to a `Ticket`, the back half from a `Result` to the `Outcome`, and
the state machine whose transitions are the only writers of a request's status."""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import make_tracker
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from controller.proxy.capacity import AdmissionMetrics, Capacity
from controller.proxy.errors import BadRequest, NoBackendAvailable, Overloaded
from controller.proxy.load import LoadTracker
from controller.proxy.metrics import Metrics
from controller.proxy.phases import TRANSITIONS, BadTransition, RequestState
from controller.proxy.ticket import RequestRecord, Result, Tickets
from policies.base import LoadView
from policies.fixed import FixedParams, FixedPolicy
from policies.spec import PolicyContext

ROOT = Path(__file__).resolve().parents[2]
BODY = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": true}'


@dataclass
class Path_:
    tickets: Tickets
    tracker: LoadTracker
    registry: CollectorRegistry
    records: list[RequestRecord]

    def sample(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def _path(bound: int | None = None) -> Path_:
    """The front and back halves over one eagle and one plain backend, the policy `fixed` eagle."""
    tracker = make_tracker(["b0=http://127.0.0.1:1"], ["e0=http://127.0.0.1:2"])
    tracker.set_bounds({"b0": bound, "e0": bound}, {})
    registry = CollectorRegistry()
    metrics = Metrics(registry, tracker, clock=lambda: 100.0)
    capacity = Capacity(tracker, AdmissionMetrics(registry), wait_s=0.0, max_waiting=4, clock=lambda: 100.0)
    records: list[RequestRecord] = []
    policy = FixedPolicy(FixedParams(pool="eagle"), PolicyContext())
    tickets = Tickets(
        policy, tracker, capacity, metrics, clock=lambda: 100.0, observers=[records.append],
        allow_client_override=True,
    )  # fmt: skip
    return Path_(tickets, tracker, registry, records)


async def test_the_front_half_takes_plain_bytes_and_a_header_mapping_to_a_reserved_ticket() -> None:
    p = _path()
    tickets, tracker = p.tickets, p.tracker
    described = await tickets.describe(BODY, "chat", {"x-specroute-hint": "code"})
    assert described.info.stream and described.info.max_tokens == 8 and described.info.hint == "code"
    await tickets.admit(described.info)
    ticket = tickets.issue(described.info, described.blocks, arrived_at=99.0)
    assert (ticket.decision.pool, ticket.backend.name, ticket.backend.url) == (
        "eagle",
        "e0",
        "http://127.0.0.1:2",
    )
    assert isinstance(ticket.view, LoadView) and ticket.chosen is ticket.decision
    assert tracker.get("e0").in_flight == 1  # reserved in the step that decided
    assert p.sample("specroute_decisions_total", policy="fixed", pool="eagle", reason="fixed_eagle") == 1.0


async def test_the_front_half_refuses_with_its_http_errors_and_counts_them() -> None:
    p = _path(bound=1)
    tickets, tracker = p.tickets, p.tracker
    with pytest.raises(BadRequest):
        await tickets.describe(b"{not json", "chat", {})
    with pytest.raises(BadRequest, match="x-specroute-mode"):
        await tickets.describe(BODY, "chat", {"x-specroute-mode": "turbo"})
    info = (await tickets.describe(BODY, "chat", {})).info
    tickets.issue(info, (), 0.0)
    tickets.issue(info, (), 0.0)  # both backends at their bound of 1 now
    with pytest.raises(Overloaded) as refused:
        await tickets.admit(info)
    assert refused.value.headers["Retry-After"] == "1"
    tracker.set_healthy("b0", False)
    tracker.set_healthy("e0", False)
    tracker.panic = False
    with pytest.raises(NoBackendAvailable):
        tickets.issue(info, (), 0.0)
    for code, n in (("400", 2.0), ("429", 1.0), ("503", 1.0)):
        assert p.sample("specroute_rejected_requests_total", code=code) == n


async def test_the_back_half_ends_a_ticket_once_from_a_plain_result() -> None:
    p = _path()
    tickets, tracker, records = p.tickets, p.tracker, p.records
    info = (await tickets.describe(BODY, "chat", {})).info
    ticket = tickets.issue(info, (), arrived_at=99.5)
    result = Result(
        status="ok", ended_at=102.0, http_status=200, sent_at=100.001, first_byte_at=100.5,
        completion_tokens=9, prompt_tokens=30, cached_tokens=None, client_blocked_s=0.25,
    )  # fmt: skip
    outcome = ticket.finish(result)
    assert tracker.get("e0").in_flight == 0
    assert (outcome.status, outcome.ttft_s, outcome.duration_s, outcome.completion_tokens) == (
        "ok",
        0.5,
        2.0,
        9,
    )
    assert outcome.decode_tok_s == pytest.approx(8 / 1.25)  # the client's 0.25 s is not the backend's
    assert ticket.finish(Result(status="error", ended_at=200.0)) is outcome  # once
    assert tracker.get("e0").in_flight == 0 and len(records) == 1
    assert records[0].outcome is outcome and records[0].http_status == 200 and records[0].arrived_at == 99.5
    assert p.sample("specroute_requests_total", pool="eagle", backend="e0", status="ok") == 1.0


async def test_a_failover_moves_the_ticket_and_its_slot() -> None:
    p = _path()
    tickets, tracker = p.tickets, p.tracker
    info = (await tickets.describe(BODY, "chat", {})).info
    ticket = tickets.issue(info, (), 0.0)
    target = ticket.failover_target({"e0"})
    assert target is not None and target.name == "b0"
    ticket.move(target)
    assert (tracker.get("e0").in_flight, tracker.get("b0").in_flight) == (0, 1)
    assert ticket.decision.reason == "failover" and ticket.chosen.backend == "e0"
    assert ticket.failover_target({"e0", "b0"}) is None and ticket.tried_every_usable({"e0", "b0"})
    outcome = ticket.finish(Result(status="ok", ended_at=1.0))
    assert outcome.failed_over and tracker.get("b0").in_flight == 0
    assert p.sample("specroute_failovers_total", pool="eagle") == 1.0


async def test_a_request_knows_its_client_by_a_hash_of_its_key_else_of_its_address() -> None:
    """`RequestInfo.client` (what a learning policy bounds one client's share by): a stable hash of
    the Authorization header whatever the address, else of the peer's address, else 0."""
    tickets = _path().tickets

    async def client(headers: dict[str, str], peer: str | None = None) -> int:
        # case-insensitive, as aiohttp gives serve its headers
        return (await tickets.describe(BODY, "chat", CIMultiDict(headers), peer)).info.client

    key = await client({"Authorization": "Bearer sk-one"}, "10.0.0.1")
    assert key == await client({"Authorization": "Bearer sk-one"}, "10.0.0.2") != 0
    assert key != await client({"Authorization": "Bearer sk-two"}, "10.0.0.1")
    assert "sk-one" not in str(key) and key.bit_length() <= 64
    peer = await client({}, "10.0.0.1")
    assert peer not in (0, key) and peer == await client({}, "10.0.0.1") != await client({}, "10.0.0.2")
    assert await client({}) == 0
    assert await client({"authorization": "Bearer sk-one"}, "10.0.0.3") == key  # any case


async def test_a_request_reserves_its_sequences_and_its_decode_rate_is_per_sequence() -> None:
    """`n` x prompts slots held from the decision to the end (a failover moves them all), and
    the completion tokens, the sum over the sequences, divided among them."""
    p = _path()
    tickets, tracker = p.tickets, p.tracker
    body = b'{"prompt": ["a", "b"], "n": 3, "max_tokens": 8, "stream": true}'
    info = (await tickets.describe(body, "completions", {})).info
    assert info.sequences == 6
    ticket = tickets.issue(info, (), 0.0)
    assert (tracker.get("e0").in_flight, tracker.get("e0").in_flight_tokens) == (6, 48)
    ticket.move(tracker.get("b0"))
    e0, b0 = tracker.get("e0"), tracker.get("b0")
    assert (e0.in_flight, b0.in_flight, b0.in_flight_tokens) == (0, 6, 48)
    result = Result("ok", ended_at=101.0, first_byte_at=100.0, completion_tokens=126)
    assert ticket.finish(result).decode_tok_s == pytest.approx(20.0)  # per sequence: (21 - 1) / 1 s
    assert tracker.total_in_flight == 0 and tracker.get("b0").in_flight_tokens == 0


# -- the state machine --


async def _state() -> tuple[RequestState, LoadTracker]:
    p = _path()
    tickets, tracker = p.tickets, p.tracker
    return RequestState(tickets.issue((await tickets.describe(BODY, "chat", {})).info, (), 0.0)), tracker


async def test_a_stream_that_ends_well_is_ok_and_its_end_releases_the_slot() -> None:
    state, tracker = await _state()
    phases: list[str] = [state.phase]
    state.send(100.0)
    state.send(100.1)  # a failover's attempt: the first send time stays
    state.stream(200, 100.5)
    phases.append(state.phase)
    assert state.status is None and state.sent_at == 100.0
    state.judge("ok")
    outcome = state.end(101.0, completion_tokens=3)
    phases.append(state.phase)
    assert phases == ["decided", "streaming", "done"]
    assert outcome.status == "ok" and tracker.get("e0").in_flight == 0
    assert state.end(999.0) is outcome


async def test_the_client_leaving_after_the_verdict_makes_it_client_closed() -> None:
    state, _ = await _state()
    state.send(0.0)
    state.answer(200)
    state.client_gone()
    assert state.end(1.0).status == "client_closed"


async def test_a_request_cut_before_any_verdict_is_an_error_and_a_4xx_answer_the_clients() -> None:
    state, _ = await _state()
    state.send(0.0)
    assert state.end(1.0).status == "error"
    state, _ = await _state()
    state.send(0.0)
    state.answer(404)
    assert state.end(1.0).status == "client_error" and state.http_status == 404


async def test_every_transition_not_in_the_table_is_refused() -> None:
    events = {
        "send": lambda s: s.send(0.0),
        "give_up": lambda s: s.give_up("error", 502),
        "answer": lambda s: s.answer(200),
        "stream": lambda s: s.stream(200, 0.0),
        "judge": lambda s: s.judge("ok"),
        "client_gone": lambda s: s.client_gone(),
        "crash": lambda s: s.crash(),
        "end": lambda s: s.end(0.0),
    }
    # Every pair of events from a fresh request: allowed exactly when the table says so.
    for first, second in itertools.product(events, repeat=2):
        state, _ = await _state()
        for event in (first, second):
            allowed = (state.phase, event) in TRANSITIONS or (event == "end" and state.phase == "done")
            if allowed:
                events[event](state)
            else:
                before = (state.phase, state.status)
                with pytest.raises(BadTransition):
                    events[event](state)
                assert (state.phase, state.status) == before  # refused: nothing written
                break
    assert not any(phase == "done" for phase, _ in TRANSITIONS)  # nothing leaves the end


def test_the_status_is_written_only_by_transitions() -> None:
    """`status =` appears in phases.py's transition methods and nowhere else on the request path."""
    writers: list[str] = []
    for name in ("phases", "lifecycle", "forward", "ticket"):
        tree = ast.parse((ROOT / "controller" / "proxy" / f"{name}.py").read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else []
                targets = [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else targets
                for target in targets:
                    for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(t, ast.Attribute) and t.attr == "status":
                            writers.append(f"{name}.{fn.name}")
    transitions = {"give_up", "answer", "judge", "client_gone", "crash"}
    assert set(writers) == {f"phases.{name}" for name in ("__init__", *transitions)}


def test_the_transport_free_halves_import_no_http_framework() -> None:
    for name in ("ticket", "phases", "errors"):
        tree = ast.parse((ROOT / "controller" / "proxy" / f"{name}.py").read_text())
        imported = {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        } | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {m for m in imported if m.split(".")[0] in ("aiohttp", "multidict", "yarl")}, name
