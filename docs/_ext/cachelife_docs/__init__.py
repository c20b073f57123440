"""A local Sphinx extension: the parts of cachelife's documentation generated from the code and the results.

- `cachelife-transitions`, `cachelife-state-diagram`: the lifecycle table and its diagram, from
  `cachelife.TRANSITIONS` (`lifecycle`, `diagram`);
- `cachelife-generate-keywords`, `cachelife-generation-modes`, `cachelife-fallbacks`, `cachelife-processors`:
  `cachelife.generate`'s own keywords (from its signature), what it decodes and what falls back, from
  `cachelife.generation.arguments` and `processors` (`generation`);
- `cachelife-skip-advice`: what each CUDA-graph skip reason means and its fix, from
  `cachelife.integration.skips` (`debugging`);
- `cachelife-newest-results`, `cachelife-results`, `cachelife-suite-runs`: the benchmark results under
  `bench/results/`: an entry's newest file, every file, the GPU suite's runs (`results`, `records`, `provenance`);
- `cachelife-api`: autodoc for every name in `cachelife.__all__`, grouped by task (`api`, `api_groups`), and for
  every error of `cachelife.errors`;
- `cachelife-deprecations`: the names that left the top level and their new homes, from `cachelife`'s
  deprecation table (`changes`).

The repository root is the config value `cachelife_repository` (set by conf.py).
"""

from __future__ import annotations

from typing import Any

from sphinx.application import Sphinx

from cachelife_docs import api, changes, debugging, generation, lifecycle, results


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("cachelife_repository", "", "env", types=[str])
    app.add_directive("cachelife-transitions", lifecycle.TransitionTable)
    app.add_directive("cachelife-state-diagram", lifecycle.StateDiagram)
    app.add_directive("cachelife-generate-keywords", generation.Keywords)
    app.add_directive("cachelife-generation-modes", generation.GenerationModes)
    app.add_directive("cachelife-fallbacks", generation.FallbackArguments)
    app.add_directive("cachelife-processors", generation.Processors)
    app.add_directive("cachelife-skip-advice", debugging.SkipAdvice)
    app.add_directive("cachelife-newest-results", results.NewestResults)
    app.add_directive("cachelife-results", results.BenchmarkResults)
    app.add_directive("cachelife-suite-runs", results.SuiteRuns)
    app.add_directive("cachelife-api", api.PublicApi)
    app.add_directive("cachelife-deprecations", changes.Deprecations)
    app.connect("autodoc-process-docstring", api.drop_type_docstrings)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
