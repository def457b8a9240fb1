"""Offline planning on top of the engine: the parameter tuner and the deployment planner."""
