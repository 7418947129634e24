"""jax_async_rl.flags: ranges declared in annotations, presets, the command line (one line and
exit code 2 for a user's mistake), and the run flags every script inherits."""

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Annotated, Optional

import pytest

from jax_async_rl import flags, helptext
from jax_async_rl.flags import NON_NEGATIVE, POSITIVE, PRESET, UNIT, UsageError, at_most


@dataclass
class ToyArgs(flags.RunArgs):
    """A toy algorithm's flags."""

    steps: Annotated[Optional[int], PRESET, POSITIVE] = None
    """rollout length"""
    rate: Annotated[Optional[float], PRESET, POSITIVE] = None
    """learning rate"""
    cost: Annotated[float, NON_NEGATIVE] = 0.5
    """a weight"""
    gamma: Annotated[float, UNIT] = 0.99
    """a discount"""
    free: float = 1.0
    """a float with no range but a finite one"""
    ratio: Annotated[float, POSITIVE, at_most(1e5)] = 1.0
    """a float with an upper limit"""
    count: int = 3
    """an int with no range but 32 bits"""
    switch: bool = False
    """a switch"""


PRESETS = {"classic": dict(steps=128, rate=2.5e-4), "CartPole": dict(steps=32, rate=1e-3)}


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("steps", 0, "--steps must be positive, got 0"),
        ("rate", -1e-3, "--rate must be positive, got -0.001"),
        ("cost", -0.1, "--cost must be >= 0, got -0.1"),
        ("gamma", 1.5, "--gamma must be in [0, 1], got 1.5"),
        ("rate", float("nan"), "--rate must be a finite number, got nan"),
        ("cost", float("inf"), "--cost must be a finite number, got inf"),
        ("free", float("-inf"), "--free must be a finite number, got -inf"),
        ("total_timesteps", -5, "--total-timesteps must be positive"),
        ("log_frequency", 0, "--log-frequency must be positive"),
        ("eval_episodes", -1, "--eval-episodes must be >= 0"),
        ("ratio", 1e308, "--ratio must be at most 100000, got 1e+308"),
        ("count", 2**31, "--count must be at most 2,147,483,647"),
        ("total_timesteps", 10**10, "--total-timesteps must be at most 2,147,483,647"),
        ("seed", -1, "--seed must be in [0, 2**30]"),
        ("env_timeout", 1e9, "--env-timeout must be at most"),
    ],
)
def test_a_value_outside_its_declared_range_is_one_line_naming_the_flag(field, value, fragment):
    args = dataclasses.replace(ToyArgs(steps=8, rate=1e-3), **{field: value})
    with pytest.raises(UsageError) as error:
        flags.check_bounds(args)
    assert fragment in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("stored", "fragment"),
    [
        (dict(rate="abc"), 'rate "abc": must be a number or null'),
        (dict(steps="32"), 'steps "32": must be an integer or null'),
        (dict(count=True), "count true: must be an integer"),
        (dict(switch=1), "switch 1: must be true or false"),
        (dict(env_id=None), "env_id null: must be a string"),
        (
            dict(actor_device_ids=[0, "1"]),
            'actor_device_ids [0, "1"]: must be a list (an integer each)',
        ),
        (dict(actor_device_ids=0), "actor_device_ids 0: must be a list"),
        (dict(steps=-8), "steps -8: must be positive"),
        (dict(free=float("nan")), "free NaN: must be a finite number"),
        (dict(count=2**31), "count 2147483648: must be at most 2,147,483,647"),
    ],
)
def test_a_stored_flag_of_a_wrong_type_or_range_is_one_line_naming_the_file_and_key(
    stored, fragment
):
    """A file's flags (a checkpoint's config) take the command line's checks: the type its Args
    annotation declares, then its range; the line names the file, not a flag no one passed."""
    with pytest.raises(UsageError) as error:
        flags.stored_flags(ToyArgs, stored, "--resume R/checkpoint.msgpack")
    assert str(error.value).startswith(
        f"--resume R/checkpoint.msgpack: its config has {fragment}"
    ), str(error.value)
    assert "\n" not in str(error.value)


def test_stored_flags_of_the_declared_types_pass_as_the_command_line_makes_them():
    stored = dict(steps=None, rate=1, count=3, switch=True, exp_name=None, actor_device_ids=[0, 1])
    typed = flags.stored_flags(ToyArgs, stored, "R")
    assert typed == dict(stored, rate=1.0) and type(typed["rate"]) is float


