"""utils/plot.py and utils/evaluate.py run as a user runs them, on what short real runs wrote.

Subprocesses run one at a time, from the repository root; nothing is written under runs/. Where a
test needs no process of its own, the tool's file runs in this process as its command line runs it
(run_tool_here: its `__main__` block, exit code, stdout and stderr), without ~3 s of imports.
"""

import json
import os
import runpy
import shutil
import subprocess
import sys

import flax.serialization
import numpy as np
import pytest

from helpers import (
    CHECKPOINT,
    REPO_ROOT,
    SCRIPTS,
    assert_ok,
    assert_usage_error,
    cli,
    file_contents,
    load_script,
    marker_code,
    read_checkpoint,
    read_metrics,
    run_script,
    tag_values,
    write_crafted_run,
)

PLOT = "utils/plot.py"
EVALUATE = "utils/evaluate.py"
RETURN_TAG = "charts/episodic_return"


def run_tool_here(tool, argv, monkeypatch, capsys):
    """`python tool argv...` from the repository root, in this process: the tool's file run as
    `__main__` (runpy), so its command line, flags.run_tool's --help and error lines, and its exit
    code are those of a subprocess. Returns a CompletedProcess (as run_script)."""
    path = str(REPO_ROOT / tool)
    argv = [str(token) for token in argv]
    capsys.readouterr()  # what came before is not the tool's
    with monkeypatch.context() as patch:
        patch.chdir(REPO_ROOT)
        patch.syspath_prepend(str(REPO_ROOT / "utils"))  # a script's own folder comes first
        patch.setattr(sys, "argv", [path, *argv])
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(path, run_name="__main__")
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([tool, *argv], exited.value.code, out, err)


# ---------------------------------------------------------------------------------------------
# plot.py
# ---------------------------------------------------------------------------------------------

PLOT_SCRIPT = "ppo_sync_baseline.py"
PLOT_SEEDS = (1, 2)
LAST_EPISODES = 10


@pytest.fixture(scope="module")
def two_seed_runs(tmp_path_factory):
    """A folder holding two ~20k-step CartPole-v1 runs of PLOT_SCRIPT (seeds 1 and 2)."""
    parent = tmp_path_factory.mktemp("plot_runs")
    for seed in PLOT_SEEDS:
        argv = cli(PLOT_SCRIPT, total_timesteps=20_000, seed=seed, run_dir=parent / f"seed{seed}")
        assert_ok(run_script(PLOT_SCRIPT, argv, timeout=500))
    return parent


def summary_rows(markdown):
    """The data rows of the summary table: lists of stripped cells."""
    rows = [
        line.strip().strip("|").split("|")
        for line in markdown.splitlines()
        if line.startswith("| ")
    ]
    rows = [[cell.strip() for cell in row] for row in rows]
    return [row for row in rows[1:] if not set(row[0]) <= set("-:")]  # drop the header and rule


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("pass_parent", "band"),
    [(True, "std"), (False, "minmax")],
    ids=["parent-folder", "run-folders"],
)
def test_plot_curves_and_summary(two_seed_runs, pass_parent, band, tmp_path):
    runs = [two_seed_runs / f"seed{seed}" for seed in PLOT_SEEDS]
    out = tmp_path / "plots"
    folders = [two_seed_runs] if pass_parent else runs
    result = run_script(
        PLOT,
        [*folders, "--out", out, "--band", band, "--last-episodes", LAST_EPISODES],
        timeout=300,
    )
    assert_ok(result)

    png = out / "CartPole-v1.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000, "the figure is nearly empty"
    assert [p.name for p in out.glob("*.png")] == [png.name]

    summary = (out / "summary.md").read_text()
    assert summary.strip() in result.stdout
    rows = summary_rows(summary)
    assert len(rows) == 1, summary
    env_id, script, seeds, steps, final = rows[0][:5]
    assert (env_id, script, seeds) == (
        "CartPole-v1",
        PLOT_SCRIPT[: -len(".py")],
        str(len(PLOT_SEEDS)),
    )

    # Independently: each seed's mean of its last episodes, then mean and population std over seeds.
    finals = [np.mean(tag_values(read_metrics(run), RETURN_TAG)[-LAST_EPISODES:]) for run in runs]
    mean, std = (float(x) for x in final.split("±"))
    assert mean == pytest.approx(np.mean(finals), abs=0.006), (final, finals)
    assert std == pytest.approx(np.std(finals), abs=0.006), (final, finals)
    assert int(steps) == min(max(r["step"] for r in read_metrics(run)) for run in runs)


