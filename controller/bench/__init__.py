"""`specroute bench`: the closed-loop benchmark client, its results and statistics, `compare`,
the built-in prompt sets, and the import of SGLang benchmark results into profiles."""
