"""The report's grid of plots (matplotlib, headless Agg): one panel per quantity some run recorded, every run
overlaid in its own colour. Training quantities are drawn against samples seen, so runs of different batch sizes
or lengths line up; the loss is also drawn against the step. A resumed run marks where it resumed (dashed)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from bigclip.report.runs import Run

SMOOTHING_POINTS = 20  # the smoothed loss: an exponential average over about this many records
GIB = 2**30


@dataclass
class Panel:
    title: str
    ylabel: str
    draw: Callable  # (ax, run, colour, name) -> None
    present: Callable[[Run], bool]
    xlabel: str = "samples seen"


def _ema(values: list[float], points: int = SMOOTHING_POINTS) -> list[float]:
    alpha, out, average = 2 / (points + 1), [], None
    for v in values:
        average = v if average is None else average + alpha * (v - average)
        out.append(average)
    return out


def _label(name: str, what: str = "") -> str:
    """A series' legend entry: the run's name (only when several runs share the axes) and what the series is."""
    return f"{name} {what}".strip() or "run"


def _line(key: str, scale: float = 1.0, what: str = "") -> Callable:
    def draw(ax, run: Run, colour, name: str) -> None:
        x, y = run.series(key)
        ax.plot(x, [v * scale for v in y], color=colour, label=_label(name, what))

    return draw


def _resumes(ax, run: Run, colour, name: str, by_step: bool) -> None:
    for step in run.resumed_at_steps:
        x = step if by_step else run.samples_at_step(step)
        if x is not None:
            ax.axvline(x, color=colour, linestyle="--", linewidth=1, label=_label(name, f"resumed at step {step}"))


def _loss_by_step(ax, run: Run, colour, name: str) -> None:
    x, y = run.series("loss", x="step")
    ax.plot(x, y, color=colour, alpha=0.3, linewidth=0.8, label=_label(name, "raw"))
    ax.plot(x, _ema(y), color=colour, linewidth=1.8, label=_label(name, "smoothed"))
    _resumes(ax, run, colour, name, by_step=True)


def _loss_by_samples(ax, run: Run, colour, name: str) -> None:
    x, y = run.series("loss")
    ax.plot(x, _ema(y), color=colour, linewidth=1.8, label=_label(name, "smoothed"))
    _resumes(ax, run, colour, name, by_step=False)


def _data_share(ax, run: Run, colour, name: str) -> None:
    points = [
        (r["samples_seen"], r["data_time"] / r["batch_time"])
        for r in run.records
        if "samples_seen" in r and r.get("batch_time") and "data_time" in r
    ]
    ax.plot([p[0] for p in points], [p[1] for p in points], color=colour, label=_label(name))


def _prefixed(prefix: str) -> Callable[[Run], list[str]]:
    return lambda run: sorted(k for k in run.keys() if k.startswith(prefix) and run.has(k))


def _keys_draw(keys_of: Callable[[Run], list[str]], strip: str) -> Callable:
    """Every key `keys_of` gives, each its own line style, plotted against samples seen (evaluation records hold
    only the step: its samples are the training record's of that step)."""
    styles = ["-", "--", ":", "-."]

    def draw(ax, run: Run, colour, name: str) -> None:
        for i, key in enumerate(keys_of(run)):
            points = [
                (r["samples_seen"] if "samples_seen" in r else run.samples_at_step(r.get("step", 0)), r[key])
                for r in run.records
                if isinstance(r.get(key), (int, float))
            ]
            points = [p for p in points if p[0] is not None]
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                color=colour,
                linestyle=styles[i % len(styles)],
                marker="o" if len(points) < 30 else None,
                markersize=3,
                label=_label(name, key.removeprefix(strip)),
            )

    return draw


def _eval_group(test: Callable[[str], bool]) -> Callable[[Run], list[str]]:
    """The run's evaluation metrics `test` accepts; sample counts (zeroshot_samples, num_samples) are not plotted."""
    return lambda run: sorted(
        k for k in _prefixed("eval/")(run) if test(k.removeprefix("eval/")) and not k.endswith("samples")
    )


