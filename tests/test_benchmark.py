"""utils/benchmark.py --quick on CartPole-v1 writes results with every field the issue names."""

import json
import math
import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, SCRIPTS

FIELDS = ["kind", "script", "env_id", "num_envs", "num_splits", "num_threads", "sps", "fps"]


def run_benchmark(out, *argv):
    """utils/benchmark.py with `argv` and --out `out`, from the repository root; it must exit 0."""
    cmd = [sys.executable, str(REPO_ROOT / "utils" / "benchmark.py"), *map(str, argv)]
    result = subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_benchmark_quick_writes_valid_results(tmp_path):
    out = tmp_path / "bench"
    run_benchmark(out, "--quick", "--env-id", "CartPole-v1", "--seconds", "1", "--e2e-seconds", "3")
    results = json.loads((out / "results.json").read_text())
    machine = results["machine"]
    assert machine["cpu_count"] >= 1 and machine["jax_backend"] == "cpu" and machine["jax_devices"]
    assert machine["packages"]["jax"] and machine["packages"]["envpool"]
    rows = results["measurements"]
    for row in rows:
        missing = [f for f in FIELDS if f not in row]
        assert not missing, (row, missing)
        assert row["env_id"] == "CartPole-v1"
        assert math.isfinite(row["sps"]) and row["sps"] > 0
        assert row["fps"] == row["sps"]  # CartPole has no frame skip: frames = agent steps
    kinds = [r["kind"] for r in rows]
    assert kinds.count("ceiling") == 2 and kinds.count("sampler") == 5
    ceilings = [r for r in rows if r["kind"] == "ceiling"]
    assert all(r["script"] is None for r in ceilings)
    samplers = sorted(
        (r for r in rows if r["kind"] == "sampler"),
        key=lambda r: (r["xla_actor"], r["lstm"], r["num_splits"]),
    )
    assert [(r["num_splits"], r["lstm"], r["xla_actor"]) for r in samplers] == [
        (1, False, False),
        (2, False, False),
        (2, True, False),
        (1, False, True),
        (2, False, True),
    ]
    assert [r["script"] for r in samplers] == ["appo_envpool.py"] * 3 + ["appo_envpool_xla.py"] * 2
    assert all(r["num_threads"] == 1 for r in samplers)
    for r in samplers:  # envpool's thread and the actor on separate cores, where there are two
        if len(os.sched_getaffinity(0)) > 1:
            cores = r["cores"]
            assert cores["actor_cores"] and cores["env_core"] not in cores["actor_cores"], cores
            assert cores["threads_on_env_core"] == 1, cores  # envpool's one thread, nothing else
    one_thread = next(r for r in ceilings if r["num_threads"] == 1)
    for r in samplers:
        assert abs(r["fraction_of_ceiling"] - r["sps"] / one_thread["sps"]) < 1e-9
    e2e = {(r["script"], r["xla_actor"]) for r in rows if r["kind"] == "end_to_end"}
    assert e2e == {(script, script == "appo_envpool_xla.py") for script in SCRIPTS}, e2e
    for r in rows:
        if r["kind"] == "end_to_end":
            assert r["updates"] >= 2 and 0 <= r["busy"]["update"] <= 1.05
            # CartPole: 1 split by default
            assert r["num_splits"] == (None if r["script"] == "ppo_sync_baseline.py" else 1)
    table = (out / "results.md").read_text()
    assert "Double buffering" in table and "| end_to_end" not in table  # tables, not raw rows
    e2e_sps = {r["script"]: r["sps"] for r in rows if r["kind"] == "end_to_end"}
    sync = e2e_sps["ppo_sync_baseline.py"]
    for script in SCRIPTS[1:]:  # of sync
        assert f"| {script} | 8 | 1 | 64 | {e2e_sps[script]:.0f} |" in table
        assert f"| {e2e_sps[script] / sync:.2f}x |" in table
    xla_ratio = samplers[4]["sps"] / samplers[3]["sps"]
    assert (
        f"Double buffering with the XLA actor (appo_envpool_xla.py): 2 splits / 1 split = "
        f"**{xla_ratio:.2f}x**." in table
    )
    lstm_ratio = samplers[2]["sps"] / samplers[1]["sps"]
    assert (
        f"Recurrent actor: the --lstm sampler / the feed-forward one (2 splits) = "
        f"**{lstm_ratio:.2f}x**" in table
    )
    for png in ["sampler.png", "end_to_end.png"]:
        assert (out / png).stat().st_size > 5000


