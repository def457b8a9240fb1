"""The phases of one request after its decision, and the transitions that are the only writers
of its status (h11's `_state.py` is the model: a table of allowed transitions, checked).

How it works: a `RequestState` starts `DECIDED` (its `Ticket` holds a slot). Each event a
transport sees is a method that moves it along `TRANSITIONS` and raises `BadTransition` for an
event its phase does not allow:

    DECIDED    --send-->        CONNECTING   an attempt goes to the ticket's backend
    CONNECTING --send-->        CONNECTING   the next attempt, after a failover
    CONNECTING --give_up-->     CLOSING      no attempt left: the error is the answer
    CONNECTING --answer-->      CLOSING      a whole (non-streaming) answer: ok or client_error
    CONNECTING --stream-->      STREAMING    a stream's first event: committed to this backend
    STREAMING  --judge-->       CLOSING      the stream ended: ok, or error / timeout
    (not DONE) --client_gone--> CLOSING      the client went away or stopped reading
    (not DONE) --crash-->       CLOSING      specroute itself failed: error
    (not DONE) --end-->         DONE         the slot is released and the `Outcome` built

The status is the verdict of the last of give_up, answer, judge, client_gone and crash; `end`
without one (the request was cut before any) is an error. `end` is the transition that builds
the `Outcome` (`Ticket.finish`); later calls return it. Transport-free: the HTTP lifecycle
(`controller.proxy.lifecycle`) drives it, and so may any other transport.
"""

from __future__ import annotations

from typing import Final, Literal

from controller.proxy.ticket import Result, Ticket
from policies.base import Outcome, OutcomeStatus

Phase = Literal["decided", "connecting", "streaming", "closing", "done"]
DECIDED: Final = "decided"
CONNECTING: Final = "connecting"
STREAMING: Final = "streaming"
CLOSING: Final = "closing"
DONE: Final = "done"
_LIVE: tuple[Phase, ...] = (DECIDED, CONNECTING, STREAMING, CLOSING)

TRANSITIONS: dict[tuple[Phase, str], Phase] = {
    (DECIDED, "send"): CONNECTING,
    (CONNECTING, "send"): CONNECTING,
    (CONNECTING, "give_up"): CLOSING,
    (CONNECTING, "answer"): CLOSING,
    (CONNECTING, "stream"): STREAMING,
    (STREAMING, "judge"): CLOSING,
    **{(phase, "client_gone"): CLOSING for phase in _LIVE},
    **{(phase, "crash"): CLOSING for phase in _LIVE},
    **{(phase, "end"): DONE for phase in _LIVE},
}
"""(phase, event) -> the phase it leads to; a pair not in it is a `BadTransition`."""


class BadTransition(Exception):
    """An event the request's phase does not allow (a bug in the transport driving it)."""


class RequestState:
    """Where one request is (`phase`), its verdict so far (`status`, None before one) and the
    times its transitions saw. Every field changes through a transition only."""

    __slots__ = ("first_byte_at", "http_status", "outcome", "phase", "sent_at", "status", "ticket")

    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket
        self.phase: Phase = DECIDED
        self.status: OutcomeStatus | None = None
        self.http_status = 0
        self.sent_at: float | None = None
        """When the request was first handed to a backend connection."""
        self.first_byte_at: float | None = None
        self.outcome: Outcome | None = None

    def _go(self, event: str) -> None:
        to = TRANSITIONS.get((self.phase, event))
        if to is None:
            raise BadTransition(f"{event} in phase {self.phase}")
        self.phase = to

    def send(self, now: float) -> None:
        self._go("send")
        if self.sent_at is None:
            self.sent_at = now

    def give_up(self, status: OutcomeStatus, http_status: int) -> None:
        """No attempt is left: the request is answered with an error of `http_status`."""
        self._go("give_up")
        self.status, self.http_status = status, http_status

    def answer(self, http_status: int) -> None:
        """A whole answer of `http_status` is what the client gets (4xx: the client's mistake)."""
        self._go("answer")
        self.status = "ok" if http_status < 400 else "client_error"
        self.http_status = http_status

    def stream(self, http_status: int, first_byte_at: float) -> None:
        self._go("stream")
        self.http_status, self.first_byte_at = http_status, first_byte_at

    def judge(self, status: OutcomeStatus) -> None:
        """The backend's stream ended: as it meant (ok), broken (error) or silent (timeout)."""
        self._go("judge")
        self.status = status

    def client_gone(self) -> None:
        self._go("client_gone")
        self.status = "client_closed"

    def crash(self) -> None:
        self._go("crash")
        self.status = "error"

    def end(
        self,
        now: float,
        *,
        completion_tokens: int | None = None,
        accept_length: float | None = None,
        cached_tokens: int | None = None,
        prompt_tokens: int | None = None,
        client_blocked_s: float = 0.0,
    ) -> Outcome:
        """The request's end (once; later calls return its `Outcome`): the ticket finishes with
        the verdict and what the transport counted."""
        if self.outcome is not None:
            return self.outcome
        self._go("end")
        result = Result(
            status=self.status or "error",
            ended_at=now,
            http_status=self.http_status,
            sent_at=self.sent_at,
            first_byte_at=self.first_byte_at,
            completion_tokens=completion_tokens,
            accept_length=accept_length,
            cached_tokens=cached_tokens,
            prompt_tokens=prompt_tokens,
            client_blocked_s=client_blocked_s,
        )
        self.outcome = self.ticket.finish(result)
        return self.outcome
