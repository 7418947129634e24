"""--self-play (jax_async_rl/selfplay.py and the two scripts that take it): the learner's seat on a
real envpool game played by hand, seat alternation, the decisions a rollout becomes against a
plain reference, the opponent pool, a run's life (bad input, resume, determinism), and learning."""

import json
import re
import signal

import envpool
import jax
import numpy as np
import pytest
from helpers import (
    evaluate_here,
    load_script,
    read_checkpoint,
    run_main,
    sigterm_when,
)

from jax_async_rl import selfplay, tasks
from jax_async_rl.flags import UsageError

SCRIPTS = ("ppo_sync_baseline.py", "appo_envpool.py")


class Scripted:
    """Opponents that play the moves given, in order (env 0 only), drawn as "latest"."""

    def __init__(self, moves):
        self.moves = list(moves)

    def draw(self, keys, games):
        return np.zeros(len(keys), np.int64)

    def act(self, kind, obs, keys, steps):
        return np.full(len(keys), self.moves.pop(0))


def play(envs, learner_moves, rows):
    """Step env 0 of `envs` through a game: the learner's moves in order (the opponents' are
    theirs); append (valid, reward, done) per step as the scripts record a row. Returns the
    learner's-seat rewards of the game's steps."""
    learner_moves, done, prev_done = list(learner_moves), False, rows[-1][2] if rows else 0.0
    while not done:
        mine = selfplay.turns(envs, np.arange(1))[0]
        move = learner_moves.pop(0) if mine else 0  # an opponent's: replaced
        _, reward, terminated, truncated, _ = envs.step(np.array([move]))
        done = bool(terminated[0] | truncated[0])
        rows.append(((1.0 - prev_done) * mine, float(reward[0]), float(done)))
        prev_done = float(done)
    assert not learner_moves
    return rows


def test_the_learners_seat_on_a_hand_played_game_of_tic_tac_toe():
    """Game 0 seats the learner first; it loses on the opponent's move (a row 3-4-5). Game 1 seats
    it second, after the reset step; it is drawn. The decisions carry each reward to the learner's
    last move before it, the loss included, and end where the games end."""
    pool = envpool.make("TicTacToe-v1", env_type="gymnasium", num_envs=1, seed=0)
    envs = selfplay.SeatPool(pool, 1, 2, seed=0, opponents=Scripted([3, 4, 5, 0, 8, 7, 2, 3]))
    obs, _ = envs.reset()
    assert set(obs) == {"obs", "action_mask"} and obs["action_mask"].tolist() == [[1] * 9]
    rows = play(envs, [0, 1, 8], [])  # it moves first: X at 0, 1, 8; O at 3, 4, 5 wins
    assert [r[1] for r in rows] == [0, 0, 0, 0, 0, -1] and rows[-1][2] == 1
    assert envs.outcomes == [("latest", 0, -1.0)]
    # the reset step: its action is ignored, its row not a decision
    envs.step(np.array([0]))
    rows.append((0.0, 0.0, 0.0))
    assert envs.place[0] == 1 and selfplay.turns(envs, [0])[0] == 0  # now it moves second
    rows = play(envs, [4, 1, 6, 5], rows)
    assert rows[-1][1:] == (0.0, 1.0) and envs.outcomes[-1] == ("latest", 1, 0.0)
    assert envs.illegal == 0
    valid, rewards, dones = (np.array(column, np.float32)[:, None] for column in zip(*rows))
    steps = np.arange(len(rows))[:, None]
    rollout = dict(valid=valid, rewards=rewards, dones=dones, truncated=0 * dones, actions=steps)
    out = selfplay.decisions(dict(rollout, obs=steps, bootstrap_obs=np.zeros(1, int)))
    decided = out["valid"][:, 0] > 0
    assert out["actions"][decided, 0].tolist() == [0, 2, 4, 8, 10, 12, 14]  # in time order
    assert out["rewards"][decided, 0].tolist() == [0, 0, -1, 0, 0, 0, 0]
    assert out["dones"][decided, 0].tolist() == [0, 0, 1, 0, 0, 0, 1]
    assert not decided[: len(rows) - 7].any()  # the others first, out of the loss


