"""The replay families' rounds (dqn_envpool.py; sac_envpool.py, td3_envpool.py): rlpyt's
asynchronous sampling-optimisation mode (Stooke & Abbeel 2019), and its serial mode beside it.

A round: each actor thread collects a chunk of --num-steps steps of each of its envs, stepped a
split at a time (`Collector`, Sample Factory §3.2: the rows `replay.Replay` stores, as envpool
returned them with the action taken on each); the learner adds every actor thread's chunk to the
buffer it owns and, once --learning-starts env steps are in, samples the round's batches and
learns from them (`Learner`), then publishes the parameters. One chunk per actor thread per round
through a queue of --queue-size holds the replay ratio whichever side is faster: the actor waits
on a full queue when the learner is behind, the learner on an empty one when data is short.
`--serial` runs the same collection and round in turn in one thread (`serial_loop`): the baseline.

The algorithm stays in the script, which passes three functions:

    act(params, obs, env_ids, steps) -> actions   # its behaviour policy on one split's batch (env
                                                  # ids counted over the process's actor threads;
                                                  # steps: each env's own over the run)
    act(params, obs, env_ids, steps, first) -> (actions, state)   # a recurrent one (Collector's
                                                  # `recurrent`): it keeps each env's state, reset
                                                  # where `first` (an episode starts), and returns
                                                  # the states it acted from, stored with the rows
    schedule(chunk) -> version                    # the policy version that acts on chunk `chunk`
                                                  # (counted over the run): exactly it with
                                                  # --deterministic, else at least it
    learn(state, batches, step) -> (state, diagnostics)   # the round's gradient steps on
                                                  # batches [S, batch, ...]; step: the env steps
                                                  # once the round counts; a "priorities" entry
                                                  # [S, batch] (prioritised replay) is written back
"""

import queue
import time

import jax
import numpy as np

from jax_async_rl import devices, tasks, threads
from jax_async_rl.replay import gradient_steps, sample_rows


class Collector:
    """One actor thread's envs, `thread` of the process's, stepped a split at a time (`recv`
    returns the split whose step finished, or with --deterministic the next in turn) in chunks of
    --num-steps steps of every env, chunk `first` of the run first. `recurrent`: `act` is a
    recurrent policy (see the module docstring); each row then carries the state it was acted
    from."""

    def __init__(self, envs, act, args, thread: int, shared, first: int, recurrent: bool = False):
        self.envs, self.act, self.shared, self.thread, self.first = envs, act, shared, thread, first
        self.args = args
        self.recvs, self.offset = args.num_steps * args.num_splits, thread * args.num_envs
        self.steps = np.full(
            args.num_envs, first * args.num_steps, np.int64
        )  # each env's steps over the run
        self.stats = tasks.EpisodeStats(args.num_envs)
        # An episode starts at the observation after one that ended an episode (envpool's reset
        # step), or at an env's first: the PPO scripts' `first`.
        self.ended = np.ones(args.num_envs, bool) if recurrent else None
        envs.async_reset()

    def collect(self, params, version: int) -> dict:
        """One chunk: `rows`, the chunk's (env ids, obs, actions, rewards, terminated, truncated,
        elapsed steps[, states]), each env's rows in the order it stepped, ready for `Replay.add`;
        `version`: that of `params` (for the policy lag); `games`: those that ended."""
        rows, timing = [], self.shared.timing
        for _ in range(self.recvs):
            start = time.perf_counter()
            obs, reward, terminated, truncated, info = self.envs.recv()
            timing["env"] += (now := time.perf_counter()) - start
            env_ids = info["env_id"]
            reward = np.where(
                info["elapsed_step"] > 0, reward, 0.0
            )  # a reset's: undefined (dm_control)
            state = ()
            if self.ended is None:
                action = np.asarray(
                    self.act(params, obs, env_ids + self.offset, self.steps[env_ids])
                )
            else:
                action, state = self.act(
                    params, obs, env_ids + self.offset, self.steps[env_ids], self.ended[env_ids]
                )
                action, state, self.ended[env_ids] = (
                    np.asarray(action),
                    (state,),
                    terminated | truncated,
                )
            timing["inference"] += (start := time.perf_counter()) - now
            self.envs.send(tasks.env_action(action, self.envs.action_space), env_ids)
            self.stats.update(env_ids, reward, terminated, truncated, info)
            tasks.check_legal(
                self.args, obs, env_ids, ~(terminated | truncated), info["elapsed_step"]
            )  # masks
            rows.append(
                (
                    env_ids + self.offset,
                    obs,
                    action,
                    reward,
                    terminated,
                    truncated,
                    info["elapsed_step"],
                    *state,
                )
            )
            self.steps[env_ids] += 1
            self.shared.sampled[self.thread] += len(env_ids)
            timing["bookkeeping"] += time.perf_counter() - start
        start = time.perf_counter()
        rows = jax.tree.map(lambda *xs: np.concatenate(xs), *rows)  # one Replay.add for the chunk
        timing["bookkeeping"] += time.perf_counter() - start
        return dict(rows=rows, version=version, games=self.stats.pop())


