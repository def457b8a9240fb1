"""Co-located servers in a simulated run: a server slows while its partner has running requests.

When a profile mode carries together points (`policies.together`), its simulated servers have
a second set of speed tables (`ServerModel.together`). The servers share machines two by two:
the i-th baseline server with the i-th eagle server, then the servers left over (more of one
kind, adaptive ones) two by two in deployment order, so two plain or two EAGLE servers on the
hardware a co-located pair runs on share it as the pair does. Two servers are a pair when
either has together tables; a server left alone runs alone. A server slows while its partner
is busy whatever the partner's kind: its together points were measured beside the other mode's
server, and what slows it is the partner's work on the shared cores.

A paired server is a `ColocatedServer`: the engine's `Server` with its two entry points
(`arrive`, `completion`) wrapped to tell the partner when it goes from idle to busy or back. The
partner then switches tables at that instant: its virtual clock advances at the old rate, the
decode rate, TTFT and prefill rate become the together (or alone) ones, and its next completion
is rescheduled, as an arrival does. A prefill already scheduled keeps its end time (it was
computed at admission); a request admitted while the partner is busy gets the together TTFT.

Nothing of this runs for a deployment without a pair: `server_types` then gives the plain
`Server` for every server, whose hot path is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

from simulator.engine.deployment import ServerModel
from simulator.engine.events import EventQueue
from simulator.engine.server import Prompts, Server


def pairs(models: Sequence[ServerModel]) -> list[tuple[int, int]]:
    """The indexes of each co-located pair (module's opening): baseline-i with eagle-i first, then
    the rest two by two."""
    base = [i for i, m in enumerate(models) if m.kind == "baseline"]
    eagle = [i for i, m in enumerate(models) if m.kind == "eagle"]
    mixed = list(zip(base, eagle, strict=False))
    placed = {i for pair in mixed for i in pair}
    rest = [i for i in range(len(models)) if i not in placed]
    return [
        (a, b)
        for a, b in [*mixed, *zip(rest[0::2], rest[1::2], strict=False)]
        if models[a].together is not None or models[b].together is not None
    ]


def server_types(models: Sequence[ServerModel]) -> list[type[Server]]:
    """The class of each server's state: `ColocatedServer` for a paired one, else `Server`."""
    paired = {i for pair in pairs(models) for i in pair}
    return [ColocatedServer if i in paired else Server for i in range(len(models))]


def link(states: Sequence[Server]) -> None:
    """Introduce each pair's servers to each other (after `server_types`' classes were built)."""
    for b, e in pairs([s.model for s in states]):
        first, second = states[b], states[e]
        assert isinstance(first, ColocatedServer) and isinstance(second, ColocatedServer)
        first.partner, second.partner = second, first


class ColocatedServer(Server):
    """A server sharing cores with `partner`: it runs at its together tables while the partner
    has running requests, and tells the partner when its own running count leaves or reaches 0."""

    __slots__ = ("alone", "announced", "partner", "slowed")

    def __init__(
        self,
        model: ServerModel,
        index: int,
        events: EventQueue,
        prompts: Prompts,
        table_size: int,
        output_tokens: Sequence[int],
        accept: Sequence[float],
        budget: Sequence[int],
        first: list[float],
        finish: list[float],
    ) -> None:
        super().__init__(
            model, index, events, prompts, table_size, output_tokens, accept, budget, first, finish
        )
        self.alone = model
        self.slowed = model.together
        """Tables while the partner is busy; None: this server does not slow down."""
        self.partner: ColocatedServer | None = None
        self.announced = False
        """Whether the partner was last told that this server is busy."""

    def arrive(self, r: int, t: float) -> None:
        super().arrive(r, t)
        if not self.announced and self.running:
            self._announce(True, t)

    def completion(self, seq: int, t: float) -> None:
        super().completion(seq, t)
        if self.announced and not self.running:
            self._announce(False, t)

    def _announce(self, busy: bool, t: float) -> None:
        self.announced = busy
        if self.partner is not None:
            self.partner.partner_busy(busy, t)

    def partner_busy(self, busy: bool, t: float) -> None:
        """The partner became busy (or idle) at `t`: switch to the together (or alone) tables."""
        model = self.slowed if busy else self.alone
        if model is None or model is self.model:
            return
        self.v += (t - self.t_last) * self.rate
        self.t_last = t
        self.model = model
        self.rate_table = model.rate
        self.ttft_table = model.ttft
        self.prefill = model.prefill_tok_s
        running = self.running
        rate = self.rate = model.rate[running] if running < self.table_size else model.rate_at(running)
        if self.dheap:
            ahead = self.dheap[0][0] - self.v
            self._reschedule(t + ahead / rate if ahead > 0.0 else t)
