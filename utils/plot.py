"""Learning curves and a table of final returns from any set of run folders.

Runs are grouped by their whole configuration: the env, the script (config.json's `exp_name`,
which defaults to the script's name) and every flag but the seed and those that only say where and
how the run was recorded (config.json, with each resume's changes). Each group is labelled by the
flags that tell it apart from the other groups of its script; two runs of one group with the same
seed are drawn apart ("repeat 2"), never averaged as two seeds. Each seed's episodic returns are
smoothed (trailing mean over a window of episodes), resampled on a grid common to the group's
seeds, and drawn as the mean over seeds with a band (std or min-max, drawn only where every seed
has data), against environment steps and against training time: the seconds from each of the
run's starts (its first update, so that compile time, which the compile cache may save one seed
and not another, does not shift the curves) to its last record, summed over its resumes, so that
the time between a stop and its resume is not counted; each resume is marked. Past the shortest
seed the line is the mean of the seeds still running. A sweep folder of utils/launch.py gives one
curve per configuration. One PNG per environment (every group on it, two panels) and summary.md, a
markdown table of final returns and last evaluations, also printed on stdout. --tag draws another
scalar (eval/episodic_return: the evaluation curve). A population folder of utils/launch.py --pbt
named on the command line also gets NAME_pbt.png: its best and median member, and each member's
learning rate over steps.

Usage:
    python utils/plot.py runs/                                  # every run folder under runs/
    python utils/plot.py runs/a runs/b runs/c --band minmax --out plots/
    python utils/plot.py runs/pbt --tag eval/episodic_return    # a population: + pbt_pbt.png
"""

import json
import math
import os
import re
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (the backend is chosen before pyplot is imported)
import numpy as np  # noqa: E402
import tyro  # noqa: E402

from jax_async_rl.checkpoints import CONFIG, METRICS, run_identity  # noqa: E402
from jax_async_rl.flags import UsageError, run_tool  # noqa: E402

RETURN_TAG = "charts/episodic_return"
EVAL_TAG = "eval/episodic_return"  # --eval-interval's points and the final evaluation
FIRST_UPDATE_TAG = "charts/SPS"  # logged at every run's first update
# config.json entries that are no part of a run's configuration: the seed, and where and how it is
# recorded (a group's runs differ in these); the batch in words follows from the flags.
NOT_CONFIGURATION = (
    "seed",
    "run_dir",
    "resume",
    "resumes",
    "save_interval",
    "log_frequency",
    "eval_episodes",
    "eval_interval",
    "capture_video",
    "track",
    "wandb_project",
    "compile_cache",
    "global_batch",
    "process_id",
    "coordinator_address",
)


@dataclass
class PlotArgs:
    """Plot learning curves (mean and spread over seeds) and tabulate final returns."""

    runs: Annotated[tyro.conf.Positional[list[str]], tyro.conf.arg(metavar="RUN_DIR...")]
    """run folders (holding metrics.jsonl), or parent folders whose subfolders are runs"""
    out: Annotated[
        Optional[str], tyro.conf.arg(help_behavior_hint="(default: runs/plots__{timestamp})")
    ] = None
    """output folder for the PNGs and summary.md"""
    window: int = 20
    """smoothing: each point is the mean return of the last this many episodes of the seed"""
    points: int = 200
    """resolution of the common grid each seed's curve is resampled on"""
    band: Literal["std", "minmax"] = "std"
    """spread drawn around the mean over seeds: +- one standard deviation, or min to max"""
    last_episodes: int = 20
    """final return of a seed: the mean of its last this many episodic returns"""
    tag: str = RETURN_TAG
    """the curve's scalar: charts/episodic_return (training games, each seed smoothed over
    --window episodes), eval/episodic_return (--eval-interval's evaluations and the final one,
    each point already a mean of --eval-episodes games: drawn as logged), or any tag the runs log
    (drawn as logged)"""
    threshold: Optional[float] = None
    """also tabulate the env steps and seconds each seed took to reach this return (its first
    --window-episode mean at or above it), and its best such mean"""


class NoEpisodes(UsageError):
    """A run folder whose metrics hold no episodic return yet."""


class BadConfig(UsageError):
    """A run folder whose config.json is not a run's record (not JSON, or an entry of a wrong
    type)."""


