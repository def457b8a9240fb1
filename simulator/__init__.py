"""The offline side.

- `simulator.engine`: the discrete-event engine, simulated servers, workloads, traces, results
  and reports (`specroute simulate`).
- `simulator.emulator`: an HTTP emulator of an SGLang server (live, for the demo and tests).
- `simulator.planning`: the tuner (`specroute tune`) and the deployment planner (`plan`).

Imports `policies`, never the controller.
"""