@pytest.fixture
def bench_module(monkeypatch):
    """utils/benchmark.py as a module, importable by name (the sampler's spawned process imports
    it)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "utils"))
    import benchmark

    return benchmark


def test_sampler_without_pinning(bench_module):
    """--no-pin: the sampler still measures, in its own process, and reports no core layout."""
    sps, busy, layout = bench_module.measure_sampler("CartPole-v1", 8, 2, 16, 1.0, pin=False)
    assert layout is None
    assert math.isfinite(sps) and sps > 0 and 0 <= busy["inference"] <= 1.05


def test_sampler_process_failure_is_reported(bench_module):
    """An exception inside the sampler's process reaches the caller with its traceback; no hang."""
    with pytest.raises(RuntimeError, match="sampler process failed(.|\n)*must divide --num-envs"):
        bench_module.measure_sampler(
            "CartPole-v1", 8, 3, 16, 1.0
        )  # 3 splits of 8 envs: appo refuses


def test_user_env_ceiling_with_processes_and_async_vector_env(bench_module, monkeypatch):
    """A user's env that waits 20 ms a step: the package's workers with a process an env overlap
    the waits (at least 2x one process for the 4 envs; 4x is the ideal, and 20 ms keeps the
    pipes' and the scheduler's cost on a loaded machine small against it), and Gymnasium's
    AsyncVectorEnv row measures the same env."""
    from jax_async_rl import tasks

    monkeypatch.chdir(REPO_ROOT)
    env_id = "examples.corridor:Corridor"
    tasks.register_user_env(
        type(
            "Args", (), dict(env_id=env_id, env_module=None, env_kwargs='{"step_seconds": 0.02}')
        )()
    )
    one, four = (bench_module.measure_ceiling(env_id, 4, processes, 2.0) for processes in (1, 4))
    async_vector_env = bench_module.measure_ceiling(env_id, 4, 0, 2.0, async_vector_env=True)
    assert four > 2 * one, (one, four)
    assert math.isfinite(async_vector_env) and async_vector_env > one, (one, async_vector_env)


@pytest.mark.timeout(300)
def test_replay_part_times_both_modes_and_reports_the_ratio(bench_module, tmp_path):
    """--parts replay, tiny: dqn_envpool.py trained asynchronously and --serial; each row has
    its SPS, the replay ratio it held (the CartPole preset's 32), a threshold no 2k-step run
    reaches (5 rounds past --learning-starts 1000); the report tabulates both and their SPS
    ratio."""
    rows = []
    for serial in (False, True):
        measured = bench_module.measure_replay(
            "dqn_envpool.py", "CartPole-v1", serial, 2048, 475.0, str(tmp_path)
        )
        assert measured["replay_ratio"] == pytest.approx(32.0) and measured["target_ratio"] == 32.0
        assert (
            measured["sps"] > 0
            and measured["steps_to_threshold"] is None
            and measured["updates"] == 5
        )
        assert (
            measured["policy_lag"] == 0 or not serial
        )  # serial: each chunk learned by the parameters that made it
        rows.append(
            dict(
                kind="replay",
                script="dqn_envpool.py",
                serial=serial,
                threshold=475.0,
                fps=measured["sps"],
                **measured,
            )
        )
    # --replay-script sac_envpool.py: its critic's loss marks the updates; CleanRL's ratio, a batch
    # of 256 a step.
    sac = bench_module.measure_replay(
        "sac_envpool.py", "Pendulum-v1", True, 5000 + 4 * 32, -200.0, str(tmp_path)
    )
    assert sac["replay_ratio"] == pytest.approx(256.0) and sac["updates"] == 4
    # --replay-flags: R2D2 (--lstm) at its preset's ratio, 48 steps of burn-in and sequence a step.
    r2d2 = bench_module.measure_replay(
        "dqn_envpool.py",
        "CartPole-v1",
        False,
        1280,
        475.0,
        str(tmp_path),
        ["--lstm", "--learning-starts", "640"],
    )
    assert r2d2["replay_ratio"] == pytest.approx(48.0) and r2d2["updates"] == 4
    rows = [dict(row, flags="--lstm") for row in rows]
    machine = dict(cpu_count=2, jax_backend="cpu", processor="x")
    bench_module.write_report(
        str(tmp_path), dict(env_id="CartPole-v1", machine=machine, measurements=rows), True
    )
    table = (tmp_path / "results.md").read_text()
    assert (
        "## Replay (dqn_envpool.py --lstm:" in table
        and "| async |" in table
        and "| serial |" in table
        and table.count("| not reached |") == 2
    )
    assert f"Async / serial SPS: **{rows[0]['sps'] / rows[1]['sps']:.2f}x**." in table


