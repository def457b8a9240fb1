"""The compiled simulator (`specroute native build`, simulator/native.py): built with mypyc into
a builds directory of the test's own, loaded by `specroute simulate`, with the same output as the
pure Python to the bit; never loaded for other sources than its own; a machine without a C
compiler gets a clear error, a broken build a note and the pure Python."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_command, run_specroute

from simulator import native

TRACES = Path("/work/shared/data/traces")

RUNS = {
    "poisson cost_model": [
        "--workload", "poisson", "--rate", "4", "--requests", "4000", "--policy", "cost_model",
    ],
    "sweep, three policies, oracle": [
        "--workload", "sweep", "--concurrency", "1", "8", "40", "--requests-per-level", "60",
        "--policy", "threshold", "--policy", "cost_model", "--policy", "online", "--oracle",
    ],
    "multiturn, cache, two routers": [
        "--workload", "multiturn", "--rate", "2", "--requests", "600", "--deployment", "baseline=2,eagle=1",
        "--cache-tokens", "200000", "--routers", "2", "--scrape-interval", "0.5", "--policy", "cost_model",
    ],
    "bursty, hints, spec details, mis-profiled servers": [
        "--workload", "bursty", "--rate", "6", "--requests", "2000", "--hint-mix", "code=1,prose=1",
        "--hint-accept", "code=1.3,prose=0.8", "--accept-sigma", "0.2", "--spec-details",
        "--server-speed", "eagle=0.8", "--policy", "cost_model",
    ],
}  # fmt: skip


def _env(builds: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SPECROUTE_NATIVE"}
    return {**env, "SPECROUTE_NATIVE_DIR": str(builds), **extra}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build of this tree's sources, made once for the module (about half a minute)."""
    import asyncio

    where = tmp_path_factory.mktemp("native-builds")
    rc, out, err = asyncio.run(run_specroute("native", "build", env=_env(where), timeout_s=900))
    assert rc == 0, f"native build failed:\n{out}\n{err}"
    assert "built in" in out
    return where


async def test_status_names_the_build_for_these_sources(builds: Path) -> None:
    rc, out, _ = await run_specroute("native", "status", env=_env(builds))
    assert rc == 0, out
    assert "built for these sources" in out
    assert str(builds / native.digest()) in out
    # a second build finds the first instead of compiling again
    rc, out, err = await run_specroute("native", "build", env=_env(builds))
    assert rc == 0, err
    assert "compiling" not in out


@pytest.mark.parametrize("name", list(RUNS))
async def test_compiled_simulate_gives_the_pure_output_to_the_bit(builds: Path, name: str) -> None:
    args = ["simulate", "--profile", "kimi-k25-int4-8gpu", *RUNS[name], "--seed", "3"]
    rc, pure, err = await run_specroute(*args, "--json", env=_env(builds, SPECROUTE_NATIVE="0"))
    assert rc == 0, err
    rc, compiled, err = await run_specroute(*args, "--json", env=_env(builds))
    assert rc == 0, err
    assert compiled == pure
    # what ran is said in the table's header line (and only when it is the build)
    rc, table, _ = await run_specroute(*args, env=_env(builds))
    assert rc == 0
    assert f"simulator: compiled build {native.digest()}" in table.splitlines()[0]
    rc, table, _ = await run_specroute(*args, env=_env(builds, SPECROUTE_NATIVE="0"))
    assert rc == 0
    assert "simulator: compiled" not in table