class BadMetrics(UsageError):
    """A run folder whose metrics.jsonl holds a line that is not a record a run writes, or whose
    episodic returns are all NaN or infinite."""


class NotFinite(ValueError):
    """A metrics record's step or wall_time that is NaN or infinite (a run writes neither)."""


@dataclass
class Run:
    folder: str
    script: str
    env_id: str
    seed: object
    steps: np.ndarray  # [N] environment steps at which each episode ended
    seconds: np.ndarray  # [N] training seconds (training_seconds) at which each episode ended
    returns: np.ndarray  # [N] game scores, in the order logged
    last_step: int  # the largest step of any record
    # the flags that make its configuration (NOT_CONFIGURATION left out), each resume's changes in
    config: dict
    resumed_at: list  # the training seconds at which each resume started
    curve: tuple = ()  # (steps, seconds, values) of PlotArgs.tag's records, in the order logged
    last_eval: Optional[float] = None  # the eval/episodic_return of the largest step, if any


def find_runs(paths: list[str]) -> list[tuple[str, bool]]:
    """(run folder, named explicitly): each path that holds metrics.jsonl, else its subfolders
    that do."""
    folders = []
    for path in paths:
        if not os.path.isdir(path):
            raise UsageError(
                f"{path} is not a folder; pass run folders or a folder of runs (e.g. runs/)"
            )
        if os.path.isfile(os.path.join(path, METRICS)):
            folders.append((path, True))
            continue
        children = sorted(
            os.path.join(path, name)
            for name in os.listdir(path)
            if os.path.isfile(os.path.join(path, name, METRICS))
        )
        if not children:
            raise UsageError(
                f"no {METRICS} in {path} nor in its subfolders; pass run folders or a folder of "
                f"runs"
            )
        folders += [(child, False) for child in children]
    return folders


def read_run(folder: str, tag: str = RETURN_TAG) -> Run:
    """A run's episodic returns with their steps and times (and those of `tag`'s records, the
    curve). A last line still being written is skipped."""
    with open(os.path.join(folder, METRICS)) as f:
        lines = f.read().split("\n")
    steps, times, returns, updates, records, last_step, not_finite = [], [], [], [], [], 0, 0
    curve, evals = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            step, wall_time, name, value = parse_record(line)
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
            if number == len(lines):  # no newline yet: a record in the middle of being written
                break
            reason = str(e) if isinstance(e, NotFinite) else type(e).__name__
            raise BadMetrics(f"{folder}/{METRICS} line {number} is not a metrics record ({reason})")
        if name == FIRST_UPDATE_TAG:
            updates.append(wall_time)
        records.append(wall_time)
        last_step = max(last_step, step)
        if name == RETURN_TAG and math.isfinite(value):
            steps.append(step)
            times.append(wall_time)
            returns.append(value)
        not_finite += name == RETURN_TAG and not math.isfinite(value)
        if name == tag and math.isfinite(value):
            curve.append((step, wall_time, value))
        if name == EVAL_TAG and math.isfinite(value):
            evals.append((step, value))
    if not returns and not_finite:
        raise BadMetrics(
            f"{folder}/{METRICS}: every {RETURN_TAG} ({not_finite}) is NaN or infinite, no return "
            f"to plot"
        )
    if not returns:
        raise NoEpisodes(
            f"{folder}/{METRICS} has no {RETURN_TAG} yet: no episode has finished; train longer"
        )
    config = read_config(folder)  # checked first: run_identity would take any value as a str
    identity = run_identity(folder)
    resumes = [float(r["wall_time"]) for r in config.get("resumes", []) if "wall_time" in r]
    seconds, resumed_at = training_seconds(
        np.array(times + [t for _, t, _ in curve]), np.array(records), np.array(updates), resumes
    )
    seconds, curve_seconds = seconds[: len(times)], seconds[len(times) :]
    return Run(
        folder,
        identity["script"],
        identity["env_id"],
        identity["seed"],
        np.array(steps, np.float64),
        seconds,
        np.array(returns),
        last_step,
        configuration(config),
        resumed_at,
        (
            np.array([s for s, _, _ in curve], np.float64),
            curve_seconds,
            np.array([v for *_, v in curve]),
        ),
        max(evals)[1] if evals else None,
    )