def fake_run(folder, seed, compile_seconds, episodes, seconds_per_episode):
    """A run folder as a script writes it: a config, games every `seconds_per_episode` after the
    first update, which ends `compile_seconds` after the run's first record."""
    t0 = 1.0e9
    records = [
        {"step": 0, "wall_time": t0, "tag": RETURN_TAG, "value": 10.0},  # a game while compiling
        {"step": 64, "wall_time": t0 + compile_seconds, "tag": "charts/SPS", "value": 100.0},
    ]
    records += [
        {
            "step": 64 * (i + 1),
            "wall_time": t0 + compile_seconds + seconds_per_episode * (i + 1),
            "tag": RETURN_TAG,
            "value": float(i),
        }
        for i in range(episodes)
    ]
    return write_run(folder, "CartPole-v1", seed, records)


def write_run(folder, env_id, seed, records):
    """A run folder as a script writes it: its config and its metrics records."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps({"exp_name": "sync", "env_id": env_id, "seed": seed})
    )
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_plot_wall_clock_starts_at_the_first_update_and_covers_the_longest_seed(tmp_path):
    """One seed compiled for 7.6 s, the other hit the cache (1.2 s) and ran twice as long: both
    curves start at 0 at their first update, the grid reaches the longest seed's end, and the
    band is drawn only where both seeds have data (the issue's panel sat flat at 22 for the
    uncached seed and ended at the shortest seed)."""
    import matplotlib.pyplot as plt

    plot = load_script(REPO_ROOT / PLOT)
    slow = plot.read_run(str(fake_run(tmp_path / "a", 1, 7.6, 50, 1.0)))
    fast = plot.read_run(str(fake_run(tmp_path / "b", 2, 1.2, 100, 1.0)))
    assert (
        slow.seconds[0] == 0.0
        and slow.seconds[1] == pytest.approx(1.0)
        and fast.seconds[1] == pytest.approx(1.0)
    )
    curves = [(run.seconds, run.returns) for run in (slow, fast)]
    grid, ys = plot.resample(curves, 201)
    assert grid[0] == 0.0 and grid[-1] == pytest.approx(100.0)
    _, ax = plt.subplots()
    mean, _, _, band = plot.draw(ax, grid, ys, "std", "sync")
    solid, dashed = (
        ax.get_lines()
    )  # beyond the shorter seed the mean is of one seed: drawn dashed, not as "2 seeds"
    assert (
        solid.get_linestyle() == "-"
        and dashed.get_linestyle() == "--"
        and dashed.get_label().startswith("_")
    )
    assert (
        np.isnan(solid.get_ydata()[grid > 50.0]).all()
        and not np.isnan(solid.get_ydata()[grid <= 50.0]).any()
    )
    assert not np.isnan(dashed.get_ydata()[grid > 50.0]).any()
    plt.close("all")
    assert band[grid <= 50.0].all() and not band[grid > 50.0].any()
    assert mean[-1] == pytest.approx(99.0)  # the longest seed's last game, not cut
    assert mean[grid == 30.0] == pytest.approx(29.0)  # both seeds at 30 s after their first update


def test_plot_tabulates_steps_and_seconds_to_a_threshold(tmp_path):
    """Returns 0, 1, 2, ... a game (64 steps and 1 s apart after the first update): the first
    full 20-game mean >= 45 ends at game 55 (mean 45.5), so 56 x 64 steps and 56 s; the seed of
    50 games never gets there (its best mean: 39.5)."""
    plot = load_script(REPO_ROOT / PLOT)
    runs = [
        plot.read_run(str(fake_run(tmp_path / "a", 1, 7.6, 50, 1.0))),
        plot.read_run(str(fake_run(tmp_path / "b", 2, 1.2, 100, 1.0))),
    ]
    assert plot.reached(runs[0], 20, 45.0) is None
    steps, seconds = plot.reached(runs[1], 20, 45.0)
    assert steps == 56 * 64 and seconds == pytest.approx(56.0)
    row = plot.summary_table({("CartPole-v1", "sync"): runs}, 20, 45.0, 20).splitlines()[-1]
    assert "| 1/2 | 3584 ± 0 | 56.0 ± 0.0 | 64.50 |" in row, row


def configured_run(folder, env_id, seed, flags, start=1.0e9, value=1.0):
    """A run folder with a config.json of `flags` (as a script writes it: every flag) and 10
    games."""
    write_run(
        folder,
        env_id,
        seed,
        [
            {"step": 64 * (i + 1), "wall_time": start + i, "tag": RETURN_TAG, "value": value}
            for i in range(10)
        ],
    )
    config = dict(
        flags,
        env_id=env_id,
        seed=seed,
        run_dir=str(folder),
        compile_cache="/somewhere",
        save_interval=50,
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_plot_groups_runs_by_their_whole_configuration(tmp_path, capsys):
    """An async and a --serial DQN run of seed 1 and two Acrobot runs of seed 1 with other budgets
    were each merged into one curve ("1: 488.05, 1: 340.85"). Runs group by every flag but the
    seed and those of the record (folder, cache, checkpoints), labelled by what differs: the async
    runs' two seeds are one group; the serial run and each budget are their own."""
    plot = load_script(REPO_ROOT / PLOT)
    dqn = {"exp_name": "dqn_envpool", "learning_rate": 1e-4}
    configured_run(tmp_path / "async1", "CartPole-v1", 1, dict(dqn, serial=False), value=488.0)
    configured_run(tmp_path / "async2", "CartPole-v1", 2, dict(dqn, serial=False), value=400.0)
    configured_run(tmp_path / "serial1", "CartPole-v1", 1, dict(dqn, serial=True), value=340.0)
    for budget in (20_000, 40_000):
        configured_run(
            tmp_path / f"acrobot{budget}",
            "Acrobot-v1",
            1,
            {"exp_name": "ppo", "total_timesteps": budget},
        )
    assert plot.main(plot.PlotArgs(runs=[str(tmp_path)], out=str(tmp_path / "plots"))) == 0
    rows = summary_rows((tmp_path / "plots" / "summary.md").read_text())
    assert [row[:3] + row[4:5] + row[5:] for row in rows] == [
        ["Acrobot-v1", "ppo total-timesteps=20000", "1", "1.00 ± 0.00", "-", "1: 1.00"],
        ["Acrobot-v1", "ppo total-timesteps=40000", "1", "1.00 ± 0.00", "-", "1: 1.00"],
        [
            "CartPole-v1",
            "dqn_envpool no-serial",
            "2",
            "444.00 ± 44.00",
            "-",
            "1: 488.00, 2: 400.00",
        ],
        ["CartPole-v1", "dqn_envpool serial", "1", "340.00 ± 0.00", "-", "1: 340.00"],
    ], rows
    assert capsys.readouterr().err == ""


