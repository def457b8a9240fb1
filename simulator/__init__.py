"""Offline: backend speed model, workloads and traces, event engine, tuner, reports, emulator."""
