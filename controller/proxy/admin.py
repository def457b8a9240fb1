"""Hot reload of the routing policy: `POST /admin/policy` and SIGHUP.

The swap is one attribute assignment on the `Forwarder`: a request captures the policy object
before it calls `choose` and calls `observe` on that same object, so in-flight requests finish
under the policy that chose them while new requests use the new one. The admin endpoint needs
`Authorization: Bearer <admin_token>` (compared in constant time) and answers 404 when no token
is configured, exactly like an unknown route. Its body is read within the same limits as a
completion's. A policy named `module.path:ClassName` is imported only from a module listed in
`admin_policy_modules` (or inside a listed package): an admin request must not import arbitrary
installed code. Built-in and entry-point policies are always allowed, and SIGHUP reads the
policy from the config file, which is trusted like the command line.

A reload that names the running policy again -- same name, same parameters once resolved, same
profile and seed (`controller.proxy.learned_state.PolicyIdentity`) -- keeps the running policy
object, and so what it learned (calibration, content model); any other reload starts the new
policy with nothing learned and logs so. Both are counted in
`specroute_policy_reloads_total{source, learned}` (`source`: sighup or admin; `learned`: kept
or reset). `GET /admin/policy` shows, besides the policy, a summary of what it learned.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from controller.proxy.config import Settings
from controller.proxy.errors import BadRequest, NotFound, Unauthorized
from controller.proxy.forward import Forwarder
from controller.proxy.learned_state import PolicyIdentity, policy_identity
from controller.proxy.limits import load_json
from policies.base import Policy
from policies.learned import learner, unpack
from policies.params import parse_policy_ref
from policies.profile import ProfileError, resolve_profile
from policies.registry import PolicyRegistry
from policies.spec import PolicyContext, PolicyError

log = logging.getLogger("specroute.admin")
_RELOADABLE = frozenset({"policy", "policy_params", "profile", "seed"})


class PolicyAdmin:
    def __init__(
        self,
        fwd: Forwarder,
        registry: PolicyRegistry,
        context: PolicyContext,
        adapt: Callable[[PolicyContext], PolicyContext] = lambda context: context,
    ) -> None:
        self.fwd = fwd
        self.registry = registry
        self.context = context
        self.adapt = adapt
        """What a policy is built from, given the settings' context (`controller.proxy.adaptive`:
        the eagle pool's in-engine ladder)."""
        self.name = fwd.settings.policy
        self.params: dict[str, Any] = dict(fwd.settings.policy_params)
        self.reloads = Counter(
            "specroute_policy_reloads",
            "Policy reloads by source (sighup, admin) and whether the policy kept what it had learned "
            "(kept: the same policy and parameters) or started fresh (reset).",
            ["source", "learned"],
            registry=fwd.metrics.registry,
        )
        for source in ("sighup", "admin"):
            for learned in ("kept", "reset"):
                self.reloads.labels(source, learned)

    def running(self) -> Policy:
        return self.fwd.policy

    def identity(self) -> PolicyIdentity:
        """The running policy's identity (as configured: name, resolved parameters, profile, seed)."""
        return policy_identity(self.registry, self.name, self.params, self.context)

    def swap(
        self,
        name: str,
        params: dict[str, Any],
        context: PolicyContext | None = None,
        *,
        source: str = "admin",
    ) -> Policy:
        """Build the new policy (raises PolicyError) and swap it in atomically -- unless it is the
        running policy again, which then stays, with what it learned."""
        ctx = context or self.context
        new = policy_identity(self.registry, name, params, ctx)
        try:
            same = new == self.identity()
        except PolicyError:  # the running policy's settings no longer resolve (a plugin gone)
            same = False
        shown = f"{name} {json.dumps(params, default=str)}"
        if same:
            self.name, self.params, self.context = name, dict(params), ctx
            self.reloads.labels(source, "kept").inc()
            log.warning("routing policy %s unchanged: it keeps what it has learned", shown)
            return self.fwd.policy
        policy = self.registry.create(name, params, self.adapt(ctx))
        old = self.fwd.policy
        self.fwd.policy = policy
        self.name, self.params, self.context = name, dict(params), ctx
        self.reloads.labels(source, "reset").inc()
        dropped = f"; what {old.name} had learned is dropped" if learner(old) is not None else ""
        log.warning("routing policy is now %s: it starts with nothing learned%s", shown, dropped)
        return policy

    def fresh(self) -> None:
        """Replace the running policy by a newly built one with the same settings (nothing
        learned): what the adaptation of the eagle pool changed is built in."""
        self.fwd.policy = self.registry.create(self.name, self.params, self.adapt(self.context))

    def reload(self, settings: Settings) -> None:
        """Swap to the policy of freshly read settings (SIGHUP). Raises PolicyError/ProfileError."""
        profile = resolve_profile(settings.profile) if settings.profile else None
        before, after = self.fwd.settings.masked(), settings.masked()
        ignored = sorted(k for k in after if k not in _RELOADABLE and after[k] != before.get(k))
        if ignored:
            log.warning("reload applies only policy, policy_params, profile, seed; restart for: %s", ignored)
        context = PolicyContext(profile, settings.seed)
        self.swap(settings.policy, dict(settings.policy_params), context, source="sighup")

    def authorize(self, request: web.Request) -> None:
        token = self.fwd.settings.admin_token
        if token is None:
            raise NotFound(f"unknown route {request.method} {request.path}")
        given = request.headers.get("Authorization", "")
        expected = "Bearer " + token.get_secret_value()
        # surrogateescape: a header with invalid UTF-8 is a wrong token, not an encoding error
        if not hmac.compare_digest(given.encode(errors="surrogateescape"), expected.encode()):
            raise Unauthorized("missing or wrong admin token")

    def check_allowed(self, name: str) -> None:
        """BadRequest unless `name` is registered or its module is in `admin_policy_modules`."""
        if ":" not in name or name in self.registry.names():
            return
        module = name.partition(":")[0]
        allowed = self.fwd.settings.admin_policy_modules
        if not any(module == m or module.startswith(m + ".") for m in allowed):
            raise BadRequest(
                f"policy {name[:200]!r}: module {module[:120]!r} is not in admin_policy_modules; the admin "
                f"endpoint loads only built-in and entry-point policies and classes of listed modules"
            )

    def current(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": self.params,
            "policy": self.fwd.policy.name,
            "learned": learned_summary(self.fwd.policy),
        }