def test_values_inside_their_ranges_and_presets_left_at_none_pass():
    flags.check_bounds(ToyArgs(steps=1, rate=1e-9, cost=0.0, gamma=0.0))
    flags.check_bounds(ToyArgs(gamma=1.0))  # None: the preset's, filled later


def test_a_preset_fills_only_the_flags_left_out():
    args = flags.with_preset(ToyArgs(rate=0.5), PRESETS["CartPole"])
    assert (args.steps, args.rate) == (32, 0.5)


def test_help_lists_the_presets_and_marks_preset_flags():
    description = helptext.describe_presets(ToyArgs, PRESETS)
    assert description.splitlines()[0] == "A toy algorithm's flags."
    assert "  CartPole: steps=32, rate=0.001" in description


def test_flags_given_reads_every_form():
    argv = [
        "--steps",
        "3",
        "--rate=0.1",
        "--no-switch",
        "--env-id",
        "CartPole-v1",
        "--not-a-flag",
        "x",
    ]
    assert flags.flags_given(argv, ToyArgs) == {"steps", "rate", "switch", "env_id"}


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--stpes", "3"], ["unknown flag --stpes", "did you mean --steps"]),
        (["--xla-actor"], ["--xla-actor", "appo_envpool_xla.py"]),
        (["--no-xla-actor"], ["--no-xla-actor", "appo_envpool_xla.py"]),
        (["--zzz=1"], ["unknown flag --zzz", "--help"]),
    ],
)
def test_an_unknown_or_retired_flag_is_one_line(argv, fragments):
    with pytest.raises(UsageError) as error:
        flags.check_names(argv, ToyArgs)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_known_flags_pass_the_name_check():
    flags.check_names(
        ["--steps", "3", "--no-switch", "--env-id=Pong-v5", "--", "--anything"], ToyArgs
    )


PROGRAM = """
import sys
from dataclasses import dataclass
sys.path.insert(0, {tests!r})
from test_lib_flags import ToyArgs, PRESETS
from jax_async_rl import flags
from jax_async_rl.flags import UsageError

def main(args, given):
    if args.steps == 13:
        raise UsageError("--steps 13 is unlucky")
    print("given", sorted(given), args.steps)
    return 7

flags.command_line(main, ToyArgs, PRESETS)
"""


def run_program(*argv):
    tests = str(__import__("pathlib").Path(__file__).parent)
    return subprocess.run(
        [sys.executable, "-c", PROGRAM.format(tests=tests), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_command_line_runs_main_and_exits_with_its_code():
    result = run_program("--steps", "5", "--no-switch")
    assert result.returncode == 7, result.stderr
    assert "given ['steps', 'switch'] 5" in result.stdout


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--steps", "13"], "unlucky"),
        (["--stpes", "5"], "did you mean --steps"),
        (["--xla-actor"], "appo_envpool_xla.py"),
        (["--steps", "abc"], "Error parsing --steps"),  # tyro's own check: its box was 5-9 lines
        (
            ["--steps", "3", "runs/b/"],
            "Unrecognized options: runs/b/ (one value too many: did a glob match",
        ),
    ],
)
def test_command_line_turns_a_usage_error_into_one_line_and_exit_2(argv, fragment):
    result = run_program(*argv)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr
    ), result.stderr
    assert fragment in lines[0], lines[0]


def test_a_parse_error_in_a_colour_terminal_is_one_line_with_its_whole_value(monkeypatch, capsys):
    """tyro colours its box where stdout is a terminal and wraps it at the terminal's width: the
    one line has neither the colour codes nor a break inside a long path."""
    import tyro._fmtlib

    monkeypatch.setattr(tyro._fmtlib, "_FORCE_ANSI", True, raising=False)
    monkeypatch.setenv("COLUMNS", "40")
    path = "runs/CartPole-v1__appo_envpool__1__1796447879_and_a_long_name"
    with pytest.raises(UsageError) as error:
        flags.parse(ToyArgs, ["--steps", "3", path])
    assert str(error.value).startswith(f"Unrecognized options: {path} (one value too many"), str(
        error.value
    )
    assert "\x1b" not in str(error.value) and os.environ["COLUMNS"] == "40"
    assert flags.parse(ToyArgs, ["--steps", "3"]).steps == 3 and capsys.readouterr().err == ""


