"""The page's plots: matplotlib figures saved as SVG text, inlined in the page (no script, no network).

Figures are built with `matplotlib.figure.Figure` (no pyplot, no global state). Text stays text in the
SVG (`svg.fonttype: none`), math parsing is off (a category named `$x$` is shown as typed) and each
figure's element ids are salted with its name, so several figures inline in one page never share an id.
matplotlib escapes the text it writes into the SVG, so untrusted labels stay text.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib.figure import Figure

_RC = {"svg.fonttype": "none", "text.parse_math": False, "font.size": 9, "axes.spines.top": False,
       "axes.spines.right": False}
_SIZE = (6.0, 3.1)  # inches; the page shows two per row on a laptop screen
COLORS = ("#3a6ea5", "#d07a2d", "#5a9e5a", "#b5473e", "#7d5ba6", "#8c6d46", "#c4639e", "#6f6f6f")
_PROLOGUE_RE = re.compile(r"^.*?(?=<svg)", re.DOTALL)


@dataclass(frozen=True)
class Plot:
    name: str  # the figure's id on the page
    title: str
    svg: str  # an <svg> element
    caption: str = ""


def _svg(fig: Figure, name: str) -> str:
    buffer = io.StringIO()
    with matplotlib.rc_context({**_RC, "svg.hashsalt": f"batchgen-{name}"}):
        fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    return _PROLOGUE_RE.sub("", buffer.getvalue(), count=1)  # the XML declaration and doctype


class _Marks:
    """Names the artists that draw data `<plot>-data-<k>` (the SVG element ids): a reader, or a test,
    finds what the plot drew apart from its axes and labels."""

    def __init__(self, name: str):
        self.name = name
        self.count = 0

    def __call__(self, *groups) -> None:
        for group in groups:
            items = group if isinstance(group, (list, tuple)) or hasattr(group, "patches") else [group]
            for artist in getattr(items, "patches", items):
                if isinstance(artist, (list, tuple)) or hasattr(artist, "patches"):
                    self(artist)
                    continue
                artist.set_gid(f"{self.name}-data-{self.count}")
                self.count += 1


def _figure() -> tuple[Figure, object]:
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=_SIZE)
        ax = fig.add_subplot()
    return fig, ax


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#777777")
    ax.set_xticks([])
    ax.set_yticks([])


def histogram(name: str, title: str, xlabel: str, series: list[tuple[str, np.ndarray]], scale: float = 1.0,
              caption: str = "", integer: bool = False) -> Plot:
    """Histograms of one quantity: one series filled, several drawn as outlines over shared bins.
    Values are multiplied by `scale` (seconds -> ms); NaN values are left out. The p50 and p99 of the
    first series are marked."""
    with matplotlib.rc_context(_RC):
        fig, ax = _figure()
        mark = _Marks(name)
        cleaned = [(label, values[~np.isnan(values)].astype(np.float64) * scale) for label, values in series]
        present = [v for _, v in cleaned if v.size]
        if not present:
            _empty(ax, "no values")
        else:
            low, high = min(v.min() for v in present), max(v.max() for v in present)
            if integer:
                step = max(1, int(np.ceil((high - low + 1) / 60)))
                bins = np.arange(np.floor(low), np.ceil(high) + step + 1, step) - 0.5
            else:
                bins = np.linspace(low, high if high > low else low + 1, 51)
            for k, (label, values) in enumerate(cleaned):
                if not values.size:
                    continue
                style = {"histtype": "stepfilled", "alpha": 0.85} if len(cleaned) == 1 else {
                    "histtype": "step", "linewidth": 1.6}
                mark(ax.hist(values, bins=bins, color=COLORS[k], label=f"{label} ({values.size:,})", **style)[2])
            first = cleaned[0][1]
            if first.size:
                for q, dash in ((50, "--"), (99, ":")):
                    ax.axvline(np.percentile(first, q), color="#222222", linestyle=dash, linewidth=1,
                               label=f"p{q} {np.percentile(first, q):,.1f}")
            ax.legend(frameon=False, fontsize=8)
            ax.ticklabel_format(axis="x", style="plain", useOffset=False)  # 2479.1, not 0.1 + 2.479e3
            ax.set_xlabel(xlabel)
            ax.set_ylabel("rows")
        return Plot(name, title, _svg(fig, name), caption)


def stacked_lengths(name: str, title: str, lengths: np.ndarray, reasons: np.ndarray, names: list[str]) -> Plot:
    """Completion lengths, one stacked color per finish reason."""
    with matplotlib.rc_context(_RC):
        fig, ax = _figure()
        mark = _Marks(name)
        if lengths.size == 0:
            _empty(ax, "no rows")
        else:
            high = int(lengths.max())
            step = max(1, int(np.ceil((high + 1) / 60)))
            bins = np.arange(0, high + step + 1, step) - 0.5
            groups = [(n, lengths[reasons == code]) for code, n in enumerate(names)]
            groups = [(n, v) for n, v in groups if v.size]
            mark(ax.hist([v for _, v in groups], bins=bins, stacked=True,
                         color=[COLORS[k % len(COLORS)] for k in range(len(groups))],
                         label=[f"{n} ({v.size:,})" for n, v in groups])[2])
            ax.legend(frameon=False, fontsize=8, title="finish reason", title_fontsize=8)
            ax.set_xlabel("completion tokens")
            ax.set_ylabel("rows")
        return Plot(name, title, _svg(fig, name))


def bars(name: str, title: str, labels: list[str], values: list[float], xlabel: str, caption: str = "",
         second: tuple[str, list[float]] | None = None, first_label: str = "") -> Plot:
    """Horizontal bars, the first label on top; `second` adds a second bar per label (two runs)."""
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(_SIZE[0], max(1.6, 0.6 + 0.28 * len(labels) * (2 if second else 1))))
        ax = fig.add_subplot()
        mark = _Marks(name)
        if not labels:
            _empty(ax, "no rows")
        else:
            y = np.arange(len(labels))[::-1].astype(float)
            height = 0.4 if second else 0.7
            shift = height / 2 if second else 0.0
            mark(ax.barh(y + shift, values, height=height, color=COLORS[0], label=first_label or None))
            if second:
                mark(ax.barh(y - shift, second[1], height=height, color=COLORS[1], label=second[0]))
                ax.legend(frameon=False, fontsize=8)
            ax.set_yticks(y, labels=[label if len(label) <= 40 else label[:39] + "…" for label in labels])
            ax.set_xlabel(xlabel)
        return Plot(name, title, _svg(fig, name), caption)


def throughput(name: str, title: str, seconds: np.ndarray, tokens: np.ndarray, caption: str) -> Plot:
    """Completion tokens written over the run: cumulative, one step per part, at its commit time."""
    with matplotlib.rc_context(_RC):
        fig, ax = _figure()
        mark = _Marks(name)
        if seconds.size == 0:
            _empty(ax, "the store gives no modification times")
        else:
            order = np.argsort(seconds, kind="stable")
            x = np.concatenate([[0.0], seconds[order]])
            y = np.concatenate([[0], np.cumsum(tokens[order])])
            mark(ax.step(x, y, where="post", color=COLORS[0], linewidth=1.6),
                 ax.plot(x[1:], y[1:], "o", color=COLORS[0], markersize=3))
            if x[-1] > 0:
                ax.plot([0, x[-1]], [0, y[-1]], "--", color="#999999", linewidth=1,
                        label=f"mean {y[-1] / x[-1]:,.1f} tokens/s")
                ax.legend(frameon=False, fontsize=8)
            ax.set_xlabel("seconds since the run started")
            ax.set_ylabel("completion tokens written")
        return Plot(name, title, _svg(fig, name), caption)


def position_histogram(name: str, title: str, counts: np.ndarray, caption: str) -> Plot:
    """Rows per first differing token position (counts[p] rows part at position p)."""
    with matplotlib.rc_context(_RC):
        fig, ax = _figure()
        mark = _Marks(name)
        if counts.sum() == 0:
            _empty(ax, "no row differs in its tokens")
        else:
            high = int(np.flatnonzero(counts).max())
            width = max(1, int(np.ceil((high + 1) / 60)))
            padded = np.pad(counts, (0, (-len(counts)) % width))
            grouped = padded.reshape(-1, width).sum(axis=1)
            mark(ax.bar(np.arange(grouped.size) * width + (width - 1) / 2, grouped, width=width * 0.9,
                        color=COLORS[3]))
            ax.set_xlabel("first differing token position (0 = first generated token)")
            ax.set_ylabel("rows")
            ax.set_xlim(-1, high + width)
        return Plot(name, title, _svg(fig, name), caption)
