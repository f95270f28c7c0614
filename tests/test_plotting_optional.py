"""matplotlib is the optional ``plot`` extra: without it, plotting says how to install it."""

from __future__ import annotations

import importlib
import sys

import pytest

from planner.errors import OptionError, PlannerError

MESSAGE = "plotting needs matplotlib: pip install 'ckplan[plot]'"


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib as if not installed (``None`` in ``sys.modules`` makes ``import matplotlib`` raise
    ImportError), and ``planner.report.plotting`` imported afresh under that condition."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "planner.report.plotting", raising=False)
    return importlib.import_module("planner.report.plotting")


@pytest.mark.parametrize("draw", ["plot_tradeoff", "plot_blocks", "plot_timeline"])
def test_plotting_without_matplotlib_names_the_extra(no_matplotlib, draw):
    # The check comes before the argument is read, so any object will do.
    with pytest.raises(OptionError) as caught:
        getattr(no_matplotlib, draw)(object())
    assert str(caught.value) == MESSAGE
    assert isinstance(caught.value, PlannerError)  # the CLI reports it as a user error (exit 2)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_plot_timeline_from_the_package_root_without_matplotlib(no_matplotlib, monkeypatch):
    import planner

    monkeypatch.delattr(planner, "plot_timeline", raising=False)  # the root resolves it lazily
    with pytest.raises(OptionError, match=r"pip install 'ckplan\[plot\]'"):
        planner.plot_timeline(object())