def test_plot_draws_two_runs_of_one_seed_apart(tmp_path, capsys):
    """Two runs of the same configuration and seed (a repeat of an asynchronous run) are no two
    seeds: drawn apart, "repeat 2", with a warning naming the second (they were averaged)."""
    plot = load_script(REPO_ROOT / PLOT)
    configured_run(tmp_path / "a", "CartPole-v1", 1, {"exp_name": "appo"}, value=500.0)
    configured_run(tmp_path / "b", "CartPole-v1", 1, {"exp_name": "appo"}, value=100.0)
    configured_run(tmp_path / "c", "CartPole-v1", 2, {"exp_name": "appo"}, value=300.0)
    assert plot.main(plot.PlotArgs(runs=[str(tmp_path)], out=str(tmp_path / "plots"))) == 0
    rows = summary_rows((tmp_path / "plots" / "summary.md").read_text())
    assert [(row[1], row[2], row[6]) for row in rows] == [
        ("appo", "2", "1: 500.00, 2: 300.00"),
        ("appo repeat 2", "1", "1: 100.00"),
    ], rows
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {tmp_path / 'b'} has the configuration and the seed (1) of another run: drawn "
        f"apart, as repeat 2"
    ]


def test_plot_skips_a_run_whose_config_has_a_wrong_type_and_names_the_file_and_key(
    tmp_path, capsys
):
    """config.json is a file anyone may edit: an env_id that is a list drew `_x_.png`. In a folder
    of runs, one whose config plot cannot read is skipped with one warning line naming the file and
    the key, and the others are plotted; named on its own, it is an error (exit 2)."""
    plot = load_script(REPO_ROOT / PLOT)
    configured_run(tmp_path / "good", "CartPole-v1", 1, {"exp_name": "appo"}, value=500.0)
    bad = {
        "env": ("CartPole-v1", 1, {"exp_name": "appo", "env_id": ["x"]}),
        "name": ("CartPole-v1", 2, {"exp_name": 3}),
        "seed": ("CartPole-v1", "7", {"exp_name": "appo"}),
        "resumes": ("CartPole-v1", 3, {"exp_name": "appo", "resumes": [{"wall_time": "soon"}]}),
    }
    for name, (env_id, seed, flags) in bad.items():
        configured_run(tmp_path / name, env_id, seed, {})
        (tmp_path / name / "config.json").write_text(
            json.dumps(dict({"env_id": env_id, "seed": seed}, **flags))
        )
    (tmp_path / "json").mkdir()
    shutil.copy(tmp_path / "good" / "metrics.jsonl", tmp_path / "json")
    (tmp_path / "json" / "config.json").write_text("{not json")
    out = tmp_path.parent / f"{tmp_path.name}-plots"
    assert plot.main(plot.PlotArgs(runs=[str(tmp_path)], out=str(out))) == 0
    assert sorted(os.listdir(out)) == ["CartPole-v1.png", "summary.md"]
    assert [row[1:3] for row in summary_rows((out / "summary.md").read_text())] == [["appo", "1"]]
    warnings = capsys.readouterr().err.splitlines()
    keys = {
        "env": "\"env_id\" is ['x']",
        "name": '"exp_name" is 3',
        "seed": "\"seed\" is '7'",
        "resumes": '"resumes"[0]',
        "json": "is not JSON",
    }
    assert len(warnings) == len(keys), warnings
    for name, key in keys.items():
        prefix = f"warning: skipped {tmp_path / name}: {tmp_path / name / 'config.json'}"
        assert any(line.startswith(prefix) and key in line for line in warnings), (name, warnings)
    with pytest.raises(plot.UsageError, match='env.config.json: "env_id" is'):
        plot.main(plot.PlotArgs(runs=[str(tmp_path / "env")], out=str(tmp_path / "none")))


