"""A compiled build of the simulator's hot path, used by `specroute simulate` when one is present.

How it works. The modules in `MODULES` (the values, the view builder, the routing core,
calibration and cost_model's decision code; the engine's event queue, servers, co-located
servers, routers and dispatch) are ordinary typed Python, and the Python is the source of truth.
`build()` compiles them with mypyc (it ships with mypy: `pip install 'specroute[native]'`) into
a directory OUTSIDE the source tree, named by a digest of every module of `policies/` and
`simulator/engine/` (what the compiled code can see), the Python version and mypyc's version.
`activate()`, called by the command line before `simulate` imports anything of the simulator,
puts that directory first on `policies.__path__` and `simulator.engine.__path__`, only when its
digest is that of the sources on disk: an edited source is never shadowed by an old build (its
digest changes, the pure Python runs until `specroute native build` is run again), and a
half-written build is never used (it is renamed into place with its manifest, whole). Nothing
else loads it: `serve` and every other command run the pure Python, and so do the tests (their
conftest points `SPECROUTE_NATIVE_DIR` at an empty directory), except the ones that compare the
two (`tests/simulator/test_native.py`: the reference runs, bit for bit).

Same code, same numbers: compiled and pure runs give the same output to the bit (floats are the
same IEEE doubles and `math` the same libm; the one identity test the engine had, a heap entry
compared with `is`, compares values now). `SPECROUTE_NATIVE=0` turns the build off for a run;
`SPECROUTE_NATIVE_DIR` says where builds live (default `~/.cache/specroute/native`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import policies

MODULES: tuple[str, ...] = (
    "policies.values",
    "policies.view",
    "policies.routing",
    "policies.calibration",
    "policies.cost_model",
    "simulator.engine.events",
    "simulator.engine.server",
    "simulator.engine.colocation",
    "simulator.engine.replica_views",
    "simulator.engine.dispatch",
    "simulator.engine.clients",
    "simulator.engine.loop",
)
"""Compiled, in this order of dependence. Pydantic models and `runtime_checkable` protocols do
not compile: they live in modules of their own (`policies.cost_model_params`, `policies.base`)."""
PACKAGES = ("policies", "simulator.engine")
"""The packages whose `__path__` an active build leads (every module of MODULES is in one)."""
FORMAT = 1
"""Bumped when the layout of a build changes: older builds are then ignored."""
OFF_VALUES = ("0", "off", "no", "false")


class NativeError(Exception):
    """A build cannot be made here (no mypyc, no C compiler) or failed; the message says why."""


@dataclass(frozen=True)
class Status:
    active: bool
    reason: str
    """Why it is (not) active, in words for the user."""
    directory: Path | None = None


_status: Status | None = None


def source_root() -> Path:
    """The directory holding the `policies` and `simulator` packages being run."""
    return Path(policies.__file__).resolve().parent.parent


def builds_dir() -> Path:
    configured = os.environ.get("SPECROUTE_NATIVE_DIR")
    if configured:
        return Path(configured).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "specroute" / "native"


def _mypy_version() -> str:
    try:
        return importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def digest(root: Path | None = None) -> str:
    """Of every source the compiled modules can see, the interpreter and the compiler."""
    root = root or source_root()
    h = hashlib.sha256()
    h.update(f"{FORMAT} {sys.version} {sys.platform} {platform.machine()} mypy {_mypy_version()}\n".encode())
    for package in PACKAGES:
        folder = root.joinpath(*package.split("."))
        for path in sorted(folder.glob("*.py")):
            h.update(f"{package}/{path.name}\n".encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:24]


def _complete(directory: Path, want: str) -> bool:
    try:
        manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict):
        return False
    return manifest.get("digest") == want and manifest.get("modules") == list(MODULES)


def find(root: Path | None = None) -> Path | None:
    """The build for the sources on disk, if there is one."""
    want = digest(root)
    directory = builds_dir() / want
    return directory if _complete(directory, want) else None


_BUILD_SCRIPT = """
import json, sys
from mypyc.build import mypycify
from setuptools import setup
a = json.loads(sys.argv[1])
setup(
    name="specroute-native",
    ext_modules=mypycify(a["paths"] + ["--cache-dir", a["cache"]], target_dir=a["target"], opt_level="3"),
    script_args=["build_ext", "--build-lib", a["lib"], "--build-temp", a["temp"]],
)
"""


def build(*, force: bool = False, log: bool = True) -> Path:
    """Compile MODULES for the sources on disk (a minute or two on a small machine); returns the
    build's directory. Raises NativeError with the reason when it cannot."""
    root = source_root()
    want = digest(root)
    dest = builds_dir() / want
    if not force and _complete(dest, want):
        return dest
    if importlib.util.find_spec("mypyc") is None:
        raise NativeError("mypyc is not installed (it comes with mypy): pip install 'specroute[native]'")
    if importlib.util.find_spec("setuptools") is None:
        raise NativeError("setuptools is not installed: pip install 'specroute[native]'")
    compiler = os.environ.get("CC", "cc").split()[0]
    if shutil.which(compiler) is None and shutil.which("gcc") is None:
        raise NativeError(
            f"no C compiler found ({compiler!r} or gcc on PATH): install one "
            "(Debian: apt-get install gcc python3-dev)"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    paths = [str(root.joinpath(*m.split(".")).with_suffix(".py")) for m in MODULES]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="specroute-native-") as tmp:
        work = Path(tmp)
        lib = Path(tempfile.mkdtemp(prefix=f".{want}.", dir=dest.parent))
        try:
            args = {"paths": paths, "cache": str(work / "mypy-cache"), "target": str(work / "c"),
                    "lib": str(lib), "temp": str(work / "obj")}  # fmt: skip
            if log:
                print(f"compiling {len(MODULES)} modules with mypyc into {dest}: a minute or two", flush=True)
            done = subprocess.run(
                [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(args)],
                cwd=work,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
                raise NativeError(f"mypyc failed (exit {done.returncode}):\n{tail}")
            missing = [m for m in MODULES if not _built_file(lib, m)]
            if missing:
                raise NativeError(f"mypyc built no extension for {', '.join(missing)}")
            manifest = {"digest": want, "modules": list(MODULES), "python": sys.version,
                        "mypy": _mypy_version(), "source": str(root),
                        "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
            (lib / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(lib, dest)
        finally:
            if lib.exists():
                shutil.rmtree(lib, ignore_errors=True)
    if log:
        took = time.monotonic() - started
        print(f"built in {took:.0f} s: `specroute simulate` uses it from now on", flush=True)
    return dest


def _built_file(directory: Path, module: str) -> Path | None:
    *package, name = module.split(".")
    found = sorted(directory.joinpath(*package).glob(f"{name}.*.so")) + sorted(
        directory.joinpath(*package).glob(f"{name}.*.pyd")
    )
    return found[0] if found else None


def activate() -> Status:
    """Load the build for the sources on disk, if there is one and nothing of MODULES is loaded
    yet (a process runs all compiled or all pure: the compiled modules check the types of the
    values they are given). Idempotent; `status()` tells what happened."""
    global _status
    if _status is not None:
        return _status
    _status = _activate()
    return _status


def _lookup() -> Status:
    """The build for the sources on disk, not loaded: inactive, with its directory when there is
    one (`status` and `_activate` both start here)."""
    if os.environ.get("SPECROUTE_NATIVE", "").strip().lower() in OFF_VALUES:
        return Status(False, "turned off (SPECROUTE_NATIVE=0)")
    try:
        directory = find()
    except OSError as e:
        return Status(False, f"cannot read the sources or builds ({e})")
    if directory is None:
        return Status(False, "no build for these sources: `specroute native build` compiles one")
    return Status(False, "built for these sources (`specroute simulate` loads it)", directory)


def _activate() -> Status:
    found = _lookup()
    directory = found.directory
    if directory is None:
        return found
    loaded = [m for m in MODULES if m in sys.modules]
    if loaded:
        return Status(False, f"{', '.join(loaded)} already loaded as pure Python", directory)
    entries = [(importlib.import_module(p), str(directory.joinpath(*p.split(".")))) for p in PACKAGES]
    before = set(sys.modules)
    sys.path.append(str(directory))  # the build's shared library, a top-level module
    for package, path in entries:
        package.__path__.insert(0, path)
    try:
        for m in MODULES:
            origin = getattr(importlib.import_module(m), "__file__", "") or ""
            if not origin.startswith(str(directory)):
                raise ImportError(f"{m} loaded from {origin}")
    except Exception as e:  # a broken build: back to the pure Python, saying why
        for package, path in entries:
            package.__path__.remove(path)
        sys.path.remove(str(directory))
        # every module imported meanwhile goes, not only MODULES: a pure module that imported
        # a compiled one (policies.base re-exports policies.values) would keep its classes
        for name in set(sys.modules) - before:
            del sys.modules[name]
        why = f"the build in {directory} does not load ({e}): `specroute native build --force`"
        return Status(False, why, directory)
    return Status(True, f"compiled build {directory.name}", directory)


def describe() -> str:
    """`; simulator: compiled build DIGEST` for a command's header line when this process runs
    the build, else nothing (the pure Python is the default and needs no word)."""
    loaded = _status
    return f"; simulator: {loaded.reason}" if loaded is not None and loaded.active else ""


def status() -> Status:
    """What `activate()` did in this process, or what it would find (without loading it)."""
    return _status if _status is not None else _lookup()