def parse_record(line: str) -> tuple:
    """(step, wall_time, tag, value) of a metrics.jsonl line; ValueError (and json's errors) unless
    it is a record a run writes: a step and a wall_time that are finite numbers (a value may be
    NaN)."""
    record = json.loads(line)
    step, wall_time = record["step"], float(record["wall_time"])
    for key, number in (("step", step), ("wall_time", wall_time)):
        if isinstance(number, float) and not math.isfinite(number):
            raise NotFinite(f"a {key} of {number}")
    return int(step), wall_time, record["tag"], float(record["value"])


def read_config(folder: str) -> dict:
    """A run's config.json ({} without one: a run known by its checkpoint alone). BadConfig, one
    line naming the file and the key, unless each entry plot reads has the type a run writes:
    a file anyone may have edited names the PNGs and the groups."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadConfig(f"{path} is not JSON ({type(e).__name__})")
    if not isinstance(config, dict):
        raise BadConfig(
            f"{path} is not a run's config: a JSON {type(config).__name__}, not an object"
        )
    strings = [("env_id", config.get("env_id")), ("exp_name", config.get("exp_name"))]
    for key, value in strings:
        if not isinstance(value, str) or not value.strip():
            raise BadConfig(f'{path}: "{key}" is {value!r:.80}, not a non-empty string')
    seed = config.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadConfig(f'{path}: "seed" is {seed!r:.80}, not an integer')
    resumes = config.get("resumes", [])
    if not isinstance(resumes, list):
        raise BadConfig(f'{path}: "resumes" is {resumes!r:.80}, not a list')
    for i, resume in enumerate(resumes):
        wall_time = resume.get("wall_time", 0.0) if isinstance(resume, dict) else None
        if (
            isinstance(wall_time, bool)
            or not isinstance(wall_time, (int, float))
            or not math.isfinite(wall_time)
        ):
            raise BadConfig(
                f'{path}: "resumes"[{i}] is not a resume\'s record with a finite "wall_time"'
            )
        if not isinstance(resume.get("changed", {}), dict):
            raise BadConfig(
                f'{path}: "resumes"[{i}]["changed"] is {resume["changed"]!r:.80}, not an object'
            )
    return config


def configuration(config: dict) -> dict:
    """The flags that make a run's configuration: config.json's, each resume's changes applied,
    those in NOT_CONFIGURATION left out."""
    flags = dict(config)
    for resume in config.get("resumes", []):  # read_config checked them
        flags.update(resume.get("changed", {}))
    return {k: v for k, v in flags.items() if k not in NOT_CONFIGURATION}


def training_seconds(times: np.ndarray, records: np.ndarray, updates: np.ndarray, resumes: list):
    """(The training seconds at each of `times`, those at which each resume started.) A run's
    records fall into sessions, split at its resumes' start times; a session counts from its
    first update (`updates`: the times of charts/SPS records; compiling is not training) to its
    last record, and the sessions before it are added, so that the time from a stop to its
    resume is not counted. A time before its session's first update counts as that update's."""
    bounds = [-np.inf, *sorted(resumes), np.inf]
    seconds, offset, resumed_at = np.zeros(len(times)), 0.0, []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        inside = records[(records >= lo) & (records < hi)]
        starts = updates[(updates >= lo) & (updates < hi)]
        if i:
            resumed_at.append(offset)
        if not len(inside):
            continue
        start = starts[0] if len(starts) else inside[0]  # no update logged yet: the first record
        mine = (times >= lo) & (times < hi)
        seconds[mine] = offset + np.maximum(times[mine] - start, 0.0)
        offset += max(inside[-1] - start, 0.0)
    return seconds, resumed_at


def read_runs(paths: list[str], tag: str = RETURN_TAG) -> list[Run]:
    """The runs under `paths`. A run found inside a parent folder that has no episode yet (one
    just started, or one that crashed early) or a config.json or metrics.jsonl line plot cannot read
    (BadConfig, BadMetrics) is skipped with a warning, and the others are plotted; one named is an
    error."""
    runs, unreadable = [], False
    for folder, explicit in find_runs(paths):
        try:
            runs.append(read_run(folder, tag))
        except (NoEpisodes, BadConfig, BadMetrics) as e:
            if explicit:
                raise
            print(f"warning: skipped {folder}: {e}", file=sys.stderr)
            unreadable = unreadable or not isinstance(e, NoEpisodes)
    if not runs and unreadable:
        raise UsageError(
            f"no run under {', '.join(paths)} to plot: each was skipped, as the warnings above say"
        )
    if not runs:
        raise UsageError(
            f"no run under {', '.join(paths)} has a {RETURN_TAG} yet: no episode has finished"
        )
    if not any(len(run.curve[0]) for run in runs):
        hint = " (runs log it with --eval-interval, and at the end)" if tag == EVAL_TAG else ""
        raise UsageError(f"--tag {tag}: no run under {', '.join(paths)} logs it{hint}")
    return runs


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` entries (fewer at the start)."""
    cumsum = np.concatenate([[0.0], np.cumsum(values)])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (cumsum[ends] - cumsum[starts]) / (ends - starts)