@pytest.mark.parametrize(
    "key, value, lines, reason",
    [
        (
            "wall_time",
            float("nan"),
            range(10),
            "a wall_time of nan",
        ),  # each: "seconds to 100: 0.0 ± 0.0"
        ("step", float("inf"), [2], "a step of inf"),  # an OverflowError traceback
        ("value", 10**400, [2], "OverflowError"),
        (None, "[" * 100_000, [2], "RecursionError"),
    ],
    ids=["wall-time-nan", "step-infinity", "value-too-large", "nested-too-deep"],
)
def test_plot_names_a_metrics_line_with_a_non_finite_step_or_time(
    tmp_path, capsys, key, value, lines, reason
):
    """A metrics.jsonl line whose step or wall_time is not finite (a run writes neither), or that
    json reads with an OverflowError or RecursionError, is not a record: one line naming the file
    and the line, a warning and a skip inside a folder of runs, never a traceback nor a figure
    made of it."""
    plot = load_script(REPO_ROOT / PLOT)
    configured_run(tmp_path / "good", "CartPole-v1", 1, {"exp_name": "appo"}, value=500.0)
    bad = configured_run(tmp_path / "bad", "CartPole-v1", 2, {"exp_name": "appo"})
    records = (bad / "metrics.jsonl").read_text().splitlines()
    for i in lines:
        records[i] = json.dumps(dict(json.loads(records[i]), **{key: value})) if key else value
    (bad / "metrics.jsonl").write_text("\n".join(records) + "\n")
    line = lines[0] + 1
    expected = f"{bad / 'metrics.jsonl'} line {line} is not a metrics record ({reason})"
    with pytest.raises(plot.UsageError) as error:
        plot.main(plot.PlotArgs(runs=[str(bad)], out=str(tmp_path / "none"), threshold=100.0))
    assert str(error.value) == expected and not (tmp_path / "none").exists()
    out = tmp_path.parent / f"{tmp_path.name}-plots"
    assert plot.main(plot.PlotArgs(runs=[str(tmp_path)], out=str(out), threshold=100.0)) == 0
    assert [row[1:3] for row in summary_rows((out / "summary.md").read_text())] == [["appo", "1"]]
    assert capsys.readouterr().err.splitlines() == [f"warning: skipped {bad}: {expected}"]


def test_plot_says_a_runs_returns_are_not_finite(tmp_path):
    """A run whose every episodic return is NaN was reported as "no episode has finished; train
    longer": its returns are named as not finite, with the file."""
    plot = load_script(REPO_ROOT / PLOT)
    nan = configured_run(
        tmp_path / "nan", "CartPole-v1", 1, {"exp_name": "appo"}, value=float("nan")
    )
    with pytest.raises(plot.UsageError) as error:
        plot.main(plot.PlotArgs(runs=[str(nan)], out=str(tmp_path / "none")))
    message = str(error.value)
    assert str(nan / "metrics.jsonl") in message and "NaN or infinite" in message, message
    assert "train longer" not in message and "\n" not in message


