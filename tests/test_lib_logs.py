"""jax_async_rl.logs: the logger (metrics.jsonl, TensorBoard) from several threads at once, and
the progress line."""

import json
import threading
import time

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
    assert len(records) == 4 * 200 * 2 and all(set(r) == {"step", "wall_time", "tag", "value"} for r in records)
    for t in range(4):
        steps = [r["step"] for r in records if r["tag"] == f"t{t}/a"]
        assert steps == [1000 * t + i for i in range(200)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.value for e in events.Scalars("t3/b")] == [-i for i in range(200)]
    assert "after/close" not in events.Tags()["scalars"]


def test_a_process_other_than_0_logs_nothing(tmp_path):
    logger = Logger(None, NoTrack())
    logger.log(1, {"x": 1.0})
    logger.close()
    assert not list(tmp_path.iterdir())


def test_the_progress_line(monkeypatch):
    """Steps sampled and learned, SPS and the ETA over the window, the mean of the last 20 games;
    before any learning, no ETA."""
    counts = [0, 0]
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    progress = Progress(10_000, lambda: tuple(counts), interval=3600)
    assert progress.line().endswith("return(last 20) n/a  ETA n/a")
    counts[:] = [1000, 500]
    clock[0] += 10
    progress.returns.extend([10.0, 20.0])
    line = progress.line()
    assert line.startswith("step       1000 sampled        500 learned of 10000") and "SPS     100" in line
    assert "return(last 20) 15.0" in line and line.endswith("ETA 0:03:10")  # 9500 steps left at 50 a second
    progress.close()
    assert not progress.thread.is_alive()