class Learner:
    """The learner's side of a round, the same in both modes: add each actor thread's chunk to the
    buffer (it owns it), then, once --learning-starts env steps are in (a resumed run refills its
    buffer first), sample the round's batches (`beta(step)`: prioritised replay's importance
    exponent, else uniform), `learn`, write back the priorities. `scalars(step)`: the script's
    own scalars of each round (logged with the update's); `learning_rate(step)`: the one logged."""

    def __init__(
        self, run, replay, learn, rng, timing: dict, learning_rate, beta=None, scalars=None
    ):
        self.run, self.replay, self.learn, self.rng, self.timing = run, replay, learn, rng, timing
        self.learning_rate, self.beta, self.scalars = learning_rate, beta, scalars
        self.args, self.steps = run.args, gradient_steps(run.args)
        self.warm_at = run.start_step + run.args.learning_starts
        # transitions sampled; env steps since the first update
        self.sampled = self.learned_from = 0
        timing["replay"] = 0.0

    def round(self, chunks: list) -> dict:
        run, args, state = self.run, self.args, self.run.state
        start = time.perf_counter()
        for chunk in chunks:
            self.replay.add(*chunk["rows"])
        step = run.global_step + run.batch_size  # the env steps once this round is counted
        lag = [int(state["policy_version"]) - chunk["version"] for chunk in chunks]
        extra = {"async/policy_lag_mean": float(np.mean(lag)), "replay/fill": self.replay.fill}
        extra.update(self.scalars(step) if self.scalars else {})
        diagnostics = {"finite": True}
        if step > self.warm_at:
            batches = self.replay.sample(
                args.batch_size, self.rng, self.beta(step) if self.beta else 0.0, self.steps
            )
            slots = batches.pop("slots")
            self.timing["replay"] += (now := time.perf_counter()) - start
            state, diagnostics = self.learn(state, devices.to_learner(run.mesh, batches), step)
            diagnostics = jax.device_get(diagnostics)
            if "priorities" in diagnostics:
                self.replay.update_priorities(slots.ravel(), diagnostics.pop("priorities").ravel())
            self.timing["update"] += time.perf_counter() - now
            self.sampled += self.steps * args.batch_size * sample_rows(args)
            self.learned_from += run.batch_size
            extra["replay/ratio"] = self.sampled / self.learned_from
        else:
            state = dict(state, policy_version=state["policy_version"] + 1)
            self.timing["replay"] += time.perf_counter() - start
        return run.learned(
            state, dict(diagnostics, learning_rate=self.learning_rate(step)), self.timing, extra
        )


def actor_loop(collector, shared, chunk_queue, device, num_chunks: int, schedule, exact: bool):
    """Collect chunks with the parameters `schedule` names (exactly those if `exact`, else the
    newest once they are out; copied to this actor's device once per version) and queue them."""
    held = params = None
    for chunk_index in range(collector.first, collector.first + num_chunks):
        acting = shared.acting(
            schedule(chunk_index) if exact else min(schedule(chunk_index), chunk_index), exact
        )
        # the run stops (free-running: never an update on a chunk not queued yet)
        if acting is None:
            return
        if acting[1] != held:
            held, params = acting[1], devices.to_actor(device, acting[0])
        chunk = collector.collect(params, held)
        start = time.perf_counter()
        if not threads.put(chunk_queue, chunk, shared.stop):
            return
        shared.timing["queue_put"] += time.perf_counter() - start


def learner_loop(run, learner, shared, queues):
    """Take one chunk from every actor thread's queue, in turn, learn, publish the parameters and
    their version after each round: from run.start_update to run.num_updates, or until the run
    stops."""
    for _ in range(run.start_update, run.num_updates):
        start = time.perf_counter()
        chunks = [threads.get(q, run.stop) for q in queues]
        shared.timing["queue_get"] += time.perf_counter() - start
        if run.should_stop(
            None in chunks, [game for chunk in chunks if chunk for game in chunk["games"]]
        ):
            break
        state = learner.round(chunks)
        shared.publish(state["params"], int(state["policy_version"]))


def serial_loop(run, learner, collectors, device):
    """rlpyt's serial mode: the same collection and round in one thread, in turn."""
    for _ in range(run.start_update, run.num_updates):
        params = devices.to_actor(device, run.state["params"])
        chunks = [c.collect(params, int(run.state["policy_version"])) for c in collectors]
        if run.should_stop(False, [game for chunk in chunks for game in chunk["games"]]):
            break
        learner.round(chunks)


def train(run, learner, collectors, actors, queue_size: int, serial: bool, schedule):
    """Run the rounds to the end of the run, or until it stops: actor threads (one per collector,
    on its device from `actors`, run.actors(); their parameters as `schedule` names them) and the
    learner thread, or with `serial` one thread for both. The main thread waits, so a signal stops
    the run within seconds whatever a thread is doing (a long round, an env that does not
    answer)."""
    envs = [c.envs for c in collectors]
    if serial:
        run.wait(
            run.threads.start(
                "training loop", serial_loop, run, learner, collectors, actors[0][0], owns=envs
            )
        )
        return
    shared, queues = collectors[0].shared, [queue.Queue(maxsize=queue_size) for _ in collectors]
    for i, (collector, (device, _, _)) in enumerate(zip(collectors, actors)):
        run.threads.start(
            f"actor {i}" if i else "actor",
            actor_loop,
            collector,
            shared,
            queues[i],
            device,
            run.num_updates - run.start_update,
            schedule,
            run.args.deterministic,
            owns=[collector.envs],
        )
    run.wait(run.threads.start("learner", learner_loop, run, learner, shared, queues))