def test_plot_wall_clock_counts_training_time_only(tmp_path, monkeypatch):
    """A run stopped after 100 s and resumed 900 s later: the time axis counts each start from its
    first update to its last record (95 s, then 90 s), not the 900 s between (a flat line that made
    the resumed configuration look 5x slower), and marks the resume. The axis label fits in the
    PNG (it was cut off at the right edge)."""
    plot = load_script(REPO_ROOT / PLOT)
    t0, records = 1.0e9, []
    for start, first_step in (
        (t0, 0),
        (t0 + 1000, 6400),
    ):  # each start: a game while compiling, the update at 5/10 s
        compile_seconds = 5 if start == t0 else 10
        records += [
            {"step": first_step, "wall_time": start, "tag": RETURN_TAG, "value": 1.0},
            {
                "step": first_step + 64,
                "wall_time": start + compile_seconds,
                "tag": "charts/SPS",
                "value": 1.0,
            },
        ]
        records += [
            {
                "step": first_step + 64 * (i + 1),
                "wall_time": start + compile_seconds + i + 1,
                "tag": RETURN_TAG,
                "value": 2.0,
            }
            for i in range(100 - compile_seconds)
        ]
    folder = write_run(tmp_path / "run", "CartPole-v1", 1, records)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(dict(config, resumes=[{"step": 6400, "wall_time": t0 + 1000}]))
    )
    run = plot.read_run(str(folder))
    assert run.seconds.max() == pytest.approx(95 + 90) and run.resumed_at == [pytest.approx(95)]
    assert run.seconds[run.steps == 6400] == 95 and run.seconds[
        run.steps == 6400 + 64
    ] == pytest.approx(95 + 1)

    figures = []
    monkeypatch.setattr(plot.plt, "close", figures.append)
    plot.plot_env("CartPole-v1", {"sync": [run]}, plot.PlotArgs(runs=[str(folder)]), str(tmp_path))
    renderer = figures[0].canvas.get_renderer()
    for ax in figures[0].axes:
        box = ax.xaxis.label.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= figures[0].bbox.x1, (
            ax.xaxis.label.get_text(),
            box,
            figures[0].bbox,
        )
    dotted = [line for line in figures[0].axes[1].get_lines() if line.get_linestyle() == ":"]
    assert [line.get_xdata()[0] for line in dotted] == [pytest.approx(95)]
    assert (
        "dashed where some seeds have ended" in figures[0]._suptitle.get_text()
    )  # what a dashed mean is
    monkeypatch.undo()
    plot.plt.close(figures[0])


def binary_run(folder, episodes, p_win, seed):
    """A run of `episodes` games of 6 steps, each won (return 1) with probability `p_win`."""
    wins = np.random.default_rng(seed).random(episodes) < p_win
    records = [
        {"step": 6 * (i + 1), "wall_time": 1.0e9 + i, "tag": RETURN_TAG, "value": float(w)}
        for i, w in enumerate(wins)
    ]
    return write_run(folder, "MiniGrid-MemoryS7-v0", seed, records)


def test_plot_notes_a_threshold_a_short_window_crosses_by_chance(tmp_path):
    """Games won at 62% and never more: the best 20-game mean of 30,000 games passes 0.9 by
    chance alone, and plot.py says so (its estimate of the excess within 15% of the excess
    measured); over 2,000 games no window reaches 0.7 and there is no note; a steadily learning
    run (returns 0, 1, 2, ...) gets none either."""
    plot = load_script(REPO_ROOT / PLOT)
    folder = binary_run(tmp_path / "memory", 30_000, 0.62, 1)
    run = plot.read_run(str(folder))
    means = plot.full_windows(run, 20)[0]
    assert plot.reached(run, 20, 0.9) is not None  # a plateau of 0.62 "reaches" 0.9
    assert plot.chance_excess(run, 20) == pytest.approx(means.max() - 0.62, rel=0.15)
    notes = plot.noise_notes({("MiniGrid-MemoryS7-v0", "sync"): [run]}, 20, 0.9)
    assert len(notes) == 1 and "--window" in notes[0], notes
    assert (
        plot.main(plot.PlotArgs(runs=[str(folder)], out=str(tmp_path / "plots"), threshold=0.9))
        == 0
    )
    assert (
        notes[0] in (tmp_path / "plots" / "summary.md").read_text()
    )  # the table's reader sees it too
    assert plot.reached(run, 2000, 0.7) is None
    assert plot.noise_notes({("MiniGrid-MemoryS7-v0", "sync"): [run]}, 2000, 0.7) == []
    learning = plot.read_run(str(fake_run(tmp_path / "learning", 1, 1.0, 100, 1.0)))
    assert (
        plot.chance_excess(learning, 20) < 1
        and plot.noise_notes({("CartPole-v1", "sync"): [learning]}, 20, 45.0) == []
    )


