"""Settings: one frozen, typed object built at start-up.

Precedence: command-line flags > environment (`SPECROUTE_<FIELD>`) > YAML file (`--config`,
keys equal the field names) > defaults. The sources are merged by hand into one dict, then
validated once by `Settings.model_validate`; an invalid value raises `ConfigError` naming the
key and the source it came from. List fields accept comma-separated strings (flags, env);
dict/list-of-dict fields accept JSON in the environment. `policy_params` merge key by key,
except that params set for a different policy by a lower-precedence source are dropped.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from controller.proxy.redact import (
    Redactor,
    mask_userinfo,
    secrets_in_env,
    secrets_in_values,
    secrets_in_yaml,
)
from policies.base import POOLS, Pool
from policies.ladder import LadderError, parse_ladder
from policies.params import parse_policy_ref
from policies.spec import PolicyError
from policies.view import STALE_AFTER_S

ENV_PREFIX = "SPECROUTE_"


class ConfigError(ValueError):
    """A setting is invalid; the message names the key and where it came from."""


class ShadowPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Registered policy name or module.path:ClassName.")
    params: dict[str, Any] = Field(default_factory=dict, description="Parameters of that policy.")
    label: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.:-]{1,64}$",
        description="Name in metrics and the decision log (default: the policy name); must be "
        "unique, so set it when the same policy appears twice with different params.",
    )


def default_policy(profile: Any) -> str:
    """The policy when none is set: `cost_model` when a speed profile is given (it predicts from
    the profile and calibrates it from outcomes), else `online` (it learns from outcomes alone)."""
    return "cost_model" if profile is not None and str(profile).strip() else "online"


def _split_list(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _blank_is_unset(value: Any) -> Any:
    """An empty or blank optional setting (`admin_token: ""`, `SPECROUTE_BASELINE_API_KEY=`) means
    unset: it must not switch the admin endpoint on or replace the client's key with nothing."""
    if isinstance(value, str) and not value.strip():
        return None
    return value


