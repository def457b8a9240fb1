"""The live side: everything that talks to real servers.

- `controller.proxy`: the routing proxy (`specroute serve`): app, forwarding, load tracking,
  scraping, health, metrics, admin, shadow policies, decision log, settings.
- `controller.bench`: the benchmark client (`specroute bench`, `compare`), its results and
  prompt sets, and the import of SGLang's own benchmark results.
- `controller.cli`: the `specroute` command line, one module per command, loaded lazily.

Nothing here imports the simulator except the `demo`, `emulate`, `simulate`, `tune` and `plan`
command modules, and only when that command runs.

`specroute_version()`: the installed distribution's version (`specroute --version`, and what
`bench` writes into its results).
"""

from importlib.metadata import PackageNotFoundError, version


def specroute_version() -> str:
    try:
        return version("specroute")
    except PackageNotFoundError:
        return "unknown"