def test_seats_alternate_across_envs_and_games_and_the_random_player_plays_legal_moves():
    """Env e's n-th game seats the learner (e + n) % P places after the first mover (also with 3
    players), and at a game's start the learner is to move exactly where that place is 0."""
    for env_id, players in (("TicTacToe-v1", 2), ("SparrowMahjong-v1", 3)):
        envs = tasks.make_env(env_id, 4, 7, 1, train=True)
        envs.reset()
        places = {e: [] for e in range(4)}
        for _ in range(300):
            random = selfplay.random_legal(envs.masks, np.random.default_rng(0).random(4))
            _, _, _, _, info = envs.step(random)
            for e in np.flatnonzero(info["elapsed_step"] == 0):
                places[e].append(int(envs.place[e]))
                assert envs.turns[e] == (envs.place[e] == 0)
        for e, seen in places.items():
            assert len(seen) >= 3
            assert seen == [(e + n) % players for n in range(1, len(seen) + 1)]
        assert envs.illegal == 0


def test_pgx_games_step_on_one_thread_whatever_is_asked():
    """envpool's pgx games share one generator between their threads (the first mover, dice and
    cards drawn in thread order): two pools of 4 threads dealt different first movers here."""
    envs = tasks.make_env("TicTacToe-v1", 8, 3, 4, train=True)
    assert envs.pool.config["num_threads"] == 1
    firsts = []
    for _ in range(2):
        envs = tasks.make_env("TicTacToe-v1", 8, 3, 4, train=True)
        envs.reset()
        seen = []
        for _ in range(300):
            _, _, _, _, info = envs.step(selfplay.random_legal(envs.masks, np.full(8, 0.5)))
            seen.append(info["current_player"][info["elapsed_step"] == 0].tolist())
        firsts.append(seen)
    assert firsts[0] == firsts[1]


def reference_decisions(valid, rewards, dones):
    """Per env, in plain Python: each decision's reward sums its seat's rewards from its move up
    to the next decision or the game's end, and its done says whether the game ended meanwhile;
    an env's last decision whose game goes on is no row but its bootstrap (returned apart)."""
    T, B = valid.shape
    out, bootstrap = [], {}
    for b in range(B):
        moves = [t for t in range(T) if valid[t, b]]
        for i, t in enumerate(moves):
            stop, total, ended = moves[i + 1] if i + 1 < len(moves) else T, 0.0, False
            for s in range(t, stop):
                total += rewards[s, b]
                if dones[s, b]:
                    ended = True
                    break
            if i + 1 == len(moves) and not ended:
                bootstrap[b] = t
            else:
                out.append((b, t, total, ended))
    return out, bootstrap


def test_decisions_match_a_plain_reference_on_random_rollouts():
    rng = np.random.default_rng(0)
    for _ in range(20):
        T, B = 17, 5
        valid = (rng.random((T, B)) < 0.5).astype(np.float32)
        rewards = rng.normal(size=(T, B)).astype(np.float32)
        dones = (rng.random((T, B)) < 0.15).astype(np.float32)
        obs = {"x": np.arange(T)[:, None, None] * np.ones((T, B, 3))}
        rollout = dict(valid=valid, rewards=rewards, dones=dones, truncated=dones, obs=obs)
        out = selfplay.decisions(dict(rollout, bootstrap_obs={"x": np.full((B, 3), -1.0)}))
        got = []
        for b in range(B):
            for t in np.flatnonzero(out["valid"][:, b]):
                step = int(out["obs"]["x"][t, b, 0])
                got.append((b, step, out["rewards"][t, b], bool(out["dones"][t, b])))
            count = int(out["valid"][:, b].sum())
            assert out["valid"][T - count :, b].all() and not out["valid"][: T - count, b].any()
        want, bootstrap = reference_decisions(valid, rewards, dones)
        assert [g[:2] + (g[3],) for g in got] == [w[:2] + (w[3],) for w in want]
        np.testing.assert_allclose([g[2] for g in got], [w[2] for w in want], rtol=1e-5)
        for b in range(B):  # the open last move's observation, else the rollout's own
            assert out["bootstrap_obs"]["x"][b, 0] == bootstrap.get(b, -1.0)