def _shadow_entry(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        name, params = parse_policy_ref(value, "entry")
    except PolicyError as e:
        raise ValueError(str(e)) from None
    return {"name": name, "params": params or {}}


PLACEHOLDER_DOMAIN = ".invalid"
"""RFC 2606's reserved domain: the placeholder backend URLs `specroute plan` writes use it."""
_BACKEND_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _normalise_url(url: str) -> str:
    parts = urlsplit(url)
    if "@" in parts.netloc:
        # Never echo the URL: it holds a password. aiohttp would send it as Basic auth and then
        # refuse every client Authorization header; and the URL would reach headers and logs.
        host = parts.netloc.rpartition("@")[2]
        raise ValueError(
            f"the URL of backend {parts.scheme}://***@{host} carries credentials (user:password@): "
            "remove them; set baseline_api_key / eagle_api_key (environment or file) for a key the "
            "backend expects"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{mask_userinfo(repr(url))} is not an http(s)://host[:port] URL")
    if parts.hostname.rstrip(".").lower().endswith(PLACEHOLDER_DOMAIN):
        raise ValueError(
            f"{mask_userinfo(repr(url))} is a placeholder (the reserved {PLACEHOLDER_DOMAIN} domain never "
            "resolves; `specroute plan` writes such URLs): replace it with your server's URL"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"{mask_userinfo(repr(url))} has an invalid port") from None
    if parts.query or parts.fragment:
        raise ValueError(f"{mask_userinfo(repr(url))}: query strings and fragments are not allowed")
    if parts.path not in ("", "/"):
        raise ValueError(
            f"{mask_userinfo(repr(url))}: give the server's base URL without a path (specroute adds /v1/...)"
        )
    return url.rstrip("/")


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One configured backend, parsed once when `Settings` is validated: the name clients, metrics
    and logs see, the URL it is reached at and its pool. Settings hold these (`Settings.baseline`,
    `Settings.eagle`) and write them back as text (`NAME=URL`, or the bare URL when unnamed), so a
    dumped config reads back the same. Per-backend facts added later (an engine kind, say) are
    fields here, with a default, so every existing entry stays valid."""

    name: str
    url: str
    pool: Pool

    @property
    def entry(self) -> str:
        """The config text this backend is written as: `NAME=URL`, or the URL when unnamed."""
        return self.url if self.name == self.url else f"{self.name}={self.url}"


def parse_backend(entry: str, pool: Pool = "baseline") -> BackendSpec:
    """`NAME=URL` or a bare `URL` (whose name is then the URL itself), a backend of `pool`."""
    head, sep, rest = entry.partition("=")
    if sep and "://" not in head:
        name = head.strip()
        if not _BACKEND_NAME.fullmatch(name):
            raise ValueError(
                f"backend name {name[:70]!r}: use 1-64 letters, digits, '_', '.', '-' "
                "(the first a letter or digit)"
            )
        return BackendSpec(name, _normalise_url(rest.strip()), pool)
    url = _normalise_url(entry.strip())
    return BackendSpec(url, url, pool)


def _backend_specs(entries: Any, info: ValidationInfo) -> list[BackendSpec]:
    """The entries of the `baseline` or `eagle` setting (text, or specs already parsed) as specs."""
    pool: Pool = "eagle" if info.field_name == "eagle" else "baseline"
    entries = _split_list(entries)
    if not isinstance(entries, list | tuple):
        raise ValueError("expected a list of URL or NAME=URL entries (or one comma-separated string)")
    specs = []
    for entry in entries:
        if isinstance(entry, BackendSpec):
            specs.append(entry if entry.pool == pool else BackendSpec(entry.name, entry.url, pool))
        elif isinstance(entry, str):
            specs.append(parse_backend(entry, pool))
        else:
            raise ValueError(f"expected a URL or NAME=URL, got {type(entry).__name__} {str(entry)[:70]!r}")
    return specs


class Settings(BaseModel):
    """Everything `specroute serve` is configured by."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    baseline: list[BackendSpec] = Field(
        default_factory=list,
        description="The plain SGLang backends: URL, or NAME=URL to show NAME instead of the URL in "
        "headers, errors, metrics and logs.",
    )
    eagle: list[BackendSpec] = Field(
        default_factory=list, description="The EAGLE-3 SGLang backends: URL or NAME=URL, as `baseline`."
    )
    backend_header: bool = Field(
        default=True,
        description="Send x-specroute-backend (the serving backend's name) in responses; off: clients "
        "learn nothing about the backends but the pool (error messages, stream error events, /ready and "
        "/server_info name none; logs and /metrics still do).",
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to listen on (0: any free port).")
    policy: str = Field(
        default="",
        description="Routing policy name or module.path:ClassName (default: cost_model when a profile is "
        "given, else online).",
    )
    policy_params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the policy.")
    profile: str | None = Field(default=None, description="Speed profile: a JSON path or a built-in name.")
    seed: int = Field(default=0, description="Seed of the random tie-breaks (policy and proxy).")
    allow_client_override: bool = Field(
        default=False,
        description="Honour the x-specroute-mode request header (force a pool); off by default, so "
        "clients cannot bypass the policy unless the operator allows it.",
    )
    body_limit_bytes: int = Field(default=32 * 1024 * 1024, gt=0, description="Largest request body.")
    body_max_json_values: int = Field(
        default=500_000,
        gt=0,
        description="Most JSON values (strings, numbers, objects, arrays...) in a request body (else "
        "413): bounds the memory and CPU of parsing one body, whatever its byte size.",
    )
    body_max_json_containers: int = Field(
        default=100_000,
        gt=0,
        description="Most JSON objects and arrays in a request body (else 413); each costs far more to "
        "parse than a scalar.",
    )
    response_limit_bytes: int = Field(
        default=64 * 1024 * 1024,
        gt=0,
        description="Largest backend answer specroute holds in memory: a non-streaming body, or the "
        "first event of a stream (both are read whole before committing); larger gets 502.",
    )
    info_limit_bytes: int = Field(
        default=4 * 1024 * 1024,
        gt=0,
        description="Largest backend answer to an info route (/v1/models, /model_info, /server_info) "
        "specroute reads (else 502 info_answer_too_large); what it holds counts against "
        "memory_budget_bytes, and a /server_info answer is parsed off the event loop when large.",
    )
    memory_budget_bytes: int = Field(
        default=512 * 1024 * 1024,
        gt=0,
        description="What all requests together may hold in memory: request bodies (after "
        "decompression), streams' first events and held-back bytes, non-streaming answers. Over it, "
        "new requests get 503 with Retry-After and a backend answer that does not fit gets 502; a body "
        "or first event over 1 MiB that fits in half of it first waits for room (reading nothing) up to "
        "admission_wait_s. The default suits a 1 GiB container.",
    )
    body_max_compression_ratio: float = Field(
        default=100.0,
        gt=1,
        description="Largest decompressed/compressed size of a compressed request body (else 413): "
        "held against its Content-Length, or without one (chunked) against the bytes received so far "
        "as it inflates, so a small gzip bomb is refused early.",
    )
    body_read_concurrency: int = Field(
        default=4,
        gt=0,
        description="Request bodies read at once among the costly ones (declared over 1 MiB, compressed, "
        "or chunked); the others wait for a turn, reading nothing, up to admission_wait_s, then get 503 "
        "with Retry-After. Bounds how long /health and small requests wait behind hostile bodies.",
    )
    client_write_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Time a write to a client may stay blocked (the client stopped reading) before its "
        "answer is given up and its connection closed.",
    )
    header_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Time a client has to send complete request headers after connecting or after its "
        "previous response (also the idle keep-alive limit); then the connection is closed.",
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="Time a client has to send the whole request body (else 408)."
    )
    connect_timeout_s: float = Field(default=5.0, gt=0, description="TCP connect timeout to a backend.")
    first_byte_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Time allowed until a stream's first event (non-streaming: see request_timeout_s).",
    )
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Time a non-streaming request may take on its backend, whole answer included "
        "(then 504); such a request is never sent to a second backend once one has taken it.",
    )
    overload_backoff_s: float = Field(
        default=1.0,
        ge=0,
        description="How long a backend that answered 'queue full' (or 503/429) takes no new requests "
        "from this replica: overload is backed off, never counted as a failure.",
    )
    idle_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Longest silence between two chunks; a stream is cut at most 1/8 of this later.",
    )
    health_check_path: str = Field(
        default="/ready",
        description="Path probed by active health checks (200 = healthy). SGLang's /ready answers without "
        "generating; a backend that answers it with 404 (older SGLang) is probed on /health instead.",
    )
    health_check_interval_s: float = Field(default=5.0, gt=0, description="Seconds between health probes.")
    health_check_timeout_s: float = Field(default=5.0, gt=0, description="Timeout of one health probe.")
    health_check_unhealthy_threshold: int = Field(
        default=2, ge=1, description="Consecutive failed probes before a backend counts as unhealthy."
    )
    health_check_healthy_threshold: int = Field(
        default=1, ge=1, description="Consecutive passed probes before an unhealthy backend is healthy again."
    )
    outlier_consecutive_failures: int = Field(
        default=3,
        ge=1,
        description="Consecutive failed requests (refused or timed-out connection, 5xx, queue full, broken "
        "stream) before a backend is ejected from routing.",
    )
    outlier_base_ejection_s: float = Field(
        default=10.0,
        gt=0,
        description="Ejection time of a first ejection; the n-th ejection in a row lasts n times as long.",
    )
    outlier_max_ejection_s: float = Field(
        default=300.0, gt=0, description="Upper bound of one ejection's time."
    )
    outlier_max_ejected_percent: float = Field(
        default=50.0,
        ge=0,
        le=100,
        description="Most backends of a pool ejected at once, in percent (one may always be ejected).",
    )
    panic_routing: bool = Field(
        default=True,
        description="When no backend of either pool is available (all unhealthy or ejected), route to all "
        "of them as if healthy rather than answer 503 (Envoy's panic mode).",
    )
    baseline_backend_max_in_flight: int | None = Field(
        default=None,
        ge=0,
        description="Requests this proxy sends to one baseline backend at once, counted in sequences (a "
        "request with n: 4 counts 4; null: the profile's max_running_requests plus admission_margin; "
        "unbounded without a profile; 0: unbounded).",
    )
    eagle_backend_max_in_flight: int | None = Field(
        default=None, ge=0, description="The same for one eagle backend."
    )
    baseline_max_in_flight: int | None = Field(
        default=None,
        ge=0,
        description="Requests this proxy sends to the baseline pool at once, in sequences (null: the sum "
        "over its backends; 0: unbounded).",
    )
    eagle_max_in_flight: int | None = Field(default=None, ge=0, description="The same for the eagle pool.")
    admission_margin: float = Field(
        default=0.25,
        ge=0,
        description="Default backend bound = max_running_requests x (1 + this): the backend's queue "
        "holds this share more, so its batch stays full.",
    )
    admission_wait_s: float = Field(
        default=10.0,
        ge=0,
        description="How long a request may wait in specroute for a free slot when every backend it may "
        "use is at its bound, then 429 with Retry-After; also how long a large body or first event "
        "waits for a body turn or for room in the memory budget, then 503 (body) or 502 (answer).",
    )
    admission_max_waiting: int = Field(
        default=1024, ge=0, description="Most requests waiting for a slot at once; beyond it, 429 at once."
    )
    max_n: int = Field(
        default=16,
        ge=1,
        description="Largest `n` (samples per prompt) a request may ask for (chat, completions, "
        "/generate's sampling_params.n); above it, 400. A backend runs each sample as a request of its "
        "own: the default fits in a third of the smallest running-request cap seen in practice (48).",
    )
    max_prompts_per_request: int = Field(
        default=16,
        ge=1,
        description="Most prompts in one /v1/completions request (a list of prompts); above it, 400. A "
        "request's prompts x n may not exceed the larger of this and max_n either.",
    )
    shutdown_grace_s: float = Field(
        default=5.0,
        ge=0,
        description="On SIGTERM/SIGINT, how long /ready answers 503 while new requests are still "
        "served (so load balancers notice), before the listener closes and the drain begins.",
    )
    drain_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="After shutdown_grace_s, how long in-flight requests may finish; then they are cut.",
    )
    admin_token: SecretStr | None = Field(
        default=None, description="Bearer token of POST /admin/policy (disabled when unset)."
    )
    admin_policy_modules: list[str] = Field(
        default_factory=list,
        description="Modules (or packages) whose classes POST /admin/policy may load as "
        "module.path:ClassName; built-in and entry-point policies are always allowed.",
    )
    baseline_model: str | None = Field(
        default=None, description="Rewrite the request's `model` to this name for baseline backends."
    )
    eagle_model: str | None = Field(
        default=None, description="Rewrite the request's `model` to this name for eagle backends."
    )
    baseline_api_key: SecretStr | None = Field(
        default=None, description="API key sent to baseline backends (else the client's is forwarded)."
    )
    eagle_api_key: SecretStr | None = Field(
        default=None, description="API key sent to eagle backends (else the client's is forwarded)."
    )
    reload_settle_s: float = Field(
        default=0.25,
        ge=0,
        le=30,
        description="On SIGHUP the config file is applied only once two reads this many seconds apart "
        "agree (bytes, size, mtime, inode), so a file still being written is not applied half way.",
    )
    log_bodies: bool = Field(default=False, description="Log request bodies (debugging only).")
    decision_log: str | None = Field(default=None, description="Path of the JSONL decision log.")
    decision_log_queue_bytes: int = Field(
        default=32 * 1024 * 1024,
        gt=0,
        description="Most memory the decision-log records waiting for the disk may hold (a hung disk or "
        "mount); past it new records are dropped and counted (specroute_decision_log_dropped_records_total"
        '{reason="queue_full"}). Beside memory_budget_bytes, not in it: a stalled log never refuses '
        "requests.",
    )
    state_file: str | None = Field(
        default=None,
        description="Path of the file that keeps what the policy learned (and the prefix beliefs) "
        "across restarts: loaded at start, saved every state_save_interval_s and at shutdown.",
    )
    state_save_interval_s: float = Field(
        default=60.0, gt=0, le=86400, description="Seconds between saves of state_file."
    )
    shadow_policies: list[ShadowPolicy] = Field(
        default_factory=list, description="Policies evaluated on every request without acting."
    )
    scrape_interval_s: float = Field(default=1.0, gt=0, description="Seconds between backend scrapes.")
    scrape_stale_after_s: float = Field(
        default=STALE_AFTER_S, gt=0, description="Scraped samples older than this are ignored."
    )
    prefix_tracking: bool = Field(
        default=True,
        description="Keep an approximate index of the prompt prefixes sent to each backend and give "
        "policies each backend's matched prefix (what it likely has cached); off: cache-blind routing.",
    )
    prefix_cache_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Prefix cache capacity of one backend in tokens, which bounds its index (SGLang's "
        "max_total_num_tokens); default: the profile mode's cache_tokens, else 1,000,000.",
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="specroute replicas in front of the same backends (all told the same number): each "
        "counts its own requests dispatched and finished since a backend's last scrape this many times, "
        "assuming the other replicas did alike (herding: they do not see each other's dispatches until "
        "the next scrape). 1: only this replica's own.",
    )
    spec_details: bool = Field(
        default=False,
        description="Ask eagle backends for per-request speculative stats (SGLang's "
        "return_spec_tokens_details) on the client's behalf, strip them from the answer, and feed the "
        "accept length to the policy; older SGLang versions may reject the field.",
    )

    engine: Literal["auto", "sglang", "vllm"] = Field(
        default="auto",
        description="The serving engine of the backends: sglang, vllm, or auto (detected from the "
        "sample names on each backend's /metrics). Decides the signals scraped, the health probe path "
        "and whether SGLang-only routes (/generate, /server_info) and spec_details apply.",
    )
    backend_engines: dict[str, Literal["auto", "sglang", "vllm"]] = Field(
        default_factory=dict,
        description="The engine per backend name, overriding `engine` for that backend "
        '(YAML mapping; JSON in the environment: {"b1": "vllm"}).',
    )

    backend_adaptive: dict[str, str | list[list[int]]] = Field(
        default_factory=dict,
        description="In-engine adaptive speculation per eagle backend name, overriding what the backend "
        "reports (SGLang's /server_info; vLLM's with VLLM_SERVER_DEV_MODE=1): `sglang` (SGLang's default "
        "--speculative-adaptive ladder), `MIN_BATCH:STEPS[/STEPS...],...` (e.g. 1:1/3/5/7,8:0/1/3,32:0/1,"
        "64:0), a vLLM num_speculative_tokens_per_batch_size list [[lo, hi, k], ...], a JSON file with "
        "SGLang's --speculative-adaptive-config or such a list, or `off`. The policies predict the eagle "
        "pool with that ladder's speed (YAML mapping; JSON in the environment: "
        '{"e1": "sglang"}).',
    )

    _split = field_validator("admin_policy_modules", mode="before")(_split_list)
    _specs = field_validator("baseline", "eagle", mode="before")(_backend_specs)

    @field_validator("shadow_policies", mode="before")
    @classmethod
    def _shadow_refs(cls, value: Any) -> Any:
        """Entries may be written `NAME` or `NAME:KEY=VALUE,...` (the grammar of every command)."""
        if isinstance(value, str):
            value = [value]
        return [_shadow_entry(v) for v in value] if isinstance(value, list) else value

    _blank = field_validator(
        "profile", "decision_log", "state_file", "admin_token", "baseline_model", "eagle_model",
        "baseline_api_key", "eagle_api_key", mode="before",
    )(_blank_is_unset)  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _default_policy(cls, data: Any) -> Any:
        if isinstance(data, dict) and not str(data.get("policy") or "").strip():
            return {**data, "policy": default_policy(data.get("profile"))}
        return data

    @field_serializer("baseline", "eagle")
    def _entries(self, specs: list[BackendSpec]) -> list[str]:
        return [b.entry for b in specs]

    @field_validator("health_check_path")
    @classmethod
    def _path(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError("must start with '/'")
        return path

    @model_validator(mode="after")
    def _backends(self) -> Settings:
        names: set[str] = set()
        urls: set[str] = set()
        for b in self.backends():
            if b.url in urls:
                raise ValueError(f"backend {b.url} is listed twice (each backend belongs to one pool)")
            if b.name in names:
                raise ValueError(f"backend name {b.name!r} is used twice: give each backend its own")
            names.add(b.name)
            urls.add(b.url)
        unknown = sorted(set(self.backend_engines) - names)
        if unknown:
            raise ValueError(f"backend_engines: no backend is named {', '.join(map(repr, unknown))}")
        _check_adaptive(self.backend_adaptive, {b.name for b in self.eagle})
        labels = [s.label or s.name for s in self.shadow_policies]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ValueError(
                f"shadow_policies: {', '.join(twice)} appear(s) more than once: give each a distinct `label`"
            )
        return self

    def backends(self, pool: Pool | None = None) -> list[BackendSpec]:
        """The configured backends (of one pool, or of both: baseline first)."""
        specs = {"baseline": self.baseline, "eagle": self.eagle}
        pools: tuple[Pool, ...] = POOLS if pool is None else (pool,)
        return [b for p in pools for b in specs[p]]

    def engine_of(self, name: str) -> Literal["auto", "sglang", "vllm"]:
        """The configured engine of the backend named `name` ("auto": detect it)."""
        return self.backend_engines.get(name, self.engine)

    def require_backends(self) -> None:
        if not self.baseline and not self.eagle:
            raise ConfigError("no backend configured: set baseline and/or eagle (--baseline/--eagle)")

    def masked(self) -> dict[str, Any]:
        """The resolved settings as plain data, secrets replaced by '**********'."""
        return self.model_dump(mode="json")


def _check_adaptive(entries: dict[str, str | list[list[int]]], eagle: set[str]) -> None:
    """Every `backend_adaptive` entry names an eagle backend and gives a usable ladder."""
    for name, spec in entries.items():
        if name not in eagle:
            raise ValueError(f"backend_adaptive: {name!r} is not the name of an eagle backend")
        try:
            parse_ladder(spec)
        except LadderError as e:
            raise ValueError(f"backend_adaptive[{name!r}]: {e}") from None


FIELDS = frozenset(Settings.model_fields)
_JSON_FIELDS = frozenset({"policy_params", "shadow_policies", "backend_engines", "backend_adaptive"})


def read_text(path: str | Path) -> str:
    """A config file's text (ConfigError when it cannot be read)."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
        raise ConfigError(f"config file {path}: cannot read: {why}") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error without the snippet of the offending line it quotes (the line may hold a
    secret): the problem, its line and column, and the context it was found in."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return type(e).__name__
    parts = []
    if e.problem_mark is not None:
        parts.append(f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}:")
    parts.append(e.problem or "syntax error")
    if e.context:
        where = f" at line {e.context_mark.line + 1}" if e.context_mark is not None else ""
        parts.append(f"({e.context}{where})")
    return " ".join(parts)


def parse_yaml(text: str, path: str | Path) -> dict[str, Any]:
    """The settings of a config file's text (`path` names it in errors)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not valid YAML: {_yaml_problem(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings at the top level")
    unknown = sorted(str(k)[:64] for k in data if k not in FIELDS)
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(unknown)}")
    return {str(k): v for k, v in data.items()}


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """`SPECROUTE_<FIELD>` variables (unknown SPECROUTE_ names are ignored)."""
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in FIELDS:
            continue
        if name in _JSON_FIELDS:
            try:
                out[name] = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{name} (from environment {key}): not valid JSON: {e}") from None
        else:
            out[name] = value
    return out


