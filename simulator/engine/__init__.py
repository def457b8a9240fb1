"""The discrete-event engine: simulated servers, workloads and traces, the event loop, results
and reports. Pure and deterministic: same inputs and seed, same output."""