_ZEROSHOT = _eval_group(lambda k: "zeroshot" in k)
_RECALL = _eval_group(lambda k: "R@" in k)
_RANKS = _eval_group(lambda k: "rank" in k)
_VAL_LOSS = _eval_group(lambda k: "loss" in k and "zeroshot" not in k)
_OTHER_EVAL = _eval_group(lambda k: not any(t in k for t in ("zeroshot", "R@", "rank", "loss")))


def _checkpoints(ax, run: Run, colour, name: str) -> None:
    for kind, marker in (("paused", "v"), ("committed", "o")):
        events = [e for e in run.checkpoints if e.kind == kind]
        if events:
            what = "loop paused (s)" if kind == "paused" else "save to commit (s)"
            ax.plot([e.minutes for e in events], [e.seconds for e in events], marker, color=colour,
                    label=_label(name, what))  # fmt: skip
    deferred = [e for e in run.checkpoints if e.kind == "deferred"]
    if deferred:
        ax.plot([e.minutes for e in deferred], [0] * len(deferred), "x", color=colour, markersize=8,
                label=_label(name, "deferred save"))  # fmt: skip


PANELS = [
    Panel("training loss by step", "loss", _loss_by_step, lambda r: r.has("loss"), xlabel="step"),
    Panel("training loss", "loss (smoothed)", _loss_by_samples, lambda r: r.has("loss")),
    Panel("learning rate", "lr", _line("lr"), lambda r: r.has("lr")),
    Panel("logit scale", "scale", _line("logit_scale"), lambda r: r.has("logit_scale")),
    Panel("logit bias", "bias", _line("logit_bias"), lambda r: r.has("logit_bias")),
    Panel("gradient norm", "norm", _line("grad_norm"), lambda r: r.has("grad_norm")),
    Panel("throughput", "samples/s per GPU", _line("samples_per_s_per_gpu"), lambda r: r.has("samples_per_s_per_gpu")),
    Panel("time waiting for data", "share of step time", _data_share, lambda r: r.has("data_time")),
    Panel("peak memory", "GiB", _line("peak_memory_bytes", 1 / GIB), lambda r: r.has("peak_memory_bytes")),
    Panel("zero-shot accuracy", "accuracy", _keys_draw(_ZEROSHOT, "eval/"), lambda r: bool(_ZEROSHOT(r))),
    Panel("retrieval recall", "R@K", _keys_draw(_RECALL, "eval/"), lambda r: bool(_RECALL(r))),
    Panel("retrieval ranks", "rank", _keys_draw(_RANKS, "eval/"), lambda r: bool(_RANKS(r))),
    Panel("validation loss", "loss", _keys_draw(_VAL_LOSS, "eval/"), lambda r: bool(_VAL_LOSS(r))),
    Panel("other evaluations", "value", _keys_draw(_OTHER_EVAL, "eval/"), lambda r: bool(_OTHER_EVAL(r))),
    Panel(
        "skipped samples",
        "samples (cumulative)",
        _keys_draw(_prefixed("data/skipped_"), "data/skipped_"),
        lambda r: bool(_prefixed("data/skipped_")(r)),
    ),
    Panel("checkpoint saves skipped", "saves", _line("ckpt/skipped"), lambda r: r.has("ckpt/skipped")),
    Panel("checkpoints", "seconds", _checkpoints, lambda r: bool(r.checkpoints), xlabel="minutes since start"),
]


def build_figure(runs: list[Run], columns: int = 3):
    """The grid: the panels some run has data for, in PANELS' order; each axis is titled with its panel's title."""
    # A bare Figure (no pyplot): drawn by the Agg canvas, headless, and nothing kept in a global registry when
    # a run redraws its report every epoch.
    import matplotlib
    from matplotlib.figure import Figure

    panels = [p for p in PANELS if any(p.present(run) for run in runs)]
    rows = max(1, math.ceil(len(panels) / columns))
    fig = Figure(figsize=(6 * columns, 3.8 * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels):
        for i, run in enumerate(runs):
            if panel.present(run):
                panel.draw(ax, run, colours[i % len(colours)], run.name if len(runs) > 1 else "")
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        fig.delaxes(ax)
    fig.tight_layout()
    return fig
