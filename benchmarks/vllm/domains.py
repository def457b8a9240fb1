"""Two domains of text, code and prose, generated from a seed: the trained tiny target's corpus,
the EAGLE-3 heads' prompts and every prompt the real-engine test and benchmark send.

The generator is specroute's own (`controller.bench.domain_prompts`: `specroute demo` sends the
same kind of prompts); see there for what a document holds. Prompts are drawn by index from a
named stream (`prompts(domain, stream, n)`): the streams "target", "head" and "check" feed the
build; "test" and "bench" are never trained on. Pure Python (no torch), so the test and the
benchmark, which run in specroute's environment, import it too; the build, which runs where
specroute is not installed, finds the module in this repository.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after an installed specroute

from controller.bench.domain_prompts import (
    DOMAINS,
    Document,
    Domain,
    document,
    documents,
    mixed,
    prompt_lines,
    prompts,
)

__all__ = ["DOMAINS", "Document", "Domain", "document", "documents", "mixed", "prompt_lines", "prompts"]
