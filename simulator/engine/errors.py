"""The engine's error (a module of its own: the modules `simulator.native` compiles cannot
define a subclass of a built-in exception other than `Exception`)."""


class SimulationError(RuntimeError):
    """The simulation cannot proceed (e.g. a policy picked a backend that does not exist)."""
