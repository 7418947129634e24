"""Each script in helpers.SCRIPTS: its size and its diffs, smoke runs (as a user runs it, and its
execution modes), its presets and --help, SIGTERM and resume through its own loop, a diverging
loss, Ctrl-C while it imports, and learning CartPole-v1 and HalfCheetah-v4. The run library
behind them is tested once, in tests/test_lib_*.py."""

import ast
import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jax_async_rl.flags import ELSEWHERE
from jax_async_rl.helptext import help_text
from helpers import (
    help_flags,
    interrupt,
    CHECKPOINT,
    REPO_ROOT,
    SCRIPT_TABLE,
    TINY_BATCH,
    TINY_FLAGS,
    assert_ok,
    assert_usage_error,
    check_run_files,
    cli,
    count_complete_lines,
    load_script,
    read_checkpoint,
    read_metrics,
    run_main,
    run_script,
    sigterm_when,
    start_script,
    tag_steps,
    tag_values,
    wait_until,
)

# ---------------------------------------------------------------------------------------------
# The files side by side: sizes and diffs (the redesign's targets)
# ---------------------------------------------------------------------------------------------

# Each script's lines as `ruff format` lays them out at 100 columns (pyproject.toml), with a margin
# of about a tenth: a guard against bloat, not a target. Measured on the formatted code, where a
# call that does not fit takes one argument a line (issue 46: 881-1,424 lines for the PPO family,
# 662-1,280 for the replay family once their loops were on the page).
LINE_BUDGET = {
    "ppo_sync_baseline.py": 1150,
    "appo_envpool.py": 1300,
    "impala_envpool.py": 1000,
    "appo_envpool_xla.py": 1550,
    "dqn_envpool.py": 1400,
    "sac_envpool.py": 800,
    "td3_envpool.py": 750,
}
# Lines that `diff A B` adds (`grep -c '^>'`): what B changes, and only that.
ADDED_LINES = [
    ("ppo_sync_baseline.py", "appo_envpool.py", 350),
    ("appo_envpool.py", "impala_envpool.py", 130),
    ("appo_envpool.py", "appo_envpool_xla.py", 380),
    ("sac_envpool.py", "td3_envpool.py", 130),
]
# A guard against a module that grows into two: the largest, runs.py, holds about 580 lines.
LIBRARY_MODULE_BUDGET = 650
# The anchors' density (CleanRL's dqn_jax.py and td3_continuous_action_jax.py, Cleanba's
# cleanba_ppo.py: 41-45 characters a code line): a line holds one step of the algorithm.
MEAN_CODE_LINE = 52
WIDTH = 100  # the formatter's (pyproject.toml); comments and docstrings fold there too


def preset_table_flags(module) -> set:
    """The flags `module`'s PRESETS fills, less those it refers to the other scripts
    (flags.ELSEWHERE: the XLA script shares APPO's table, self-play's flags included)."""
    own = {field.name for field in dataclasses.fields(module.Args)}
    keys = {k for values in module.PRESETS.values() for k in values}
    return keys - (set(ELSEWHERE) - own)


def added_lines(old, new) -> int:
    result = subprocess.run(
        ["diff", REPO_ROOT / old, REPO_ROOT / new], capture_output=True, text=True
    )
    return sum(line.startswith(">") for line in result.stdout.splitlines())


