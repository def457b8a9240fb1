"""The decision, and the pure code both sides share. Pure Python + numpy: no asyncio, no
sockets, no clock reads; imports nothing from `controller` or `simulator`.

- `base`: the types a policy sees and returns (a leaf module), and the `Policy` protocol.
- `routing`: the routing core (client override, backend choice within a pool, fallback between
  pools, failover target, which outcomes teach, segment reset), called by the proxy and the
  simulator alike.
- `view`: the view builder (per-backend facts -> `LoadView`: staleness, load, admission, prefix
  belief), called by the proxy's `LoadTracker` and every simulated router.
- `spec`, `registry`, `params`: how a policy is named, parametrised (one KEY=VALUE grammar)
  and built.
- `fixed`, `threshold`, `cost_model`, `online`: the built-in policies; `calibration`: the
  bounded, converging estimates the learning ones keep (profile calibration, hint slots).
- `profile`: speed profiles (`specroute.profile/v1`) and the queries on them.
- `stats`, `jsonl`: the statistics and the JSON-lines reader the bench, the demo and the
  planner share.
"""