@pytest.fixture(scope="module")
def end_to_end_and_network(tmp_path_factory):
    """One benchmark of two parts, read by the two tests below (each once started its own: ~5 s of
    start-up): end_to_end of the sync baseline and APPO with --deterministic, and the network
    part (--seconds and --num-envs act on the network part only here). Its output folder and the
    finished process."""
    out = tmp_path_factory.mktemp("end_to_end_and_network") / "bench"
    result = run_benchmark(
        out,
        "--quick",
        "--env-id",
        "CartPole-v1",
        "--parts",
        "end_to_end",
        "network",
        "--scripts",
        "ppo_sync_baseline.py",
        "appo_envpool.py",
        "--deterministic",
        "--e2e-seconds",
        "3",
        "--seconds",
        "0.5",
        "--num-envs",
        "8",
        "--torch-python",
        sys.executable,
    )
    return out, result


def measurements(out, kind):
    """The rows of `kind` in a benchmark's results.json, in order."""
    rows = json.loads((out / "results.json").read_text())["measurements"]
    return [r for r in rows if r["kind"] == kind]


def test_benchmark_measures_the_deterministic_mode_beside_the_free_running_actor(
    end_to_end_and_network,
):
    """--deterministic: each asynchronous script runs twice end to end, free-running and with
    --deterministic (its run's config says so), and the table gives the ratio of the two."""
    out, _ = end_to_end_and_network
    rows = measurements(out, "end_to_end")
    assert [(r["script"], r["deterministic"]) for r in rows] == [
        ("ppo_sync_baseline.py", False),
        ("appo_envpool.py", False),
        ("appo_envpool.py", True),
    ]
    configs = {
        det: json.loads(
            (out / "e2e" / f"appo_envpool__8{'__deterministic' * det}" / "config.json").read_text()
        )
        for det in (False, True)
    }
    assert [configs[det]["deterministic"] for det in (False, True)] == [False, True]
    free, det = rows[1]["sps"], rows[2]["sps"]
    assert (
        f"| appo_envpool.py --deterministic | 8 | 1 | 64 | {det:.0f} |"
        in (out / "results.md").read_text()
    )
    assert f"| {det / free:.2f}x |" in (out / "results.md").read_text()
    assert set(rows[2]["busy"]) <= {
        "env",
        "inference",
        "bookkeeping",
        "device_get",
        "queue_put",
        "queue_get",
        "update",
    }, rows[2]


def test_benchmark_times_the_network_in_each_form(end_to_end_and_network):
    """--parts network: the Nature CNN's forward pass and train step with the convolutions native
    and as matmuls, each row's ratio to native's in the table; torch's row where the Python named
    imports torch, else a note that it is left out."""
    out, result = end_to_end_and_network
    rows = measurements(out, "network")
    has_torch = subprocess.run([sys.executable, "-c", "import torch"]).returncode == 0
    assert [r["conv"] for r in rows] == ["native", "matmul", *(["torch"] * has_torch)]
    if not has_torch:
        assert "cannot import torch; left out" in result.stdout
    for r in rows:
        assert (r["forward_batch"], r["train_batch"]) == (4, 256)
        assert r["forward_ms"] > 0 and r["train_ms"] > 0
    table = (out / "results.md").read_text()
    ratio = rows[1]["train_ms"] / rows[0]["train_ms"]
    assert f"| matmul (cpu) | {rows[1]['forward_ms']:.1f} (4) |" in table
    assert f"| {ratio:.2f}x |" in table
