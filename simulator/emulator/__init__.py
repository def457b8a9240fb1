"""An emulated SGLang server whose speed follows a profile: config, batching engine, runtime
state, HTTP routes, metrics; `simulator.emulator.app.run_emulator` runs one."""
