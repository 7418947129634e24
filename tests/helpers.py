"""Helpers shared by the tests: which scripts to test, running one, reading what a run wrote.

Every script follows the same CLI conventions (see DESIGN.md), so the tests take the script's
file name as a parameter. Add a new script to SCRIPTS and every script-level test covers it.
"""

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import flax.serialization

REPO_ROOT = Path(__file__).resolve().parent.parent

# The one list of scripts that tests/test_scripts.py is parametrized over.
SCRIPTS = ["ppo_sync_baseline.py"]

# A tiny budget: 2 updates of 4 envs x 16 steps, 2 minibatches, 1 epoch, no evaluation.
TINY_FLAGS = {
    "num_envs": 4,
    "num_steps": 16,
    "num_minibatches": 2,
    "update_epochs": 1,
    "total_timesteps": 128,
    "eval_episodes": 0,
}
TINY_BATCH = TINY_FLAGS["num_envs"] * TINY_FLAGS["num_steps"]

# Tags every script logs after an update (DESIGN.md, "Shared tag names").
UPDATE_TAGS = [
    "charts/SPS",
    "losses/policy_loss",
    "losses/value_loss",
    "losses/entropy",
    "losses/approx_kl",
    "losses/clipfrac",
]

CHECKPOINT = "checkpoint.msgpack"


def cli(env_id="CartPole-v1", **flags):
    """Command-line flags: TINY_FLAGS overridden by `flags`.

    None drops a flag; True / False give tyro's `--flag` / `--no-flag` switches.
    """
    merged = dict(TINY_FLAGS, **flags)
    argv = ["--env-id", env_id]
    for name, value in merged.items():
        flag = name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv += [f"--{flag}", str(value)]
    return argv


@functools.lru_cache(maxsize=None)
def load_script(name):
    """Import a script from the repository root by file name (nothing runs at import)."""
    module_name = Path(name).stem
    spec = importlib.util.spec_from_file_location(module_name, REPO_ROOT / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def run_script(script, argv, timeout=600):
    """Run `python script argv...` from the repository root; return the CompletedProcess."""
    return subprocess.run(
        [sys.executable, script, *map(str, argv)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_script(script, argv, log_dir):
    """Start `python script argv...` in the background; stdout/stderr go to files in `log_dir`."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "stdout.txt", "w") as out, open(log_dir / "stderr.txt", "w") as err:
        return subprocess.Popen([sys.executable, script, *map(str, argv)], cwd=REPO_ROOT, stdout=out, stderr=err)


def describe(result):
    """The tail of a finished run's output, for assertion messages."""
    return f"exit code {result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"


def assert_ok(result):
    assert result.returncode == 0, describe(result)
    assert "Traceback" not in result.stderr, describe(result)


def assert_usage_error(result, *fragments):
    """Exit code 2, exactly one non-empty line on stderr, `error: ...` naming every fragment."""
    assert result.returncode == 2, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{result.stderr}"
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def wait_until(predicate, proc, timeout):
    """Poll `predicate` until true; fail if `proc` exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run exited with code {proc.returncode} before the condition held")
        time.sleep(0.2)
    raise AssertionError(f"condition not reached within {timeout} s")


def count_complete_lines(path, substring):
    """Lines of a file being written that are complete (newline-terminated) and hold `substring`."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return 0
    return sum(substring in line for line in text.split("\n")[:-1])


def read_metrics(run_dir):
    """metrics.jsonl as a list of dicts, checking the schema of every line (DESIGN.md)."""
    records = []
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for number, line in enumerate(f, 1):
            record = json.loads(line)
            where = f"metrics.jsonl line {number}: {line.strip()}"
            assert set(record) == {"step", "wall_time", "tag", "value"}, where
            assert type(record["step"]) is int and record["step"] >= 0, where
            assert type(record["wall_time"]) is float, where
            assert type(record["tag"]) is str and record["tag"], where
            assert type(record["value"]) is float, where
            records.append(record)
    return records


def tag_values(records, tag):
    return [r["value"] for r in records if r["tag"] == tag]


def tag_steps(records, tag):
    return [r["step"] for r in records if r["tag"] == tag]


def file_contents(folder):
    """{name: bytes} of the files directly in `folder`, to check that nothing changed them."""
    return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}


def read_checkpoint(path):
    """The checkpoint's payload as nested dicts (flax msgpack; `path` may be a run folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    return flax.serialization.msgpack_restore(path.read_bytes())


def check_run_files(run_dir, env_id, min_step):
    """Check config.json, metrics.jsonl, TensorBoard events and the checkpoint; return the metrics.

    `min_step`: the budget in environment steps that the run must have reached.
    """
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["env_id"] == env_id

    records = read_metrics(run_dir)
    for tag in UPDATE_TAGS:
        values = tag_values(records, tag)
        assert values, f"no {tag} in metrics.jsonl"
        assert all(math.isfinite(v) for v in values), (tag, values)
    assert max(tag_steps(records, "losses/policy_loss")) >= min_step

    events = sorted(run_dir.glob("events.out.tfevents.*"))
    assert events, f"no TensorBoard events file in {os.listdir(run_dir)}"
    event_bytes = b"".join(path.read_bytes() for path in events)
    for tag in UPDATE_TAGS:
        assert tag.encode() in event_bytes, f"{tag} not in the TensorBoard events"

    payload = read_checkpoint(run_dir)
    state = payload["state"]
    assert {"params", "opt_state", "global_step", "policy_version"} <= set(state)
    assert int(state["global_step"]) >= min_step
    assert json.loads(payload["config"])["env_id"] == env_id
    return records
