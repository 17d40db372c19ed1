"""The cases of `scripts/probe_step.py` run on every tree: each case's counts (and its model
with twice the layers) with the tables of one rank, and its timings, the trees alternated
round by round."""

from __future__ import annotations

from recipes.bench.probe_report import (
    count_row,
    ops_sites_table,
    sites_table,
    timing_summary,
    timing_table,
)
from recipes.bench.probe_step import REGIONS, TIMES, count_case, doubled, layer_counts, time_case
from recipes.bench.timing import rotations


def _sections(label: str, tree: str, rank: int, counts: dict) -> str:
    """The sync and dispatched-op tables of one rank's counts."""
    return (
        f"Syncs of the train step, {label}, {tree}, rank {rank}:\n\n"
        + sites_table(counts)
        + f"\n\nOf which in `{counts['optimizer']}`:\n\n"
        + sites_table(counts, REGIONS[0])
        + f"\n\nDispatched ops of `{counts['optimizer']}` by file and"
        " by line:\n\n" + ops_sites_table(counts, REGIONS[0])
    )


def count_cases(
    cases: list[list[str]], world_size: int, rank: int, trees: dict, double: bool
) -> tuple[list[dict], list, list[str]]:
    """(results, count rows, sections) of every case (and its doubled model) on every tree."""
    world = [f"mesh.world_size={world_size}"]
    results, rows, sections = [], [], []
    for case in cases:
        label = " ".join(case)
        variants = [("", case)] + ([(" (2x layers)", doubled(case))] if double else [])
        for suffix, overrides in variants:
            layers = layer_counts([*overrides, *world])
            for tree, path in trees.items():
                ranks = count_case(overrides, world_size, pythonpath=path)
                results.append(
                    {"case": label + suffix, "code": tree, "layers": layers, "ranks": ranks}
                )
                rows.append(count_row(label + suffix, tree, layers, ranks[rank]))
                sections.append(_sections(label + suffix, tree, rank, ranks[rank]))
    return results, rows, sections


def time_cases(
    cases: list[list[str]], world_size: int, steps: int, rounds: int, trees: dict
) -> tuple[list[dict], list[str]]:
    """(times, sections) of every case, `steps` steps per tree and round."""
    times, sections = [], []
    for case in cases:
        by_tree = {tree: {key: [] for key in TIMES} for tree in trees}
        for tree in rotations(list(trees), rounds):
            got = time_case(case, world_size, steps, pythonpath=trees[tree])
            for key, values in got.items():
                by_tree[tree][key] += values
        summary = timing_summary(by_tree)
        times.append({"case": " ".join(case), "seconds": by_tree, "median_s": summary})
        sections.append(timing_table(" ".join(case), summary, steps * rounds))
    return times, sections