def test_help_groups_the_flags_with_plain_metavars():
    """--help: the flags in four groups (algorithm, environment, run, devices), each once, with
    plain metavars (no `{None}|INT`), its text and its default, within 100 columns; presets
    wrapped."""
    from helpers import help_flags, load_script

    module = load_script("appo_envpool.py")
    text = helptext.help_text("appo_envpool.py", module.Args, module.PRESETS)
    assert max(len(line) for line in text.splitlines()) <= 100
    headers = [line for line in text.splitlines() if line.endswith(" flags:")]
    assert headers == ["algorithm flags:", "environment flags:", "run flags:", "devices flags:"]
    sections = dict(
        zip(["algorithm", "environment", "run", "devices"], text.split(" flags:\n")[1:])
    )
    assert (
        "--vtrace / --no-vtrace" in sections["algorithm"]
        and "--num-envs INT" in sections["environment"]
    )
    assert (
        "--resume STR" in sections["run"] and "--learner-device-ids INT..." in sections["devices"]
    )
    assert "--norm-obs True|False" in sections["environment"]
    assert "{None}" not in text and "╭" not in text
    options = help_flags(text)
    assert set(options) == {f.name for f in dataclasses.fields(module.Args)}
    assert options["learning_rate"].endswith("(default: preset)") and options[
        "queue_size"
    ].endswith("(default: 2)")


# A script in the scripts' layout: help_from_source in its first __main__ block, command_line in its
# last.
HELP_SCRIPT = '''"""A tiny script."""

import signal
from dataclasses import dataclass
{heavy_import}

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from jax_async_rl.helptext import help_from_source
    help_from_source(__file__)
    print("past help_from_source")

from jax_async_rl import flags

RATE = 0.25


@dataclass
class Args(flags.RunArgs):
    """A tiny algorithm's flags."""

    rate: float = {rate}
    """a learning rate"""


PRESETS = {{"classic": dict(rate=RATE)}}

if __name__ == "__main__":
    flags.command_line(lambda args, given: 0, Args, PRESETS)
'''
LIGHT = dict(heavy_import="", rate="RATE")
NEEDS_NUMPY = dict(heavy_import="import numpy as np", rate="float(np.float32(RATE))")


def run_help_script(tmp_path, source, *argv):
    """Run a HELP_SCRIPT as `python tiny.py ARGV`; also prints which of numpy and jax it
    imported."""
    path = tmp_path / "tiny.py"
    path.write_text(HELP_SCRIPT.format(**source))
    probe = (
        "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], "
        "run_name='__main__')\n"
        "finally:\n    print('imported', sorted({'numpy', 'jax'} & set(sys.modules)), "
        "file=sys.stderr)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", probe, str(path), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--env-id", "CartPole-v1", "--help"]])
def test_help_from_source_prints_the_help_without_the_scripts_imports(tmp_path, argv):
    """--help runs only the script's light imports, its constants, Args and PRESETS, and exits 0
    before the rest of the script (before any import below its __main__ block)."""
    result = run_help_script(tmp_path, LIGHT, *argv)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.startswith("usage: tiny.py [--flag VALUE ...]")
        and "past help_from_source" not in result.stdout
    )
    assert (
        "classic: rate=0.25" in result.stdout and "a learning rate (default: 0.25)" in result.stdout
    )
    assert "imported []" in result.stderr, result.stderr


@pytest.mark.parametrize(("source", "argv"), [(NEEDS_NUMPY, ["--help"]), (LIGHT, ["--", "--help"])])
def test_help_from_source_leaves_the_rest_to_the_scripts_own_command_line(tmp_path, source, argv):
    """An Args that needs a library help_from_source does not run (numpy here) gets the same help
    from the script's own command line, after its imports; a --help after `--` is not a flag."""
    fast = run_help_script(tmp_path, LIGHT, "--help")
    result = run_help_script(tmp_path, source, *argv)
    assert result.stdout.startswith("past help_from_source"), (result.stdout, result.stderr)
    if argv != ["--", "--help"]:
        assert (
            result.returncode == 0 and result.stdout == "past help_from_source\n" + fast.stdout
        ), result.stderr