async def test_compiled_values_refuse_assignment_too(builds: Path) -> None:
    """The build's `BackendLoad` and `Decision` refuse an assignment and a deletion as the pure
    ones do (tests/policies/test_values.py); the compiled view builder and routing core build
    them; copy, pickle and replace still work."""
    probe = """
import copy, dataclasses, pickle
from simulator import native
status = native.activate()
assert status.active, status.reason
import policies.values
from policies.base import BackendLoad, Decision
from policies.routing import Router
from policies.view import backend_load, load_view
assert policies.values.__file__.endswith(".so"), policies.values.__file__
b = backend_load("e0", "eagle", 3, 600, now=2.0, running=2, queued=4, sample_time=1.5)
d = Decision("eagle", "e0", "faster_eagle", {"eagle": 0.2}, {"eagle": 3.0}, 6, "p", 1.2)
refused = 0
for value in (b, d):
    for f in dataclasses.fields(value):
        for change in (lambda: setattr(value, f.name, None), lambda: delattr(value, f.name)):
            try:
                change()
            except dataclasses.FrozenInstanceError as e:
                assert "cannot be assigned or deleted" in str(e), e
                refused += 1
    assert copy.copy(value) == value == pickle.loads(pickle.dumps(value))
assert (b.load, b.sample_age_s) == (6, 0.5)
assert dataclasses.replace(b, running=9).load == 13
asked = Decision("eagle", "", "faster_eagle")
class PoolOnly:
    name = "pool_only"
    def choose(self, request, view, now):
        return asked
    def observe(self, outcome):
        pass
decided = Router(0).decide(PoolOnly(), policies.values.RequestInfo(), load_view([b]), 2.0)
assert (decided.backend, decided.backend_load) == ("e0", 6)
assert (asked.backend, asked.backend_load) == ("", 0)
print(refused)
"""
    rc, out, err = await run_command(sys.executable, "-c", probe, env=_env(builds))
    assert rc == 0, err
    assert out.split() == [str(2 * (14 + 8))]  # every field of both, set and delete


async def test_a_trace_matches_too(builds: Path) -> None:
    trace = TRACES / "AzureLLMInferenceTrace_code.csv"
    if not trace.exists():
        pytest.skip(f"{trace} is not on this machine")
    args = ["simulate", "--profile", "llama31-8b-h100-eagle3", "--workload", "trace",
            "--trace", str(trace), "--requests", "3000", "--time-scale", "0.5",
            "--policy", "cost_model", "--policy", "threshold", "--json"]  # fmt: skip
    rc, pure, err = await run_specroute(*args, env=_env(builds, SPECROUTE_NATIVE="0"))
    assert rc == 0, err
    rc, compiled, err = await run_specroute(*args, env=_env(builds))
    assert rc == 0, err
    assert compiled == pure


async def test_co_located_servers_match_too(builds: Path, tmp_path: Path) -> None:
    """A profile with together points runs `ColocatedServer`, a subclass of the compiled
    `Server`: it must be compiled with it (an interpreted subclass of a compiled class fails)."""
    points = [{"concurrency": c, "decode_tok_s": 100.0 / c**0.5, "ttft_s": 0.05} for c in (1, 4, 16)]
    slowed = [{**p, "decode_tok_s": p["decode_tok_s"] * 0.6} for p in points]
    mode = {"max_running_requests": 16, "points": points, "together": {"points": slowed}}
    profile = {"format": "specroute.profile/v1", "name": "pair",
               "modes": {"baseline": mode, "eagle": {**mode, "accept_length": 2.0}}}  # fmt: skip
    path = tmp_path / "pair.json"
    path.write_text(json.dumps(profile), encoding="utf-8")
    args = ["simulate", "--profile", str(path), "--workload", "poisson", "--rate", "1.5",
            "--requests", "1500", "--policy", "cost_model", "--seed", "5"]  # fmt: skip
    rc, table, err = await run_specroute(*args, env=_env(builds))
    assert rc == 0, err
    assert "co-located pairs" in table and "simulator: compiled build" in table
    rc, pure, err = await run_specroute(*args, "--json", env=_env(builds, SPECROUTE_NATIVE="0"))
    assert rc == 0, err
    rc, compiled, err = await run_specroute(*args, "--json", env=_env(builds))
    assert rc == 0, err
    assert compiled == pure


def _copy_tree(to: Path) -> Path:
    for package in ("controller", "policies", "simulator"):
        shutil.copytree(ROOT / package, to / package, ignore=shutil.ignore_patterns("__pycache__"))
    return to


