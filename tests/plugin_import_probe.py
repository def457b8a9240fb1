"""A policy module that only the admin allow-list test imports: whether it is in `sys.modules`
shows whether specroute imported it."""

from __future__ import annotations

from plugin_policy_example import AlternatingPolicy


class ProbePolicy(AlternatingPolicy):
    """AlternatingPolicy under another module name."""

    name = "probe"