def _describe_source(source: str, key: str) -> str:
    if source == "environment":
        return f"environment {ENV_PREFIX}{key.upper()}"
    if source == "command line":
        return "flag --policy-param" if key == "policy_params" else f"flag --{key.replace('_', '-')}"
    return source


def load_settings(
    cli: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
    *,
    config_text: str | None = None,
) -> Settings:
    """Merge the sources (CLI > env > file > defaults) and validate once.

    `cli` holds only the flags the user actually gave (None values are ignored). `config_text`:
    the file's text when the caller read it already (a reload reads it until it is stable); it is
    then named `config_file` in errors. No `ConfigError` raised here holds a secret value found in
    these sources (see `controller.proxy.redact`), even one from a file that does not parse.
    """
    env = os.environ if environ is None else environ
    redact = Redactor(secrets_in_env(env) | secrets_in_values(cli or {}))
    try:
        if config_file is not None and config_text is None:
            config_text = read_text(config_file)
        if config_text is not None:
            redact.add(secrets_in_yaml(config_text))
        return _load(cli, env, config_file, config_text, redact)
    except ConfigError as e:
        raise ConfigError(redact(str(e))) from None


def _load(
    cli: Mapping[str, Any] | None,
    environ: Mapping[str, str],
    config_file: str | Path | None,
    config_text: str | None,
    redact: Redactor,
) -> Settings:
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_text is not None:
        source = f"config file {config_file if config_file is not None else '(text)'}"
        data = parse_yaml(config_text, config_file if config_file is not None else "(text)")
        redact.add(secrets_in_values(data))
        layers.append((source, data))
    layers.append(("environment", read_env(environ)))
    layers.append(("command line", {k: v for k, v in (cli or {}).items() if v is not None}))
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    params: dict[str, Any] = {}
    for source, layer in layers:
        current = merged.get("policy") or default_policy(merged.get("profile"))
        if "policy" in layer and layer["policy"] != current:
            params = {}  # params written for another policy must not leak into this one
        for key, value in layer.items():
            if key == "policy_params":
                if not isinstance(value, dict):
                    raise ConfigError(f"policy_params (from {source}): expected a mapping")
                params.update(value)
            else:
                merged[key] = value
            origin[key] = _describe_source(source, key)
    if params or "policy_params" in origin:
        merged["policy_params"] = params
    try:
        return Settings.model_validate(merged)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = err["loc"]
            key = str(loc[0]) if loc else ""
            where = f" (from {origin[key]})" if key in origin else ""
            path = ".".join(str(x) for x in loc) or "settings"
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{path}{where}: {msg}")
        raise ConfigError("invalid setting: " + "; ".join(problems)) from None
