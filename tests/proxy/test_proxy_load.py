"""LoadTracker on its own: any interleaving of reserve / move / (double) release keeps the counts
exact, and the LoadView reports them (with scraped samples only while fresh)."""

from __future__ import annotations

from helpers import make_tracker
from hypothesis import given, settings
from hypothesis import strategies as st

URLS = ["http://b1:1", "http://b2:1", "http://e1:1"]


OPS = st.tuples(
    st.sampled_from(["reserve", "move", "release", "release_again"]),
    st.integers(0, 2),
    st.integers(0, 20),
    st.integers(0, 50),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(OPS, max_size=80))
def test_counts_are_exact_under_any_interleaving(ops):
    t = make_tracker(URLS[:2], URLS[2:])
    live = []  # (reservation, current backend name, tokens)
    released = []
    for op, target, idx, tokens in ops:
        if op == "reserve":
            live.append(t.reserve(URLS[target], tokens))
        elif op == "move" and live:
            r = live.pop(idx % len(live))
            live.append(t.move(r, URLS[target]))
            released.append(r)
        elif op == "release" and live:
            r = live.pop(idx % len(live))
            t.release(r)
            released.append(r)
        elif op == "release_again" and released:
            t.release(released[idx % len(released)])  # a second release is a no-op
        for url in URLS:
            mine = [r for r in live if r.backend.name == url]
            assert t.get(url).in_flight == len(mine)
            assert t.get(url).in_flight_tokens == sum(r.tokens for r in mine)
    for r in live:
        t.release(r)
    assert t.total_in_flight == 0
    assert all(b.in_flight == 0 and b.in_flight_tokens == 0 for b in t)


def test_view_reports_load_health_and_fresh_samples_only():
    t = make_tracker(URLS[:2], URLS[2:], stale_after_s=5.0)
    t.reserve(URLS[0], 10)
    t.reserve(URLS[2], 3)
    t.set_healthy(URLS[1], False)
    b = t.get(URLS[2])
    b.running, b.queued, b.accept_length, b.sample_time = 7, 2, 2.5, 100.0
    view = t.view(104.0)
    assert [x.in_flight for x in view.baseline.backends] == [1, 0]
    assert [x.usable for x in view.baseline.backends] == [True, False]
    e = view.eagle.backends[0]
    assert (e.in_flight, e.in_flight_tokens, e.running, e.queued, e.accept_length) == (1, 3, 7, 2, 2.5)
    assert e.sample_age_s == 4.0 and e.load == 9
    stale = t.view(106.0).eagle.backends[0]
    assert (stale.running, stale.queued, stale.sample_age_s, stale.load) == (None, None, None, 1)
    assert t.set_healthy(URLS[1], True) is True and t.set_healthy(URLS[1], True) is False