def resample(curves: list[tuple[np.ndarray, np.ndarray]], points: int):
    """Curves (x [N], y [N]) -> (grid [P], ys [seeds, P]) by linear interpolation. The grid spans
    every curve's range (the longest seed's included); each curve is NaN outside its own.
    Several episodes ending at the same x are averaged first."""
    lo, hi = min(x[0] for x, _ in curves), max(x[-1] for x, _ in curves)
    grid = np.linspace(lo, hi, points) if hi > lo else np.array([lo])
    ys = []
    for x, y in curves:
        unique, inverse = np.unique(x, return_inverse=True)
        y_mean = np.bincount(inverse, weights=y) / np.bincount(inverse)
        ys.append(np.interp(grid, unique, y_mean, left=np.nan, right=np.nan))
    return grid, np.array(ys)


def draw(ax, grid, ys, band: str, label: str):
    """Mean over the seeds that have data at each point, with a band (+- std or min-max) only
    where every seed has data. Returns (mean, low, high, where the band is drawn)."""
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", RuntimeWarning
        )  # all-NaN columns where curves do not overlap
        mean = np.nanmean(ys, axis=0)
        if band == "std":
            low, high = mean - np.nanstd(ys, axis=0), mean + np.nanstd(ys, axis=0)
        else:
            low, high = np.nanmin(ys, axis=0), np.nanmax(ys, axis=0)
    everyone = ~np.isnan(ys).any(axis=0)
    # Solid where every seed has data; dashed where some have ended (a mean of fewer seeds than
    # the label counts: seeds end at different steps, and a resumed or longer run goes on).
    (line,) = ax.plot(
        grid, np.where(everyone, mean, np.nan), label=label, marker="o" if len(grid) == 1 else None
    )
    fewer = ~everyone & ~np.isnan(mean)
    if fewer.any():
        edge = (
            fewer | np.convolve(fewer, [1, 1, 1], "same").astype(bool) & everyone
        )  # joined to the solid part
        ax.plot(
            grid, np.where(edge, mean, np.nan), color=line.get_color(), linestyle="--", alpha=0.7
        )
    if len(ys) > 1:
        ax.fill_between(
            grid, low, high, where=everyone, color=line.get_color(), alpha=0.2, linewidth=0
        )
    return mean, low, high, everyone if len(ys) > 1 else np.zeros(len(grid), bool)


