"""The decision, and the pure code both sides share. Pure Python + numpy: no asyncio, no
sockets, no clock reads; imports nothing from `controller` or `simulator`.

- `base`: the types a policy sees and returns (a leaf module), and the `Policy` protocol.
- `routing`: the routing core (backend choice within a pool, fallback between pools).
- `spec`, `registry`, `params`: how a policy is named, parametrised (one KEY=VALUE grammar)
  and built.
- `fixed`, `threshold`, `cost_model`, `online`: the built-in policies.
- `profile`: speed profiles (`specroute.profile/v1`) and the queries on them.
- `stats`, `jsonl`: the statistics and the JSON-lines reader the bench, the demo and the
  planner share.
"""