async def test_edited_sources_never_load_an_old_build(builds: Path, tmp_path: Path) -> None:
    same = _copy_tree(tmp_path / "same")
    rc, out, _ = await run_specroute("native", "status", env=_env(builds, PYTHONPATH=str(same)), cwd=same)
    assert rc == 0 and "built for these sources" in out, out  # the digest is of the contents
    edited = _copy_tree(tmp_path / "edited")
    source = edited / "policies" / "cost_model.py"
    source.write_text(source.read_text() + "\n# edited\n")
    env = _env(builds, PYTHONPATH=str(edited))
    rc, out, _ = await run_specroute("native", "status", env=env, cwd=edited)
    assert rc == 1
    assert "no build for these sources" in out
    rc, out, err = await run_specroute(
        "simulate", "--profile", "kimi-k25-int4-8gpu", *RUNS["poisson cost_model"], env=env, cwd=edited
    )
    assert rc == 0, err
    assert "simulator: compiled" not in out


async def test_a_broken_build_is_noted_and_the_pure_python_runs(builds: Path, tmp_path: Path) -> None:
    broken = tmp_path / "builds"
    shutil.copytree(builds, broken)
    (extension,) = (broken / native.digest() / "policies").glob("cost_model.*.so")
    extension.write_bytes(b"not an ELF file")
    args = ["simulate", "--profile", "kimi-k25-int4-8gpu", *RUNS["poisson cost_model"]]
    rc, out, err = await run_specroute(*args, env=_env(broken))
    assert rc == 0, err
    assert "simulator: compiled" not in out
    assert "does not load" in err and "running the pure Python" in err
    rc, want, _ = await run_specroute(*args, env=_env(builds, SPECROUTE_NATIVE="0"))
    assert out == want
    # nothing of the half-loaded build stays: the pure modules see the pure values
    probe = (
        "from simulator import native; s = native.activate(); "
        "import policies.base, policies.values, policies.view; "
        "print(s.active, policies.base.BackendLoad is policies.values.BackendLoad, "
        "policies.values.__file__.endswith('.py'), policies.view.__file__.endswith('.py'))"
    )
    rc, out, err = await run_command(sys.executable, "-c", probe, env=_env(broken))
    assert rc == 0, err
    assert out.split() == ["False", "True", "True", "True"]


async def test_no_compiler_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    env = _env(tmp_path / "builds", PATH=str(empty), CC="no-such-compiler")
    rc, out, err = await run_command(sys.executable, "-m", "controller.cli", "native", "build", env=env)
    assert rc == 2, out + err
    assert "no C compiler found" in err
    assert "Traceback" not in err
    assert not (tmp_path / "builds").exists() or not any((tmp_path / "builds").iterdir())


def test_a_process_that_loaded_the_pure_modules_stays_pure(
    builds: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process runs all compiled or all pure (compiled code checks the types it is given)."""
    import policies.values

    monkeypatch.setenv("SPECROUTE_NATIVE_DIR", str(builds))
    status = native._activate()
    assert not status.active
    assert "already loaded as pure Python" in status.reason
    assert policies.values.__file__.endswith(".py")


async def test_plan_in_worker_processes_matches_too(builds: Path, tmp_path: Path) -> None:
    """`plan` (and `tune`) run their points in worker processes, which inherit the build."""
    args = ["plan", "--profile", "kimi-k25-int4-8gpu", "--servers", "2", "--workload", "poisson",
            "--rate", "3", "--requests", "1500", "--jobs", "2"]  # fmt: skip
    outs = []
    for native_setting in ("0", "1"):
        out_file = tmp_path / f"plan-{native_setting}.yaml"
        env = _env(builds, SPECROUTE_NATIVE=native_setting)
        rc, out, err = await run_specroute(*args, "--out", str(out_file), env=env, timeout_s=300)
        assert rc == 0, err
        outs.append((out.replace(str(out_file), "OUT"), out_file.read_text().replace(str(out_file), "OUT")))
    compiled = f"; simulator: compiled build {native.digest()}"
    assert compiled not in outs[0][0]
    assert compiled in outs[1][0].splitlines()[0]
    assert outs[0] == (outs[1][0].replace(compiled, "", 1), outs[1][1])
    assert "best:" in outs[0][0]
