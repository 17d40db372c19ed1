"""The W&B workspace `scripts/wandb_dashboard.py` builds, as data: its panels by section (the
metric keys train.py logs, or a regex over them), their text for a dry run, and the
`wandb_workspaces` Workspace they make (its doc: what each section shows)."""

from __future__ import annotations

import re
from dataclasses import dataclass

GROUP_KEY = "optim.remainder_strategy"
#: a rank's figures are logged as memory/rank_<k>/<key>
_RANK = r"memory/rank_\d+/"


@dataclass(frozen=True)
class Panel:
    """One panel: line plots draw history keys (or those matching `regex`) against Step; bar
    charts draw the runs' summary values of `keys`."""

    section: str
    title: str
    keys: tuple[str, ...] = ()
    regex: str | None = None
    kind: str = "line"  # "line" or "bar"


PANELS: tuple[Panel, ...] = (
    Panel("Time", "step time, slowest rank (s)", ("step_s/max",)),
    Panel("Time", "optimizer step, slowest rank (s)", ("optim_s/max",)),
    Panel(
        "Time",
        "Muon: waiting on collectives vs Newton-Schulz (s)",
        ("muon/wait_s/max", "muon/ns_s/max"),
    ),  # fmt: skip
    Panel(
        "Memory", "optimizer-step transient per rank (MiB)", regex=_RANK + "optim_peak_delta_mib"
    ),  # fmt: skip
    Panel("Memory", "step peak per rank (MiB)", regex=_RANK + "step_peak_mib"),
    Panel(
        "Memory",
        "optimizer-step transient, max and min over ranks (MiB)",
        ("memory/optim_peak_delta_mib/max", "memory/optim_peak_delta_mib/min"),
    ),  # fmt: skip
    Panel(
        "Remainder exchange",
        "remainder batch: bytes sent per step, max and min over ranks",
        ("muon/remainder/bytes_sent/max", "muon/remainder/bytes_sent/min"),
    ),  # fmt: skip
    Panel(
        "Remainder exchange",
        "all Muon exchanges: bytes sent per step, max and min over ranks",
        ("muon/bytes_sent/max", "muon/bytes_sent/min"),
    ),  # fmt: skip
    Panel("Training", "loss", ("loss",)),
    Panel("Training", "held-out loss (eval.every steps and the end)", ("val/loss",)),
    Panel("Training", "tokens/s", ("tokens_per_s",)),
    Panel("Attention", "max pre-softmax logit, all layers (QK-clip's S)", ("attn/max_logit",)),
    Panel("Attention", "max logit per layer", regex=r"attn/max_logit/layer_\d+"),
    Panel(
        "Summaries",
        "peak memory per run (MiB)",
        ("memory/step_peak_mib/max", "memory/optim_peak_delta_mib/max"),
        kind="bar",
    ),  # fmt: skip
    Panel(
        "Summaries",
        "throughput and optimizer share",
        ("final/tokens_per_s", "final/optim_share"),
        kind="bar",
    ),  # fmt: skip
)


def panel_keys(panel: Panel, logged: set[str]) -> set[str]:
    """The logged keys a panel draws: its named keys, or those its regex matches in full."""
    if panel.regex is None:
        return set(panel.keys)
    pattern = re.compile(panel.regex)
    return {key for key in logged if pattern.fullmatch(key)}


def describe(group: str | None, by: str = GROUP_KEY) -> str:
    """The panels as text, one per line, by section."""
    lines = [f"runs: W&B group {group!r}" if group else "runs: every run of the project"]
    lines.append(f"grouped by: config {by}")
    section = None
    for p in PANELS:
        if p.section != section:
            section = p.section
            lines.append(f"[{section}]")
        what = f"regex {p.regex}" if p.regex else ", ".join(p.keys)
        lines.append(f"  {p.kind:4} {p.title}: {what}")
    return "\n".join(lines)


def build_workspace(entity: str, project: str, group: str | None, name: str, by: str = GROUP_KEY):
    """The `wandb_workspaces` Workspace for PANELS (not saved)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    def panel(p: Panel):
        if p.kind == "bar":
            return wr.BarPlot(title=p.title, metrics=list(p.keys))
        if p.regex is not None:
            return wr.LinePlot(title=p.title, x="Step", metric_regex=p.regex)
        return wr.LinePlot(title=p.title, x="Step", y=list(p.keys))

    sections = []
    for title in dict.fromkeys(p.section for p in PANELS):
        panels = [panel(p) for p in PANELS if p.section == title]
        sections.append(ws.Section(name=title, panels=panels, is_open=True))
    filters = ws.And(ws.Metric("Group") == group) if group else ""
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=sections,
        runset_settings=ws.RunsetSettings(filters=filters, groupby=[ws.Config(by)]),
    )