def test_the_pool_snapshots_every_interval_keeps_the_newest_and_round_trips():
    params = {"w": np.zeros(3, np.float32)}
    pool = selfplay.Pool(params, interval=10, size=3, margin=1, seed=0)
    for version in range(0, 71):
        pool.add(version, {"w": np.full(3, version, np.float32)})
    assert sorted(pool.snapshots) == [40, 50, 60, 70]  # size + margin, the newest
    picks = {pool.past(v)[0] for v in range(60, 70) for _ in range(3)}
    assert picks <= {40, 50, 60} and len(picks) > 1  # the newest 3 at version 60-69
    version, snapshot = pool.past(75)
    assert version in (50, 60, 70) and snapshot["w"][0] == version
    assert pool.past(15)[0] == 40  # an actor that lags further: the oldest kept
    state = pool.state()  # the newest `size`: the margin is an actor's, not the run's
    assert state["opponents"]["versions"].tolist() == [50, 60, 70]
    again = selfplay.Pool(params, 10, 3, 5)
    again.load(dict(state))
    assert {v: p["w"][0] for v, p in again.snapshots.items()} == {50: 50, 60: 60, 70: 70}
    crafted = {"opponents": dict(state["opponents"], versions=np.array([np.inf, 1.0, 2.0]))}
    with pytest.raises(UsageError, match="versions are float64"):
        again.load(crafted)


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--opponent-mix", "0.5", "0.5", "0.5"], "sum to 1"),
        (["--opponent-mix", "1.5", "0", "-0.5"], "each at least 0"),
        (["--opponent-snapshot-interval", "0"], "--opponent-snapshot-interval must be positive"),
        (["--lstm"], "no --lstm"),
        (["--no-action-mask"], "drop --no-action-mask"),
    ],
)
def test_bad_self_play_flags_are_one_line(flags, fragment, capsys):
    code, _, err = run_main(
        "ppo_sync_baseline.py", ["--env-id", "TicTacToe-v1", "--self-play", *flags], capsys
    )
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("script", SCRIPTS)
def test_tic_tac_toe_takes_its_own_preset_and_a_flag_wins(script):
    """The TicTacToe preset snapshots every 50 updates at an entropy bonus of 0.3, the other games
    every 10 at 0.1 (the pgx preset); an explicit flag wins over both. A task that does not
    self-play has no snapshot interval."""
    module = load_script(script)

    def preset(env_id, **flags):
        args = module.resolve_args(module.Args(env_id=env_id, self_play=True, **flags))
        return args.opponent_snapshot_interval, args.ent_coef

    assert preset("TicTacToe-v1") == (50, 0.3)
    assert preset("ConnectFour-v1") == preset("KuhnPoker-v1") == (10, 0.1)
    flags = dict(opponent_snapshot_interval=7, ent_coef=0.05)
    assert preset("TicTacToe-v1", **flags) == preset("ConnectFour-v1", **flags) == (7, 0.05)
    assert module.resolve_args(module.Args(env_id="CartPole-v1")).opponent_snapshot_interval is None


@pytest.mark.parametrize(
    "env_id, self_play, fragment",
    [
        ("CartPole-v1", True, "is a one-player task"),
        ("ConnectFour-v1", False, "2-player game: train it with --self-play"),
        ("IntersectionMultiAgent-v1", True, "move at once"),
    ],
)
def test_tasks_that_self_play_does_not_take_are_refused(env_id, self_play, fragment):
    with pytest.raises(UsageError, match=fragment):
        tasks.check_task(env_id, self_play)