def plot_env(env_id: str, groups: dict, args: PlotArgs, out_dir: str) -> str:
    """One PNG, two panels (return vs steps, vs training time), one line per group on this env;
    on the time panel each run's resumes are dotted lines in its group's colour."""
    fig, (ax_steps, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    window = args.window if args.tag == RETURN_TAG else 1  # other tags: drawn as logged
    for label, runs in sorted(groups.items()):
        runs = [run for run in runs if len(run.curve[0])]  # those that log --tag
        if not runs:
            continue
        label = f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
        for ax, axis in ((ax_steps, 0), (ax_time, 1)):
            orders = [
                np.argsort(run.curve[axis], kind="stable") for run in runs
            ]  # resumed runs may step back
            curves = [
                (run.curve[axis][o], smooth(run.curve[2][o], window))
                for run, o in zip(runs, orders)
            ]
            grid, ys = resample(curves, args.points)
            draw(ax, grid, ys, args.band, label)
        colour = ax_time.get_lines()[-1].get_color()
        for x in {x for run in runs for x in run.resumed_at}:
            ax_time.axvline(x, color=colour, linestyle=":", linewidth=1)
    spread = "std" if args.band == "std" else "min-max"
    ax_steps.set_xlabel("environment steps")
    ax_time.set_xlabel(
        "training time (s): from each start's first update, so without compiles\n"
        "nor the time between a stop and its resume (dotted: a resume)"
    )
    ylabel = {
        RETURN_TAG: f"episodic return (mean of last {args.window} episodes)",
        EVAL_TAG: "evaluation return (mean of its episodes)",
    }.get(args.tag, args.tag)
    for ax in (ax_steps, ax_time):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(f"{env_id}: mean over seeds (dashed where some seeds have ended), band = {spread}")
    fig.tight_layout()
    path = os.path.join(out_dir, re.sub(r"[^A-Za-z0-9._-]+", "_", env_id) + ".png")
    fig.savefig(path, dpi=100, bbox_inches="tight")  # nothing cut off at the edges
    plt.close(fig)
    return path


def reached(run: Run, window: int, threshold: float):
    """(env steps, seconds) at the first trailing `window`-episode mean >= threshold, or None."""
    means, order = full_windows(run, window)
    hits = np.flatnonzero(means >= threshold)
    return (run.steps[order][hits[0]], run.seconds[order][hits[0]]) if len(hits) else None


def full_windows(run: Run, window: int):
    """The trailing `window`-episode means (full windows only, or every episode of a shorter run),
    in step order as the curves are drawn (a resumed run may step back), and that order."""
    order = np.argsort(run.steps, kind="stable")
    first = min(window, len(run.returns)) - 1
    return smooth(run.returns[order], window)[first:], order[first:]


def chance_excess(run: Run, window: int) -> float:
    """About how far the best of a run's `window`-episode means lands above its level by chance
    alone: the standard error of one such mean (the episode-to-episode spread of its last 10 x
    `window` games, from successive differences so that a trend does not count, over
    sqrt(window)) times sqrt(2 ln K), the expected maximum of K independent standard normals (K:
    its episodes // window). Large where episodes are short and near-binary: MiniGrid-MemoryS7
    (300,000 games at 62% won) about 0.5 at a 20-episode window, 0.05 at 1,000."""
    k, tail = len(run.returns) // window, run.returns[-10 * window :]
    if k < 2 or len(tail) < 3:
        return 0.0
    return float(np.std(np.diff(tail)) / np.sqrt(2 * window) * np.sqrt(2 * np.log(k)))


def noise_notes(groups: dict, window: int, threshold: float) -> list:
    """A note for each (env, group) whose runs' chance_excess is over 10% of the threshold (or
    of the returns' range, if larger): its steps to the threshold may count a lucky window."""
    notes = []
    for (env_id, label), runs in sorted(groups.items()):
        excess = max(chance_excess(run, window) for run in runs)
        scale = max(abs(threshold), max(float(np.ptp(run.returns)) for run in runs))
        if excess > 0.1 * scale:
            notes.append(
                f"note: {env_id} {label}: the best of these runs' {window}-episode means lands "
                f"about "
                f"{excess:.3g} above their level by chance alone (the spread of their last games "
                f"over "
                f"sqrt({window}), with {min(len(run.returns) for run in runs) // window}+ windows "
                f"a run), so a "
                f"first {window}-episode mean at {threshold:g} may be a lucky one: read it with a "
                f"larger --window"
            )
    return notes


def spread(values) -> str:
    digits = 1 if len(values) and abs(np.mean(values)) < 100 else 0  # seconds of a short run
    return f"{np.mean(values):.{digits}f} ± {np.std(values):.{digits}f}" if len(values) else "-"


def summary_table(groups: dict, last_episodes: int, threshold=None, window: int = 20) -> str:
    """Markdown: per (env, group), the mean +- std over seeds of each seed's last-episodes mean
    (and with a threshold: the steps and seconds to it over the seeds that reached it, and the
    best `window`-episode mean)."""
    extra = (
        f" | seeds at {threshold:g} | steps to {threshold:g} | seconds to {threshold:g} | best"
        if threshold is not None
        else ""
    )
    lines = [
        f"Final return: each seed's mean episodic return over its last {last_episodes} episodes; "
        "last evaluation: each seed's eval/episodic_return of its largest step (the final "
        "evaluation's); mean ± std (population) over seeds."
        + (
            f" Steps and seconds to {threshold:g}: the first {window}-episode "
            "mean at or above it, over the seeds that reached it."
            if extra
            else ""
        ),
        "",
        f"| env_id | configuration | seeds | env steps | final return | last evaluation{extra} "
        "| per seed |",
        "|---|---|---:|---:|---|---" + "|---:|---|---|---" * bool(extra) + "|---|",
    ]
    for (env_id, label), runs in sorted(groups.items()):
        finals = np.array([np.mean(run.returns[-last_episodes:]) for run in runs])
        steps = min(run.last_step for run in runs)
        per_seed = ", ".join(f"{run.seed}: {final:.2f}" for run, final in zip(runs, finals))
        cells = ""
        if extra:
            hits = [
                hit for hit in (reached(run, window, threshold) for run in runs) if hit is not None
            ]
            best = np.array([full_windows(run, window)[0].max() for run in runs])
            cells = (
                f" | {len(hits)}/{len(runs)} | {spread([h[0] for h in hits])} | "
                f"{spread([h[1] for h in hits])}"
                f" | {best.mean():.2f}"
            )
        evals = [run.last_eval for run in runs if run.last_eval is not None]
        last_eval = f"{np.mean(evals):.2f} ± {np.std(evals):.2f}" if evals else "-"
        if evals and len(evals) < len(runs):
            last_eval += f" ({len(evals)} seeds)"
        lines.append(
            f"| {env_id} | {label} | {len(runs)} | {steps} | {finals.mean():.2f} ± "
            f"{finals.std():.2f} | {last_eval}{cells} | {per_seed} |"
        )
    return "\n".join(lines) + "\n"


def group_runs(runs: list) -> dict:
    """{(env_id, label): runs}: one group per configuration (the env, the script, `Run.config`), and
    within one, the k-th run of a seed in "repeat k" (said on stderr), so that no two runs of a
    group share a seed. Labelled by `labels`."""
    by_config = defaultdict(list)
    for run in sorted(runs, key=lambda r: (str(r.seed), r.folder)):
        by_config[
            (run.env_id, run.script, json.dumps(run.config, sort_keys=True, default=str))
        ].append(run)
    groups = {}
    for key, group in by_config.items():
        count = defaultdict(int)
        for run in group:
            count[str(run.seed)] += 1
            groups.setdefault((*key, count[str(run.seed)]), []).append(run)
            if count[str(run.seed)] > 1:
                print(
                    f"warning: {run.folder} has the configuration and the seed ({run.seed}) of "
                    f"another run: drawn "
                    f"apart, as repeat {count[str(run.seed)]}",
                    file=sys.stderr,
                )
    names = labels(groups)
    return {(key[0], names[key]): group for key, group in groups.items()}


def labels(groups: dict) -> dict:
    """Each group's label: its script, then the flags whose values tell it apart from the other
    groups of that script on its env (`serial`, `total-timesteps=20000`), then "repeat k"."""
    names = {}
    for env_id, script in {(key[0], key[1]) for key in groups}:
        keys = [key for key in groups if key[:2] == (env_id, script)]
        configs = {key: json.loads(key[2]) for key in keys}
        flags = sorted({flag for config in configs.values() for flag in config})
        differ = [
            f
            for f in flags
            if len({json.dumps(c.get(f, "?"), default=str) for c in configs.values()}) > 1
        ]
        for key in keys:
            parts = [describe(flag, configs[key].get(flag, "?")) for flag in differ]
            names[key] = " ".join([script, *parts, *([f"repeat {key[3]}"] if key[3] > 1 else [])])
    return names


def describe(flag: str, value) -> str:
    """A flag's value as a label shows it: `serial`, `no-serial`, `total-timesteps=20000`."""
    name = flag.replace("_", "-")
    return name if value is True else f"no-{name}" if value is False else f"{name}={value}"


def plot_population(folder: str, args: PlotArgs, out_dir: str) -> str:
    """A population of utils/launch.py --pbt (a folder holding pbt.jsonl): one PNG, the best and
    the median member's curve (--tag's, each member smoothed as the curves are) against env steps
    with each round's end dotted, and each member's --learning-rate against env steps as pbt.jsonl
    records each round setting it (copied, mutated; where the population mutates it)."""
    members = sorted(
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if os.path.isfile(os.path.join(folder, name, METRICS))
    )
    window = args.window if args.tag == RETURN_TAG else 1
    curves, rates = [], {}
    for member in members:
        run = read_run(member, args.tag)
        if len(run.curve[0]):
            order = np.argsort(run.curve[0], kind="stable")
            curves.append((run.curve[0][order], smooth(run.curve[2][order], window)))
    with open(os.path.join(folder, "pbt.jsonl")) as f:
        rounds = [json.loads(line) for line in f if line.strip()]
    for name in sorted({m["name"] for entry in rounds for m in entry["members"]}):
        # the rate the launcher set each round (the flag; --anneal-lr scales it within a round)
        steps, values = [0], []
        for entry in rounds:
            member = next(m for m in entry["members"] if m["name"] == name)
            values = values or [member["old"].get("learning_rate")]
            steps.append(entry["step"])
            values.append(member["new"].get("learning_rate"))
        if None not in values:
            rates[name] = (np.array(steps), np.array(values, float))
    fig, (ax_curve, ax_rate) = plt.subplots(1, 2, figsize=(12, 4.5))
    if curves:
        grid, ys = resample(curves, args.points)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ax_curve.plot(grid, np.nanmax(ys, axis=0), label="best member")
            ax_curve.plot(grid, np.nanmedian(ys, axis=0), label="median member")
    for entry in rounds:
        ax_curve.axvline(entry["step"], color="grey", linestyle=":", linewidth=1)
    for name, (steps, values) in sorted(rates.items()):
        ax_rate.plot(steps, values, label=name, drawstyle="steps-post")
    ax_curve.set_ylabel(
        {RETURN_TAG: "episodic return", EVAL_TAG: "evaluation return"}.get(args.tag, args.tag)
    )
    ax_rate.set_ylabel("--learning-rate (pbt.jsonl: as each round set it)")
    ax_rate.set_yscale("log")
    copies = sum(1 for entry in rounds for m in entry["members"] if m.get("copies"))
    for ax in (ax_curve, ax_rate):
        ax.set_xlabel("environment steps")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(
        f"{os.path.basename(os.path.normpath(folder))}: population of {len(members)}, "
        f"{len(rounds)} rounds (dotted), {copies} copies"
    )
    fig.tight_layout()
    path = os.path.join(out_dir, os.path.basename(os.path.normpath(folder)) + "_pbt.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def main(args: PlotArgs) -> int:
    for name in ["window", "points", "last_episodes"]:
        if getattr(args, name) <= 0:
            raise UsageError(
                f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
            )
    if not args.runs:
        raise UsageError(
            "no run folders given; pass run folders or a folder of runs, e.g. `python "
            "utils/plot.py runs/`"
        )
    runs = read_runs(args.runs, args.tag)
    out_dir = args.out or os.path.join("runs", f"plots__{int(time.time())}")
    os.makedirs(out_dir, exist_ok=True)

    groups = group_runs(runs)
    by_env = defaultdict(dict)
    for (env_id, label), group in groups.items():
        by_env[env_id][label] = group
    pngs = [
        plot_env(env_id, labelled, args, out_dir) for env_id, labelled in sorted(by_env.items())
    ]
    pngs += [  # utils/launch.py --pbt's populations
        plot_population(path, args, out_dir)
        for path in args.runs
        if os.path.isfile(os.path.join(path, "pbt.jsonl"))
    ]

    table = summary_table(groups, args.last_episodes, args.threshold, args.window)
    notes = noise_notes(groups, args.window, args.threshold) if args.threshold is not None else []
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(table + "".join(f"\n{note}\n" for note in notes))
    print(table)
    for note in notes:
        print(note)
    for path in pngs:
        print(f"wrote {path}")
    print(f"wrote {os.path.join(out_dir, 'summary.md')}")
    return 0


if __name__ == "__main__":
    run_tool(main, PlotArgs)
