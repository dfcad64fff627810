"""What kvserve exports, by sample name, and the metric names a PromQL expression reads: the
Prometheus rules and the Grafana dashboard are checked against the first with the second."""
from __future__ import annotations

import re

# Sample names per family type (counters' `_created` series are disabled by the server).
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "info": ("_info",),
             "gauge": ("",), "summary": ("", "_count", "_sum")}


def exported_names() -> set[str]:
    """Every sample name the server's registry can export, labelled families without children
    (the tier series before a tier is configured) included."""
    from kvserve.config import EngineArgs
    from kvserve.engine.outputs import EngineStats
    from kvserve.server.metrics import ServerMetrics
    metrics = ServerMetrics("m", 1024, EngineArgs(), initial_stats=EngineStats())
    names = set()
    for family in metrics.registry.collect():
        names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    return names


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_DURATION = re.compile(r"\[[^\]]*\]")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers of the families this project and vLLM
    export (`vllm:`, `kvserve:`, `process_`, `python_`), with strings, label matchers, ranges and
    Grafana variables removed first."""
    text = _STRINGS.sub("", expr)
    text = _MATCHERS.sub("", text)
    text = _DURATION.sub("", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)
    return {t for t in _IDENT.findall(text)
            if t.startswith(("vllm:", "kvserve:", "process_", "python_"))}