def no_metrics(tmp_path):
    folder = tmp_path / "empty_run"
    folder.mkdir()
    return folder


def no_returns(tmp_path):
    folder = tmp_path / "no_episode_yet"
    folder.mkdir()
    record = {"step": 64, "wall_time": 1.0e9, "tag": "charts/SPS", "value": 100.0}
    (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return folder


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("make_folder", "fragment"),
    [(no_metrics, "metrics.jsonl"), (no_returns, RETURN_TAG)],
    ids=["no-metrics", "no-returns"],
)
def test_plot_rejects_folder_without_returns(make_folder, fragment, tmp_path):
    out = tmp_path / "plots"
    result = run_script(PLOT, [make_folder(tmp_path), "--out", out], timeout=100)
    assert_usage_error(result, fragment)
    assert not out.exists()


TOOLS = ["utils/plot.py", "utils/evaluate.py", "utils/launch.py", "utils/benchmark.py"]


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tools_help_is_in_the_scripts_style(tool, monkeypatch, capsys):
    """--help of a tool reads as a script's (flags.help_text: usage, description, its arguments,
    its flags each with a plain metavar, text and default, within 100 columns), not tyro's box;
    a misspelt flag is one line naming the nearest. (In this process: run_tool_here.)"""
    result = run_tool_here(tool, ["--help"], monkeypatch, capsys)
    assert_ok(result)
    text = result.stdout
    assert text.startswith(f"usage: {tool.split('/')[1]} ") and "\nflags:\n" in text, text
    assert (
        "╭" not in text
        and "{None}" not in text
        and max(len(line) for line in text.splitlines()) <= 100
    )
    assert text.endswith("  -h, --help\n      show this help and exit\n")
    result = run_tool_here(tool, ["--outt", "x"], monkeypatch, capsys)
    assert_usage_error(result, "unknown flag --outt; did you mean --out?")


# ---------------------------------------------------------------------------------------------
# evaluate.py
# ---------------------------------------------------------------------------------------------


def test_the_tools_know_every_tested_script():
    """utils/ and the tests agree on which scripts exist (the benchmark's list, helpers.SCRIPTS)."""
    assert sorted(load_script("utils/benchmark.py").SCRIPTS) == sorted(SCRIPTS)


