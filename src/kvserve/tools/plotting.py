"""matplotlib for the tools' PNGs: the file-only Agg backend, and one clear message where it is missing."""
from __future__ import annotations


class PlotUnavailable(RuntimeError):
    pass


def pyplot():
    """matplotlib.pyplot on Agg (no display, no GUI toolkit), or PlotUnavailable naming the fix."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("the plot needs matplotlib, which is not installed: pip install matplotlib "
                              "(a kvserve dependency, missing from this environment)") from None
    return plt
