"""A child Python's opening lines that make it an install holding only some distributions: every installed module
whose distribution is not among those named in argv[1] (a JSON list of normalised names) fails to import, as it
would there, and optional imports take their fallbacks. The project's own packages (`ours`) always import."""

from __future__ import annotations


def only_distributions(ours: set[str], missing: str) -> str:
    """The lines to put before a child's own (`python -c LINES+CODE NAMES_JSON`); a blocked import's error reads
    `{missing} NAME` (e.g. "the gateway image has no")."""
    return f"""
import importlib, importlib.abc, importlib.metadata, json, sys
allowed = set(json.loads(sys.argv[1]))
ours = {sorted(ours)!r}
absent = {{module for module, dists in importlib.metadata.packages_distributions().items()
          if not any(dist.lower().replace("_", "-") in allowed for dist in dists)}} - set(ours)
class OnlyDistributions(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in absent:
            raise ModuleNotFoundError(f"{missing} {{name}}", name=name)
sys.meta_path.insert(0, OnlyDistributions())
"""