# evaluate.py calls a script's build, make_policy_step and zero_core, the same text in every script
# (test_scripts.SAME_TEXT): the baseline's checkpoints, and the XLA actor's, whose module differs
# most.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", ["ppo_sync_baseline.py", "appo_envpool_xla.py"], indirect=True)
def test_evaluate_scores_checkpoint(script, cartpole_run, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(cartpole_run, run)
    before = file_contents(run)
    saved_step = int(read_checkpoint(run)["state"]["global_step"])

    # A run folder, greedy, a video, the default output file.
    result = run_script(EVALUATE, [run, "--episodes", 3, "--greedy", "--video"], timeout=300)
    assert_ok(result)
    greedy = json.loads((run / "eval.json").read_text())
    check_eval_result(greedy, 3, run / CHECKPOINT, saved_step, greedy=True)
    videos = list((run / "videos").glob("evaluate__*/*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 0, list((run / "videos").rglob("*"))
    assert greedy["videos"] == [str(videos[0])]
    assert f"{greedy['mean']:.2f}" in result.stdout
    assert (
        "3 episodes with the most likely action" in result.stdout
        and "evaluation samples" in result.stdout
    )

    # The checkpoint file itself, sampled actions, --out (in this process: the subprocess above
    # is the user's command line).
    out = tmp_path / "sampled" / "result.json"
    result = run_tool_here(
        EVALUATE, [run / CHECKPOINT, "--episodes", 4, "--out", out], monkeypatch, capsys
    )
    assert_ok(result)
    assert (
        "4 episodes with the run's own evaluation policy, actions sampled from it; the run's own "
        "evaluation "
        "played 2 at the end of training" in result.stdout
    ), result.stdout
    check_eval_result(json.loads(out.read_text()), 4, run / CHECKPOINT, saved_step, greedy=False)

    after = file_contents(run)
    assert {name: after[name] for name in before} == before, "evaluate.py changed the run's files"


def check_eval_result(result, episodes, checkpoint, global_step, greedy):
    assert {"episodes", "mean", "std", "scores", "checkpoint", "global_step", "greedy"} <= set(
        result
    )
    assert result["episodes"] == episodes and len(result["scores"]) == episodes, result
    assert all(1 <= score <= 500 for score in result["scores"]), result
    assert result["mean"] == pytest.approx(np.mean(result["scores"]))
    assert result["std"] == pytest.approx(np.std(result["scores"]))
    assert result["checkpoint"] == str(checkpoint)
    assert result["global_step"] == global_step
    assert result["greedy"] is greedy


def write_msgpack(tmp_path, payload):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / CHECKPOINT).write_bytes(flax.serialization.msgpack_serialize(payload))
    return folder


def random_bytes(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / CHECKPOINT).write_bytes(np.random.default_rng(0).bytes(4096))
    return folder


# id -> (function tmp_path -> the path passed to evaluate.py, fragments the error line must name)
BAD_CHECKPOINTS = {
    "missing-path": (lambda tmp: tmp / "no_such_run", ["no_such_run", "does not exist"]),
    "no-checkpoint": (lambda tmp: tmp, ["no checkpoint", CHECKPOINT]),
    "random-bytes": (random_bytes, ["not a readable checkpoint", "corrupt"]),
    "foreign-msgpack": (
        lambda tmp: write_msgpack(tmp, {"weights": np.zeros(3)}),
        ["not a checkpoint of this project"],
    ),
    "script-path-as-name": (
        lambda tmp: write_msgpack(tmp, {"state": {}, "config": "{}", "script": "../train.py"}),
        ["../train.py", "not a script's file name"],
    ),
    "script-nowhere": (
        lambda tmp: write_msgpack(
            tmp, {"state": {}, "config": '{"env_id": "CartPole-v1"}', "script": "gone.py"}
        ),
        ["gone.py", "--script"],
    ),
    "config-without-env-id": (
        lambda tmp: write_msgpack(
            tmp, {"state": {}, "config": "{}", "script": "ppo_sync_baseline.py"}
        ),
        ["not a checkpoint of this project"],
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_evaluate_rejects_bad_checkpoint(case, tmp_path, monkeypatch, capsys):
    make_path, fragments = BAD_CHECKPOINTS[case]
    result = run_tool_here(EVALUATE, [make_path(tmp_path)], monkeypatch, capsys)
    assert_usage_error(result, *fragments)


@pytest.mark.timeout(300)
def test_evaluating_a_crafted_folder_runs_no_code(tmp_path):
    """A checkpoint is data: evaluate.py makes no env whose module the config names (os:system
    with a shell command) without --trust-env-module, and imports no script the checkpoint points
    to or that lies next to it (or above it): only the repository's script of the recorded name,
    or --script. The controls show that each route is live."""
    marker = tmp_path / "marker"
    shell = write_crafted_run(
        tmp_path / "shell",
        "ppo_sync_baseline.py",
        dict(env_id="os:system", env_kwargs=json.dumps({"command": f"touch {marker}"})),
    )
    assert_usage_error(
        run_script(EVALUATE, [shell], timeout=100), "'os'", "os:system", "--trust-env-module"
    )
    planted = tmp_path / "elsewhere" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(marker_code(marker))
    own = write_crafted_run(
        tmp_path / "own" / "run", "planted.py", dict(env_id="CartPole-v1"), script_path=planted
    )
    for folder in (own, own.parent):
        (folder / "planted.py").write_text(marker_code(marker))
    assert_usage_error(run_script(EVALUATE, [own], timeout=100), "planted.py", "--script")
    # A repository script's name, with files of that name where the checkpoint points and next to
    # it: the repository's own plays it (this toy state does not fit it: exit 2).
    named = write_crafted_run(
        tmp_path / "named" / "run",
        "ppo_sync_baseline.py",
        dict(env_id="CartPole-v1"),
        script_path=tmp_path / "named" / "ppo_sync_baseline.py",
    )
    for folder in (named, named.parent):
        (folder / "ppo_sync_baseline.py").write_text(marker_code(marker))
    result = run_script(EVALUATE, [named], timeout=200)
    assert result.returncode == 2 and "does not match" in result.stderr, result.stderr[-2000:]
    assert not marker.exists(), "evaluating a run folder ran its code"
    assert (
        run_script(EVALUATE, [own, "--script", planted], timeout=100).returncode == 2
        and marker.exists()
    )
    marker.unlink()
    assert (
        run_script(EVALUATE, [shell, "--trust-env-module"], timeout=100).returncode == 2
        and marker.exists()
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", ["appo_envpool.py"], indirect=True)
def test_evaluate_rejects_config_the_script_lacks(
    script, cartpole_run, tmp_path, monkeypatch, capsys
):
    """A checkpoint whose config has a field the script's Args does not: another version wrote
    it."""
    payload = read_checkpoint(cartpole_run)
    payload["config"] = json.dumps(dict(json.loads(payload["config"]), no_such_flag=3))
    result = run_tool_here(EVALUATE, [write_msgpack(tmp_path, payload)], monkeypatch, capsys)
    assert_usage_error(result, "no_such_flag", script)


@pytest.mark.timeout(600)
def test_a_copied_and_edited_script_runs_anywhere_and_is_scored(tmp_path):
    """ "Copy one script and edit it": a renamed copy outside the repository, with a default edited,
    runs from its own folder (the run library is installed, not beside it) and takes the edit; its
    checkpoint is scored with the copy the user names (--script: evaluate.py imports no file a
    checkpoint points to), also once both moved; without it, or with a file that is no training
    script, exit 2."""
    copy = tmp_path / "my_appo.py"
    text = (REPO_ROOT / "appo_envpool.py").read_text()
    edited = text.replace(
        "    queue_size: Annotated[int, POSITIVE, at_most(1024)] = 2\n",
        "    queue_size: Annotated[int, POSITIVE, at_most(1024)] = 1\n",
    )
    assert edited != text
    copy.write_text(edited)
    run = tmp_path / "run"
    flags = [token for token in map(str, cli("appo_envpool.py", run_dir=run))]
    flags = [
        t
        for i, t in enumerate(flags)
        if t != "--queue-size" and (i == 0 or flags[i - 1] != "--queue-size")
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, str(copy), *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_ok(result)
    assert read_checkpoint(run)["script"] == "my_appo.py"
    config = json.loads((run / "config.json").read_text())
    assert (
        config["queue_size"] == 1 and config["exp_name"] == "my_appo"
    )  # the edited default, the copy's name

    result = run_script(EVALUATE, [run, "--episodes", 2, "--script", copy], timeout=300)
    assert_ok(result)
    assert json.loads((run / "eval.json").read_text())["script"] == "my_appo.py"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(copy, elsewhere / "my_appo.py")
    shutil.move(run, elsewhere / "run")
    assert_ok(
        run_script(
            EVALUATE,
            [elsewhere / "run", "--episodes", 2, "--script", elsewhere / "my_appo.py"],
            timeout=300,
        )
    )
    assert_usage_error(
        run_script(EVALUATE, [elsewhere / "run"], timeout=100), "my_appo.py", "--script"
    )
    not_a_script = tmp_path / "notes.py"
    not_a_script.write_text("NOTES = 1\n")
    result = run_script(EVALUATE, [elsewhere / "run", "--script", not_a_script], timeout=100)
    assert_usage_error(result, "notes.py", "interface")


@pytest.mark.timeout(300)
# The scripts that had older versions
@pytest.mark.parametrize(
    "script", ["ppo_sync_baseline.py", "appo_envpool.py", "impala_envpool.py"], indirect=True
)
def test_evaluate_scores_a_checkpoint_of_an_older_version(
    script, cartpole_run, tmp_path, monkeypatch, capsys
):
    """Only the parameters (and the normaliser) are needed to play: an optimiser state of another
    structure, and a config from before the normalisation flags existed, still evaluate."""
    payload = read_checkpoint(cartpole_run)
    payload["state"]["opt_state"] = {"0": {"count": np.zeros(())}}
    config = json.loads(payload["config"])
    del config["norm_obs"], config["norm_reward"]
    # They had --xla-actor before appo_envpool_xla.py
    config["xla_actor"] = script in ("appo_envpool.py", "impala_envpool.py")
    payload["config"] = json.dumps(config)
    result = run_tool_here(
        EVALUATE, [write_msgpack(tmp_path, payload), "--episodes", 2], monkeypatch, capsys
    )
    assert_ok(result)
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["episodes"] == 2
