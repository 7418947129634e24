"""jax_async_rl.logs: the logger (metrics.jsonl, TensorBoard) from several threads at once, on a
full disk, with its metrics.jsonl deleted mid-run; and the progress line."""

import errno
import json
import os
import threading

import pytest

from jax_async_rl.logs import Logger, Progress


class NoTrack:
    track = False


def test_the_logger_from_several_threads_writes_whole_records_to_both_files(tmp_path):
    """The actors log games and the learner its scalars, each from its own thread: every record
    arrives once, as one whole JSON line, and TensorBoard holds the same values."""
    logger = Logger(str(tmp_path), NoTrack())

    def log(thread):
        for i in range(200):
            logger.log(1000 * thread + i, {f"t{thread}/a": i, f"t{thread}/b": -i})

    workers = [threading.Thread(target=log, args=(t,)) for t in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    logger.close()
    logger.close()  # closing twice is harmless
    logger.log(1, {"after/close": 1.0})  # and logging after close does nothing
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 * 200 * 2 and all(
        set(r) == {"step", "wall_time", "tag", "value"} for r in records
    )
    for t in range(4):
        steps = [r["step"] for r in records if r["tag"] == f"t{t}/a"]
        assert steps == [1000 * t + i for i in range(200)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.value for e in events.Scalars("t3/b")] == [-i for i in range(200)]
    assert "after/close" not in events.Tags()["scalars"]


class FullDisk:
    """A file on a full disk: every write fails as the kernel's does (ENOSPC, naming no file)."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("full", ["jsonl", "events"])
def test_a_full_disk_is_one_error_naming_the_file_and_nothing_after(full, tmp_path):
    """The first write that fails raises once, naming its file; every later log, and the close,
    write and raise nothing (the run reports that one error and stops)."""
    logger = Logger(str(tmp_path), NoTrack())
    logger.log(1, {"a": 1.0})
    setattr(logger, full, FullDisk(getattr(logger, full)))
    with pytest.raises(OSError, match="No space left on device") as error:
        logger.log(2, {"a": 2.0})
    assert error.value.filename == (logger.path if full == "jsonl" else logger.events_path)
    logger.log(3, {"a": 3.0})
    logger.close()
    assert [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == ([1] if full == "jsonl" else [1, 2])


def test_a_metrics_file_deleted_mid_run_is_recreated_with_a_warning(tmp_path, capsys):
    """metrics.jsonl deleted while the run logs: the next record recreates it (one warning line),
    and every record from then on is in it; TensorBoard's events hold them all."""
    logger = Logger(str(tmp_path), NoTrack())
    logger.log(1, {"a": 1.0})
    (tmp_path / "metrics.jsonl").unlink()
    logger.log(2, {"a": 2.0})
    logger.log(3, {"a": 3.0})
    logger.close()
    assert [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [2, 3]
    err = capsys.readouterr().err
    assert (
        err.count("warning:") == 1
        and "metrics.jsonl was deleted mid-run; recreated from step 2 on" in err
    ), err
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("a")] == [1, 2, 3]


def test_a_process_other_than_0_logs_nothing(tmp_path):
    logger = Logger(None, NoTrack())
    logger.log(1, {"x": 1.0})
    logger.close()
    assert not list(tmp_path.iterdir())


def test_the_progress_line():
    """Steps sampled and learned, SPS over the window, the mean of the last 20 games; while the
    first update compiles no SPS (the actor waits: it read 0) and no ETA, "compiling"; after it
    no ETA (its time is compile time, never a rate), then the time left at the pace between
    update ends, and SPS over the time since the compile."""
    counts, clock = [0, 0], [1000.0]
    progress = Progress(10_000, lambda: tuple(counts), interval=3600, clock=lambda: clock[0])
    assert progress.line().endswith(
        "SPS     n/a  return(last 20) n/a  ETA n/a (compiling the first update)"
    )
    counts[:] = [1000, 500]
    clock[0] += 10
    progress.updated(500)
    progress.returns.extend([10.0, 20.0])
    line = progress.line()
    assert (
        line.startswith("step       1000 sampled        500 learned of 10000")
        and "SPS     n/a" in line
    )
    assert "return(last 20) 15.0" in line and line.endswith("ETA n/a")
    clock[0] += 10
    counts[:] = [2000, 1000]
    progress.updated(1000)
    line = progress.line()
    assert "SPS     100" in line and line.endswith("ETA 0:03:00")  # 9000 steps left at 50 a second
    clock[0] += 4
    assert progress.line().endswith("ETA 0:02:56")  # and it counts down between updates
    progress.close()
    assert not progress.thread.is_alive()


def test_the_eta_counts_the_phases_left():
    """A replay run (TD3's: 12,000 steps, learning from step 5,000): rounds of 64 steps every
    0.1 s fill the buffer with random actions, then the first learning round compiles for 20 s,
    then each takes 1 s. While filling, the line gives the time to learning's start and no ETA
    (the learning pace is unknown: it read 0:00:00 at step 5,088); while the learner compiles,
    "compiling" and no SPS (it read 0:00:01 while SAC compiled); then the learning pace alone."""
    clock, steps = [0.0], [0]
    progress = Progress(
        12_000,
        lambda: (steps[0], steps[0]),
        interval=3600,
        clock=lambda: clock[0],
        start=False,
        learning_from=5_000,
    )
    assert progress.line().endswith(
        "SPS     n/a  return(last 20) n/a  ETA n/a (compiling; learning starts at step 5000)"
    )
    while steps[0] + 64 <= 5_000:
        clock[0] += 0.1
        steps[0] += 64
        progress.updated(steps[0])
        if steps[0] == 2_560:
            line = progress.line()
            assert "SPS     640" in line and line.endswith(
                "ETA n/a (learning starts at step 5000 in 0:00:03)"
            ), line
    assert steps[0] == 4_992
    clock[0] += 10
    assert progress.line().endswith(
        "SPS     n/a  return(last 20) n/a  ETA n/a (compiling the first update)"
    )
    for seconds in (10, 1, 1, 1):
        clock[0] += seconds
        steps[0] += 64
        progress.updated(steps[0])
    assert steps[0] == 5_248 and progress.line().endswith(
        "ETA 0:01:45"
    )  # 6,752 steps left at 64 a second
    progress.close()

    never = Progress(
        12_000,
        lambda: (steps[0], steps[0]),
        interval=3600,
        clock=lambda: clock[0],
        start=False,
        learning_from=25_000,
    )  # a budget that ends before learning would start: filling is the run
    assert never.line().endswith("ETA n/a (compiling)")
    for steps[0] in (64, 128, 192):
        clock[0] += 0.1
        never.updated(steps[0])
    assert never.line().endswith("ETA 0:00:18")  # 11,808 steps left at 640 a second


@pytest.mark.parametrize("seconds_per_update", [3.7, 13.0, 41.0])
def test_the_eta_is_steady_on_a_steady_run(seconds_per_update):
    """Updates of a fixed size at a fixed pace (slower than, near and faster than the line's 5 s),
    a line every 5 s: between consecutive lines the ETA moves by less than 20% of its value
    beyond the 5 s that passed (the issue's Pong run flipped by 2x)."""
    clock, learned, batch = [0.0], [0], 512
    progress = Progress(
        10_000_000,
        lambda: (learned[0], learned[0]),
        interval=3600,
        clock=lambda: clock[0],
        start=False,
    )
    next_update, etas = 30.0, []  # the first update ends after 30 s of compiling
    for line in range(1, 400):
        while next_update <= line * 5.0:
            clock[0], learned[0] = next_update, learned[0] + batch
            progress.updated(learned[0])
            next_update += seconds_per_update
        clock[0] = line * 5.0
        eta = progress.line().split("ETA ")[1]
        if ":" in eta:
            h, m, s = map(int, eta.split(":"))
            etas.append(h * 3600 + m * 60 + s)
    assert len(etas) > 300
    moves = [abs(b - (a - 5)) / a for a, b in zip(etas, etas[1:])]
    assert max(moves) < 0.2, max(moves)
    expected = (10_000_000 - learned[0]) * seconds_per_update / batch
    assert abs(etas[-1] - expected) / expected < 0.2