def code_lines(path) -> list:
    """The non-blank lines of code of a file: comments and docstrings aside."""
    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = text.splitlines()
    return [
        line
        for number, line in enumerate(lines, 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    ]


def packed(path) -> list:
    """What was packed to fit a line cap: a walrus, or more than three names assigned a tuple of
    values at once (unpacking a call's result, as `envs.recv()`, is the API's shape, not
    packing)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.NamedExpr):
            found.append((node.lineno, "walrus"))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            if any(isinstance(t, ast.Tuple) and len(t.elts) > 3 for t in node.targets):
                found.append((node.lineno, "tuple"))
    return sorted(found)


CODE = sorted(LINE_BUDGET) + sorted(
    str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "jax_async_rl").glob("*.py")
)


def test_every_file_reads_at_the_anchors_density():
    """Scripts and library: at most MEAN_CODE_LINE characters a code line on average, no line
    past WIDTH columns but a string that no formatter can break (at most 30 in all), nothing
    packed to meet a cap."""
    wide = []
    for name in CODE:
        path = REPO_ROOT / name
        code = code_lines(path)
        if code:
            mean = sum(len(line) for line in code) / len(code)
            assert mean <= MEAN_CODE_LINE, f"{name}: {mean:.1f} characters a code line"
        wide += [
            f"{name}:{i}"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if len(line) > WIDTH
        ]
        assert not packed(path), (name, packed(path))
    assert len(wide) <= 30, wide


def test_the_layout_checks_see_packing(tmp_path):
    path = tmp_path / "packed.py"
    path.write_text(
        'def f(t):\n    """A docstring, not code."""\n    # a comment\n\n'
        "    t['env'] += (now := time.perf_counter()) - start\n"
        "    a, b, c, d = 1, 2, 3, 4\n    w, x, y, z = g()\n"
    )
    assert [len(line) for line in code_lines(path)] == [9, 52, 27, 20]
    assert packed(path) == [(5, "walrus"), (6, "tuple")]


def test_scripts_are_lean_and_their_diffs_show_the_idea():
    """Users copy one script and read the diffs: each holds its algorithm within its line budget,
    and `diff` adds no more than its bound. A script imports the run library, never a sibling
    script nor utils/."""
    local = re.compile(
        r"^\s*(from|import) "
        r"+(utils|common|ppo_sync_baseline|appo_envpool|impala_envpool|appo_envpool_xla)\b",
        re.M,
    )
    for name, budget in LINE_BUDGET.items():
        text = (REPO_ROOT / name).read_text()
        lines = text.splitlines()
        assert len(lines) <= budget, f"{name}: {len(lines)} lines, budget {budget}"
        assert not local.search(text), (name, local.findall(text))
    for old, new, bound in ADDED_LINES:
        assert added_lines(old, new) <= bound, (
            f"diff {old} {new} adds {added_lines(old, new)} lines, bound {bound}"
        )


def test_the_run_library_is_small_modules_that_import_no_script():
    for path in sorted((REPO_ROOT / "jax_async_rl").glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= LIBRARY_MODULE_BUDGET, (
            f"{path.name}: {len(text.splitlines())} lines"
        )
        assert not re.search(
            r"^\s*(from|import) +(utils|ppo_sync_baseline|\w*_envpool\w*)\b", text, re.M
        ), path.name


def test_no_library_modules_import_each_other():
    """The library's imports (at any depth in a module, so a deferred import counts) form no cycle:
    each shared name has one home below the modules that use it."""
    modules = {path.stem: path for path in (REPO_ROOT / "jax_async_rl").glob("*.py")}
    imports = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("jax_async_rl")
            ):
                tail = node.module.split(".")[1:] or [alias.name for alias in node.names]
                imports[name] |= {t for t in tail if t in modules}
            elif isinstance(node, ast.Import):
                imports[name] |= {
                    a.name.split(".")[1] for a in node.names if a.name.startswith("jax_async_rl.")
                }
    assert imports["runs"] and imports["threads"], (
        "the walk found no imports: the test reads nothing"
    )

    def below(name, seen):  # every module `name` reaches through its imports
        for other in imports[name] - seen:
            seen.add(other)
            below(other, seen)
        return seen

    assert not [name for name in modules if name in below(name, set())]


# The skeleton (docs/DESIGN.md, rule 1): the sections in this order, and the loops where a reader
# of any script finds them: acting in Sampling, learning in Learning, the threads started in main.
SECTIONS = ["Network", "Math", "Sampling", "Learning", "Main"]
HOMES = {
    "resolve_args": None,  # before the first section: with Args and PRESETS
    "collect_rollout": "Sampling",
    "collect": "Sampling",
    "actor_loop": "Sampling",
    "learn_round": "Learning",
    "learner_loop": "Learning",
    "serial_loop": "Learning",
    "make_update": "Learning",
    "build": "Main",
    "main": "Main",
}


@pytest.mark.parametrize("script", list(LINE_BUDGET))
def test_every_script_keeps_the_skeleton_s_order(script):
    lines = (REPO_ROOT / script).read_text().splitlines()
    headers = [
        (i + 1, lines[i + 1][2:].split()[0].rstrip("s"))
        for i, line in enumerate(lines[:-1])
        if line.startswith("# ----") and lines[i + 1].startswith("# ")
    ]
    assert [name for _, name in headers] == SECTIONS, headers
    tree = ast.parse("\n".join(lines))
    defined = {node.name: node.lineno for node in tree.body if isinstance(node, ast.FunctionDef)}
    args = [node.lineno for node in tree.body if getattr(node, "name", None) == "Args"]
    assert args and args[0] < headers[0][0]
    loops = {"actor_loop", "collect_rollout"} & set(defined)
    assert loops and "learner_loop" in defined or script == "ppo_sync_baseline.py", script
    for name, home in HOMES.items():
        if name not in defined:
            continue
        section = [header for line, header in headers if line < defined[name]]
        assert (section[-1] if section else None) == home, (script, name, section[-1:])


# A screen: a reader at a flag whose default is the task's preset finds the PRESETS table within
# this many lines of it (issue 46). DQN's 28 such flags take 65 lines with their help, more than a
# screen on their own: the table right above them is 76 lines from the last.
SCREEN = 50
SCREEN_EXCEPT = {"dqn_envpool.py": 76}


def test_the_presets_table_is_within_a_screen_of_the_flags_it_fills():
    """In each script, every flag that a PRESETS entry fills is marked PRESET (--help's "(default:
    preset)"), defaults to None and lies within SCREEN lines of the PRESETS table; every flag
    marked PRESET does too (a table of none: the replay scripts' `PRESETS = {}`)."""
    import typing

    from jax_async_rl.flags import PRESET

    for name in LINE_BUDGET:
        module = load_script(name)
        tree = ast.parse((REPO_ROOT / name).read_text())
        table = next(
            node
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(getattr(target, "id", None) == "PRESETS" for target in node.targets)
        )
        args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
        lines = {n.target.id: n.lineno for n in args.body if isinstance(n, ast.AnnAssign)}
        hints = typing.get_type_hints(module.Args, include_extras=True)
        marked = {k for k, hint in hints.items() if PRESET in getattr(hint, "__metadata__", ())}
        keys = preset_table_flags(module)
        assert keys <= marked, f"{name}: PRESETS fills {keys - marked}, not marked PRESET"
        defaults = {f.name: f.default for f in dataclasses.fields(module.Args)}
        assert all(defaults[k] is None for k in marked), name
        limit = SCREEN_EXCEPT.get(name, SCREEN)
        for field in marked:
            assert field in lines, f"{name}: {field} is not declared in Args"
            line = lines[field]
            distance = max(table.lineno - line, line - table.end_lineno, 0)
            assert distance <= limit, f"{name}: {field} is {distance} lines from PRESETS"


# What is the same algorithm in several scripts is the same text, so that a fix to one is a fix to
# all (the networks are what people edit; tests/test_families.py builds every task's network with
# one).
SAME_TEXT = [
    (
        list(SCRIPT_TABLE),
        [
            "LSTMCore",
            "zero_core",
            "ActorCritic",
            "sample_action",
            "log_prob_entropy",
            "masked_logits",
            "legal_actions",
            "make_policy_step",
            "learning_rate_at",
            "linear_decay",
            "masked_mean",
            "rollout_forward",
            "build",
        ],
    ),
    (
        [
            "appo_envpool.py",
            "impala_envpool.py",
            "appo_envpool_xla.py",
            "dqn_envpool.py",
            "sac_envpool.py",
            "td3_envpool.py",
        ],
        ["acting_version"],
    ),  # the actors' schedule: what decides the data
    (["appo_envpool.py", "impala_envpool.py", "appo_envpool_xla.py"], ["vtrace", "learner_loop"]),
    # The Python actor
    (
        ["appo_envpool.py", "impala_envpool.py"],
        ["actor_loop", "main"],
    ),  # its storage: jax_async_rl.trajectories
    (
        ["ppo_sync_baseline.py", "appo_envpool.py", "appo_envpool_xla.py"],  # PPO
        [
            "ppo_loss",
            "compute_gae",
            "time_limit_bootstrap",
            "minibatches",
            "make_optimizer",
            "clip_coef_at",
            "PRESETS",
        ],
    ),
    (
        ["appo_envpool.py", "appo_envpool_xla.py"],
        ["targets", "make_update", "resolve_args"],
    ),  # APPO
    # The replay families: their rounds (the loops on the page), the n-step target, the torso.
    (
        ["dqn_envpool.py", "sac_envpool.py", "td3_envpool.py"],
        ["encode", "n_step_return", "collect", "actor_loop", "learner_loop", "serial_loop"],
    ),
    (
        ["sac_envpool.py", "td3_envpool.py"],
        ["Critic", "critics", "make_act", "resolve_args", "make_replay"],
    ),
]


@pytest.mark.parametrize(
    ("scripts", "parts"),
    SAME_TEXT,
    ids=["all", "schedule", "asynchronous", "python-actor", "ppo", "appo", "replay", "qpg"],
)
def test_what_is_the_same_algorithm_is_the_same_text(scripts, parts):
    import inspect

    modules = [load_script(name) for name in scripts]
    for part in parts:
        if part == "PRESETS":
            assert len({repr(m.PRESETS) for m in modules}) == 1, part
            continue
        assert len({inspect.getsource(getattr(m, part)) for m in modules}) == 1, part


# ---------------------------------------------------------------------------------------------
# Smoke runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_smoke_cartpole_eval_and_video(script, cartpole_run):
    records = check_run_files(script, cartpole_run, "CartPole-v1", TINY_FLAGS["total_timesteps"])
    returns = tag_values(records, "charts/episodic_return")
    assert returns and all(1 <= r <= 500 for r in returns), returns
    evals = tag_values(records, "eval/episodic_return")
    assert len(evals) == 1 and 1 <= evals[0] <= 500, evals
    videos = list((cartpole_run / "videos").glob("*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 0, videos
    stderr = (cartpole_run.parent / "stderr.txt").read_text()
    assert "Warning" not in stderr, stderr
    config = json.loads((cartpole_run / "config.json").read_text())
    assert config["exp_name"] == script[:-3]  # the default: the script's file name


SMOKE_VARIANTS = [
    (name, variant) for name, row in SCRIPT_TABLE.items() for variant in row["variants"]
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("script_name", "variant"), SMOKE_VARIANTS)
def test_smoke_variant(script_name, variant, tmp_path):
    """Execution modes of one script (helpers.SCRIPT_TABLE's `variants`, e.g. --num-splits 1,
    --no-vtrace, --lstm) finish a tiny CartPole-v1 run and log every update tag."""
    flags = SCRIPT_TABLE[script_name]["variants"][variant]
    run_dir = tmp_path / "run"
    assert run_main(script_name, cli(script_name, run_dir=run_dir, **flags)) == 0
    check_run_files(script_name, run_dir, "CartPole-v1", TINY_FLAGS["total_timesteps"])
    config = json.loads((run_dir / "config.json").read_text())
    for name, value in flags.items():
        assert config[name] == value, (name, config[name])


# ---------------------------------------------------------------------------------------------
# The script's loop and the run: SIGTERM and resume, a diverging loss
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_sigterm_writes_checkpoint_and_resume_continues(script, tmp_path, capsys):
    """SIGTERM mid-run: exit 143 within seconds, the newest state checkpointed, no update scalars
    logged off the budget's schedule (the stop adds none). `--resume` (with its own flags but
    --log-frequency 1) then finishes the run (its header says from which step), and the annealed
    learning rate of every update after the resume equals the uninterrupted run's."""
    total = 60 * TINY_BATCH
    whole = tmp_path / "whole"
    assert run_main(script, cli(script, total_timesteps=total, run_dir=whole)) == 0
    run_dir = tmp_path / "run"
    # --log-frequency 1000: the update scalars come at the first update and the last of the budget
    # only.
    flags = dict(total_timesteps=total, save_interval=1, log_frequency=1000, run_dir=run_dir)
    returncode, stop_seconds, stderr = sigterm_when(
        script,
        cli(script, **flags),
        tmp_path / "logs",
        lambda: count_complete_lines(run_dir / "metrics.jsonl", '"charts/episodic_return"') >= 20,
        300,
    )
    assert returncode == 128 + signal.SIGTERM, f"exit code {returncode}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr
    assert stop_seconds < 20

    payload = read_checkpoint(run_dir)
    saved_step = int(payload["state"]["global_step"])
    saved_version = int(payload["state"]["policy_version"])
    records = read_metrics(run_dir)
    logged_steps = tag_steps(records, "losses/policy_loss")
    # The checkpoint holds the newest state, the step the stop names.
    assert logged_steps == [TINY_BATCH] and 2 * TINY_BATCH <= saved_step < total, logged_steps
    assert f"stopped by signal {int(signal.SIGTERM)} at step {saved_step};" in stderr, stderr[
        -3000:
    ]
    for tag in [
        "charts/SPS",
        "charts/learning_rate",
        *SCRIPT_TABLE[script]["extra_tags"],
    ]:  # the whole schedule
        assert tag_steps(records, tag) == logged_steps, tag
    assert saved_version > 0

    code, out, err = run_main(script, ["--resume", run_dir, "--log-frequency", 1], capsys)
    assert code == 0, err
    assert (
        f"resumed at step {saved_step}: {(total - saved_step) // TINY_BATCH} updates of " in out
    ), out
    new_records = read_metrics(run_dir)[len(records) :]
    assert new_records and min(r["step"] for r in new_records) > saved_step
    final = read_checkpoint(run_dir)["state"]
    assert int(final["global_step"]) == total and int(final["policy_version"]) > saved_version
    expected = {
        r["step"]: r["value"] for r in read_metrics(whole) if r["tag"] == "charts/learning_rate"
    }
    assert sorted(expected) == [TINY_BATCH * (i + 1) for i in range(60)]  # --log-frequency 1
    assert min(expected.values()) < 0.02 * max(expected.values())  # it did anneal to ~0
    resumed = [
        (r["step"], r["value"]) for r in read_metrics(run_dir) if r["tag"] == "charts/learning_rate"
    ]
    assert [step for step, _ in resumed] == [
        TINY_BATCH,
        *range(saved_step + TINY_BATCH, total + 1, TINY_BATCH),
    ]
    for step, value in resumed:
        assert value == pytest.approx(expected[step], rel=1e-6, abs=1e-12), step


@pytest.mark.timeout(300)
def test_non_finite_loss_exits_1_and_keeps_checkpoint(script, cartpole_run, tmp_path, capsys):
    """Resume a good run with an absurd learning rate: the first update after the resume blows the
    parameters up (helpers.SCRIPT_TABLE's `diverge`), so its loss is non-finite (deterministic)."""
    run_dir = tmp_path / "run"
    shutil.copytree(cartpole_run, run_dir)
    checkpoint = run_dir / CHECKPOINT
    good_bytes = checkpoint.read_bytes()
    saved_step = int(read_checkpoint(checkpoint)["state"]["global_step"])
    flags = dict(
        SCRIPT_TABLE[script]["diverge"],
        save_interval=1,
        total_timesteps=saved_step + 10 * TINY_BATCH,
        resume=run_dir,
    )
    code, _, err = run_main(script, cli(script, **flags), capsys)
    assert code == 1 and "non-finite" in err and "Traceback" not in err, err
    assert "the last good checkpoint is kept" in err, err
    assert checkpoint.read_bytes() == good_bytes, "the last good checkpoint was overwritten"
    for record in read_metrics(run_dir):
        assert np.isfinite(record["value"]), f"non-finite value logged: {record}"


# ---------------------------------------------------------------------------------------------
# Flags: presets, --help, the script's own checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_presets_per_task_and_help(script):
    """Presets from a published source, per task (helpers.SCRIPT_TABLE's `presets`); --help shows
    each preset's values, and the flags it fills as "(default: preset)"."""
    module = load_script(script)
    for env_id, expected in SCRIPT_TABLE[script]["presets"].items():
        args = module.resolve_args(module.Args(env_id=env_id))
        got = {name: getattr(args, name) for name in expected}
        assert got == expected, env_id
    assert (
        module.resolve_args(module.Args(env_id="Pendulum-v1", gamma=0.5)).gamma == 0.5
    )  # an explicit flag wins
    result = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert max(len(line) for line in result.stdout.splitlines()) <= 100
    presets = " ".join(result.stdout.split("presets:")[1].split("flags:")[0].split())
    for name, values in module.PRESETS.items():
        assert f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items()) in presets, name
    options = help_flags(result.stdout)  # flag -> its help text
    preset_flags = preset_table_flags(module)
    assert preset_flags <= set(options), preset_flags - set(options)
    for flag in preset_flags:
        assert (
            options[flag].endswith("(default: preset)") and "(default: None)" not in options[flag]
        ), options[flag]
    figures = [
        text for text in options.values() if re.search(r"\d(\.\d+)?x\b|\d[\d,]* SPS|\d%", text)
    ]
    assert not figures, f"flag help quotes figures, which belong in docs/results.md: {figures}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", list(LINE_BUDGET))  # every script, the replay families' too
def test_help_prints_before_the_libraries_import(script):
    """--help from the script's source (flags.help_from_source, in its first __main__ block): the
    text flags.help_text makes of the imported script, exit 0, and none of the libraries that take
    seconds to import (JAX, flax, optax, numpy, envpool, tensorboardX) imported."""
    module = load_script(script)
    heavy = {"jax", "jaxlib", "flax", "optax", "numpy", "envpool", "tensorboardX"}
    probe = (
        "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], "
        "run_name='__main__')\n"
        f"finally:\n    print('imported', sorted({heavy!r} & {{m.split('.')[0] for m in "
        f"sys.modules}}), file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, script, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == help_text(script, module.Args, module.PRESETS)
    assert result.stderr.splitlines()[-1] == "imported []", result.stderr


SCRIPT_BAD_INPUTS = [
    (name, case) for name, row in SCRIPT_TABLE.items() for case in row["bad_inputs"]
]


@pytest.mark.parametrize(("script_name", "case"), SCRIPT_BAD_INPUTS)
def test_bad_input_of_script_flags(script_name, case, tmp_path, capsys):
    """Flags that only some scripts have (helpers.SCRIPT_TABLE's `bad_inputs`): one line, exit 2,
    no run folder."""
    flags, fragments = SCRIPT_TABLE[script_name]["bad_inputs"][case]
    out_dir = tmp_path / "out"
    code, _, err = run_main(script_name, cli(script_name, run_dir=out_dir, **flags), capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not out_dir.exists()


@pytest.mark.timeout(120)
def test_the_retired_xla_actor_flag_is_one_line_pointing_at_its_script(script, tmp_path):
    out_dir = tmp_path / "out"
    result = run_script(script, [*cli(script, run_dir=out_dir), "--xla-actor"], timeout=100)
    assert_usage_error(result, "--xla-actor", "appo_envpool_xla.py")
    assert not out_dir.exists()


@pytest.mark.timeout(120)
def test_ctrl_c_while_importing(script, tmp_path):
    """Ctrl-C while Python imports JAX, envpool and the rest (the first second): the process ends
    at once, by the signal (the shell's 130), with no traceback and without training on."""
    logs = tmp_path / "logs"
    proc = start_script(
        script,
        ["--env-id", "CartPole-v1", "--total-timesteps", 10**7, "--run-dir", tmp_path / "run"],
        logs,
    )
    time.sleep(1.0)
    returncode, stop_seconds, stderr = interrupt(proc, signal.SIGINT, logs)
    assert returncode in (-signal.SIGINT, 128 + signal.SIGINT), stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stop_seconds < 10


# APPO, whose Pong update (4 epochs x 4 minibatches, unrolled on CPU) compiles for minutes while the
# actor samples. (The sync baseline compiles in its main thread:
# test_lib_runs.test_ctrl_c_during_start_up.)
@pytest.mark.timeout(300)
def test_progress_lines_while_the_update_compiles(tmp_path):
    """Pong at default flags: a progress line every 5 s from the first rollout on, while XLA
    compiles the first update; Ctrl-C then exits 130 within seconds: no traceback, nothing to
    save."""
    script_name = "appo_envpool.py"
    logs, run_dir = tmp_path / "logs", tmp_path / "run"
    proc = start_script(
        script_name,
        ["--env-id", "Pong-v5", "--run-dir", run_dir, "--compile-cache", "", "--conv", "native"],
        logs,
    )
    progress = re.compile(
        r"^step +(\d+) sampled +0 learned of 10000000 .*ETA n/a \(compiling the first update\)$"
    )
    seen = []  # (time a progress line appeared, env steps sampled)

    def watch():
        lines = (logs / "stdout.txt").read_text().split("\n")[:-1]
        for line in lines[len(seen) + 2 :]:  # after the backend and header lines
            match = progress.match(line)
            assert match, f"not a progress line: {line!r}"
            seen.append((time.monotonic(), int(match[1])))
        return bool(seen) and seen[-1][1] > 0

    try:
        wait_until(watch, proc, 240)  # the first rollout is under way
        header = (logs / "stdout.txt").read_text().split("\n")[1]
        assert f"{script_name}: Pong-v5 (preset atari, 2 splits), " in header, (
            header
        )  # images: double buffering
        sampling = time.monotonic()
        wait_until(lambda: watch() and len([t for t, _ in seen if t > sampling]) >= 2, proc, 20)
    finally:
        if proc.poll() is not None or count_complete_lines(run_dir / "metrics.jsonl", '"losses/'):
            proc.kill()
    times = [t for t, _ in seen]
    assert max(b - a for a, b in zip(times, times[1:])) < 8, (
        f"seconds between progress lines: {times}"
    )
    first_line = (logs / "stdout.txt").read_text().splitlines()[0]
    assert first_line.startswith(f"jax {jax.__version__} on cpu: cpu:0"), (
        first_line
    )  # backend and devices
    assert count_complete_lines(run_dir / "metrics.jsonl", '"losses/') == 0, (
        "the first update finished first"
    )
    returncode, stop_seconds, stderr = interrupt(proc, signal.SIGINT, logs)
    assert returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr and "during start-up" in stderr, stderr
    assert stop_seconds < 10


# ---------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------

# HalfCheetah-v4 at default flags (the MuJoCo preset: CleanRL's settings and its observation and
# reward normalisation), seed 1: the budget within which 20 consecutive episodes average > 1000.
# Measured: the sync baseline first passed 1000 at 201k, 184k and 217k steps (seeds 1-3; it is
# repeatable from its seed); APPO at 297k, 305k and 418k (seeds 1, 3, 2), and one other seed-2
# run was at 910 after 500k (APPO runs are not repeatable). CleanRL's PPO is at ~1500-2000 at 1M;
# here 1M gave 3527 (sync, seed 1) and 2427 / 2320 / 1708 (APPO, seeds 1-3). Since V-trace takes the
# preset's lambda and the actors wait for the first update, APPO passed 1000 at 196k +- 33k steps
# (seeds 1-3, docs/parity.md): its budget came down from 800k to 500k. The suite runs APPO only:
# the sync baseline's pipeline on HalfCheetah (its preset's normaliser included) is tested as APPO's
# at --actor-lag 0 --no-vtrace, bit for bit over 5 updates of 8 envs (tests/test_determinism.py),
# and its learning is measured, not tested (docs/results.md).
HALFCHEETAH_BUDGET = {"appo_envpool.py": 500_000}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script_name", list(HALFCHEETAH_BUDGET))
def test_learns_halfcheetah_with_normalisation(script_name, tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        "--env-id",
        "HalfCheetah-v4",
        "--seed",
        1,
        "--eval-episodes",
        0,
        "--run-dir",
        run_dir,
        "--total-timesteps",
        HALFCHEETAH_BUDGET[script_name],
    ]
    assert_ok(run_script(script_name, argv, timeout=850))
    returns = tag_values(read_metrics(run_dir), "charts/episodic_return")
    windows = np.convolve(returns, np.ones(20) / 20, "valid")
    curve = json.dumps([round(float(w)) for w in windows[:: max(1, len(windows) // 40)]])
    assert windows.max() > 1000, (
        f"best 20-episode mean {windows.max():.1f}; means along the run: {curve}"
    )
    assert np.mean(returns[-20:]) > 500, (
        f"last 20 episodes: {returns[-20:]}; means along the run: {curve}"
    )


# Seed 1 of each script: the cheapest run that can fail. (Seed 2 of the sync baseline and APPO, 22 s
# each, ran here too until the suite ran past its 30 minutes; docs/parity.md has seeds 1-5 of
# both.) IMPALA's 1M steps are the suite's longest CartPole run; its parity runs, seeds 1-3,
# reached 475 at 103k +- 21k steps (docs/results.md). Known to fail at times before the CartPole
# preset annealed its clip (--anneal-clip, rl-baselines3-zoo's lin_0.2): a run could stick near
# 110-130 for 100k steps (sync seed 5 from 100k on, deterministically; one APPO seed-2 run in the
# suite). With it, seeds 1-5 of sync and APPO all end at 500 (docs/parity.md).
CARTPOLE_SEEDS = [(name, 1) for name in SCRIPT_TABLE]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("script_name", "seed"), CARTPOLE_SEEDS)
def test_learns_cartpole(script_name, seed, tmp_path):
    """At default flags, within helpers.SCRIPT_TABLE's `learning_timesteps`."""
    run_dir = tmp_path / "run"
    argv = [
        "--env-id",
        "CartPole-v1",
        "--seed",
        seed,
        "--eval-episodes",
        0,
        "--run-dir",
        run_dir,
        "--total-timesteps",
        SCRIPT_TABLE[script_name]["learning_timesteps"],
    ]
    result = run_script(script_name, argv, timeout=850)
    assert_ok(result)
    returns = tag_values(read_metrics(run_dir), "charts/episodic_return")
    assert len(returns) >= 20
    # Reaches the threshold within the budget: some 20 consecutive episodes average >= 475.
    windows = np.convolve(returns, np.ones(20) / 20, "valid")
    curve = json.dumps([round(float(w)) for w in windows[:: max(1, len(windows) // 40)]])
    assert windows.max() >= 475, (
        f"best 20-episode mean {windows.max():.1f}; means along the run: {curve}"
    )
    # And has not fallen back towards a random policy (~22) at the end. Not ">= 475 at the end":
    # the asynchronous scripts' runs differ run to run (which policy version acts depends on thread
    # timing), and after converging, 2 of 20 APPO runs at 150k had a transient dip (the 20-episode
    # mean down to 130 and 218 for 10k-20k steps, then back to 500); one such dip ended a CI run at
    # 388.
    assert np.mean(returns[-20:]) >= 200, (
        f"last 20 episodes: {returns[-20:]}; means along the run: {curve}"
    )