def selfplay_flags(run_dir, total=4096, *extra):
    return [
        "--env-id",
        "TicTacToe-v1",
        "--self-play",
        "--num-envs",
        "8",
        "--num-steps",
        "64",
        "--total-timesteps",
        str(total),
        "--opponent-mix",
        "0.4",
        "0.3",
        "0.3",
        "--opponent-snapshot-interval",
        "2",
        "--opponent-pool-size",
        "2",
        "--eval-episodes",
        "20",
        "--run-dir",
        str(run_dir),
        *extra,
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_deterministic_self_play_run_reproduces_and_logs_its_win_rates(script, tmp_path, capsys):
    """Twice the same checkpoint file (the pool in it) and metrics; the win rates by opponent."""
    extra = ["--deterministic", "--log-frequency", "1"]
    extra += ["--num-splits", "2"] if script == "appo_envpool.py" else []
    outs = []
    for i in (0, 1):
        code, out, err = run_main(script, selfplay_flags(tmp_path / str(i), 4096, *extra), capsys)
        assert code == 0, err
        outs.append(out)
    files = [(tmp_path / str(i) / "checkpoint.msgpack").read_bytes() for i in (0, 1)]
    assert files[0] == files[1]
    payload = read_checkpoint(tmp_path / "0")
    # 8 updates, a snapshot every 2, the newest 2 (+ the asynchronous actor's margin) kept
    versions = np.asarray(payload["state"]["opponents"]["versions"]).tolist()
    assert [v for v in versions if v >= 0][-2:] == [6, 8]
    metrics = [(tmp_path / str(i) / "metrics.jsonl").read_text().splitlines() for i in (0, 1)]
    logged = [json.loads(line) for line in metrics[0]]
    tags = {r["tag"] for r in logged}
    assert {"selfplay/win_rate_vs_random", "selfplay/win_rate_vs_latest"} <= tags
    strip = [
        [r for r in m if "SPS" not in r and "timing/" not in r and "wall" not in r] for m in metrics
    ]
    assert [json.loads(r)["value"] for r in strip[0] if "selfplay" in r] == [
        json.loads(r)["value"] for r in strip[1] if "selfplay" in r
    ]
    assert (
        "moving first:" in outs[0] and "moving second:" in outs[0] and "illegal moves: 0" in outs[0]
    )
    # a deterministic run's resume is not built: one line
    argv = ["--resume", str(tmp_path / "0"), "--total-timesteps", "8192"]
    code, _, err = run_main(script, argv, capsys)
    assert code == 2 and "resume without --deterministic" in err, err


def test_a_resume_restores_the_pool(tmp_path, capsys):
    script = "ppo_sync_baseline.py"
    code, _, err = run_main(
        script, selfplay_flags(tmp_path / "run", 2048, "--eval-episodes", "0"), capsys
    )
    assert code == 0, err
    before = read_checkpoint(tmp_path / "run")["state"]["opponents"]
    assert np.asarray(before["versions"]).tolist() == [2, 4]
    code, _, err = run_main(
        script, ["--resume", str(tmp_path / "run"), "--total-timesteps", "3072"], capsys
    )
    assert code == 0, err
    after = read_checkpoint(tmp_path / "run")["state"]["opponents"]
    assert np.asarray(after["versions"]).tolist() == [4, 6]
    # version 4's snapshot came back from the checkpoint, unchanged
    for x, y in zip(jax.tree.leaves(before["params"]), jax.tree.leaves(after["params"])):
        np.testing.assert_array_equal(np.asarray(x)[1], np.asarray(y)[0])


def test_sigterm_stops_a_self_play_run_within_seconds_with_its_pool(tmp_path):
    """APPO (an actor and a learner thread, the opponents' policy calls in the actor's env steps):
    SIGTERM mid-run exits 128 + 15 within seconds, the checkpoint holding the opponent pool."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    argv = selfplay_flags(run_dir, 10_000_000)

    def training():
        path = run_dir / "metrics.jsonl"
        return path.exists() and "losses/" in path.read_text()

    code, seconds, stderr = sigterm_when("appo_envpool.py", argv, logs, training, 240)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert seconds < 15 and "Traceback" not in stderr
    versions = np.asarray(read_checkpoint(run_dir)["state"]["opponents"]["versions"])
    assert (versions >= 0).any() and versions.max() > 0


def test_every_multi_player_id_is_served_by_self_play_or_refused_in_one_line():
    """envpool's turn-based games build the scripts' network and take a policy step on a real
    observation from the learner's seat, the legal mask applied; games whose players move at once
    are refused."""
    module = load_script("ppo_sync_baseline.py")
    served, refused = [], []
    families = ("envpool.pgx", "envpool.highway")  # test_families: the others have one player
    for env_id in envpool.list_all_envs():
        family = envpool.registration.registry.specs[env_id][0]
        if family not in families or tasks.players(env_id) == 1:
            continue
        try:
            args = module.resolve_args(module.Args(env_id=env_id, self_play=True))
        except UsageError as e:
            assert "move at once" in str(e) and "\n" not in str(e), str(e)
            refused.append(env_id)
            continue
        built = {}

        def init(key, args=args, built=built):  # traced: the network's shapes, no compile
            network, _, continuous, _, state = module.build(args, key)
            built.update(network=network, continuous=continuous)
            return state["params"]

        shapes = jax.eval_shape(init, jax.random.PRNGKey(0))
        network, continuous = built["network"], built["continuous"]
        envs = tasks.make_env(env_id, 2, 0, 1, train=True)
        obs, _ = envs.reset()
        policy = module.make_policy_step(network, continuous, values=False)
        inputs = (obs, None, jax.random.PRNGKey(1), np.arange(2), np.zeros(2, np.int64))
        if env_id in ("TicTacToe-v1", "SparrowMahjong-v1", "Backgammon-v1"):  # run, not traced
            params = module.build(args, jax.random.PRNGKey(0))[-1]["params"]
            action = np.asarray(policy(params, *inputs)[0])
            assert obs["action_mask"][np.arange(2), action].all(), env_id  # a legal move
        else:
            assert jax.eval_shape(policy, shapes, *inputs)[0].shape == (2,)
        envs.close()
        served.append(env_id)
    assert len(served) >= 18 and {"TicTacToe-v1", "SparrowMahjong-v1", "Chess-v1"} <= set(served)
    assert refused and all("ntersection" in e for e in refused)


def seat_results(line: str) -> dict:
    """{place: (won, drawn, lost)} from an "eval: against ..." line."""
    found = re.findall(r"moving (\w+): (\d+) won, (\d+) drawn, (\d+) lost", line)
    return {place: tuple(map(int, counts)) for place, *counts in found}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sync_self_play_learns_tic_tac_toe_against_random(tmp_path, capsys):
    """300k steps of TicTacToe's preset (seed 1; the sync baseline is deterministic), then 200
    games of its greedy policy against the uniform random player (utils/evaluate.py --greedy): it
    wins 90% moving first and loses at most 25% moving second. After 1,024 steps it won 71% first
    and lost 51% second; this run won 98% first and lost 12% second (its policy sampled, as the
    preset's entropy bonus of 0.3 keeps it broad: 85% and 33%; 0.0% lost on both seats greedy
    after 2M steps: docs/algorithms/ppo.md#self-play)."""
    run = tmp_path / "run"
    argv = ["--env-id", "TicTacToe-v1", "--self-play", "--total-timesteps", "300000"]
    argv += ["--seed", "1", "--eval-episodes", "0", "--run-dir", str(run)]
    code, out, err = run_main("ppo_sync_baseline.py", argv, capsys)
    assert code == 0, err
    argv = [run, "--greedy", "--opponent", "random", "--games", 200]
    code, out, err = evaluate_here(argv, capsys)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("eval: against"))
    results = seat_results(line)
    first, second = results["first"], results["second"]
    assert sum(first) == sum(second) == 100 and "illegal moves: 0" in line, line
    assert first[0] >= 90 and second[2] <= 25, line


def test_evaluate_plays_a_run_against_random_a_snapshot_and_another_run(tmp_path, capsys):
    """utils/evaluate.py --opponent (in-process, as its command line runs it): the results by
    seat in the line and in eval.json; a snapshot the pool does not keep is one line, naming
    those it keeps."""
    run, other = tmp_path / "run", tmp_path / "other"
    for folder, seed in ((run, 1), (other, 2)):
        argv = selfplay_flags(folder, 2048, "--eval-episodes", "0", "--seed", str(seed))
        assert run_main("ppo_sync_baseline.py", argv) == 0
    for opponent in ("random", f"{run}@4", "RUN@2", str(other)):
        code, out, err = evaluate_here([run, "--opponent", opponent, "--games", 20], capsys)
        assert code == 0, err
        line = next(x for x in out.splitlines() if x.startswith("eval: against"))
        results = seat_results(line)
        assert sum(map(sum, results.values())) == 20 and "illegal moves: 0" in line, line
        stored = json.loads((run / "eval.json").read_text())
        assert stored["opponent"] == opponent and len(stored["seats"]) == 20
        assert {s["place"] for s in stored["seats"]} == {0, 1}
    code, _, err = evaluate_here([run, "--opponent", "RUN@10", "--games", 4], capsys)
    assert code == 2 and "its pool keeps versions 2, 4" in err