def learned_summary(policy: Policy) -> dict[str, Any] | None:
    """A short account of what `policy` learned (None: it keeps no learned state): for
    `cost_model`, per pool its calibrated speed scale and the untagged outcomes behind it, the
    hints tracked, the content model's outcomes and families. Parts whose layout it does not
    know are left out."""
    target = learner(policy)
    if target is None:
        return None
    state = target.state()
    out: dict[str, Any] = {}
    cal, content = state.get("calibration"), state.get("content")
    with contextlib.suppress(KeyError, TypeError, ValueError, AttributeError):
        pools = {
            pool: {"outcomes": int(n), "speed_scale": round(math.exp(value), 6)}
            for pool, (n, value) in cal["pool"].items()  # type: ignore[index]
        }
        out["calibration"] = {**pools, "hints": [row[0] for row in cal["hints"]["slots"]]}  # type: ignore[index]
    with contextlib.suppress(KeyError, TypeError, ValueError, AttributeError):
        families = len(unpack(content["family_keys"], "<u8", "content model"))  # type: ignore[index]
        out["content"] = {"outcomes": int(content["taught"]), "families": families}  # type: ignore[index]
    return out


def admin_routes(admin: PolicyAdmin) -> list[web.RouteDef]:
    async def get_policy(request: web.Request) -> web.Response:
        admin.authorize(request)
        return web.json_response(admin.current())

    async def post_policy(request: web.Request) -> web.Response:
        admin.authorize(request)
        body = load_json(await admin.fwd.read_body(request))
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise BadRequest('expected {"name": "<policy>", "params": {...}}')
        params = body.get("params") or {}
        if not isinstance(params, dict):
            raise BadRequest("'params' must be an object")
        try:
            # `name` may carry inline parameters, as on the command line: "threshold:threshold=16"
            name, inline = parse_policy_ref(body["name"], "name")
            admin.check_allowed(name)
            admin.swap(name, {**(inline or {}), **params})
        except (PolicyError, ProfileError) as e:
            raise BadRequest(str(e)) from None
        return web.json_response(admin.current())

    return [web.get("/admin/policy", get_policy), web.post("/admin/policy", post_policy)]
