"""Fixtures shared by the test files: the script under test and tiny finished runs."""

import os
import shutil

# The suite's runs compile the same small functions again and again (the same tiny flags): JAX's
# persistent cache (--compile-cache, the suite's own folder below) keeps every compile, not only
# those over a second, so that each is compiled once. Set before JAX is imported.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402

from helpers import SCRIPTS, assert_ok, cli, run_main, run_script  # noqa: E402

# The script that hosts the run library's tests (tests/test_lib_runs.py): the library is tested
# once, through the cheapest script, not once per script.
LIBRARY_HOST = "ppo_sync_baseline.py"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The learning runs (minutes each, `slow`) first, as one group: with pytest-xdist's two
    workers (pyproject's addopts: -n 2 --dist loadgroup) one worker runs them one after the other
    while the other runs the rest. Two learning runs at once would contend for the 2 cores (a
    learning run of 2 processes took 5x as long beside another).

    tryfirst: pytest-xdist reads the group marker in its own hook of this name, which names each
    grouped test `<id>@learning`; after it, the marker is added too late and the learning runs
    were spread over both workers (tests/test_suite_setup.py)."""
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("learning"))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", params=SCRIPTS)
def script(request):
    """File name of the script under test (every entry of helpers.SCRIPTS)."""
    return request.param


@pytest.fixture(scope="session")
def cartpole_run(script, tmp_path_factory):
    """A finished tiny CartPole-v1 run of `script`, run as a user runs it (2 evaluation episodes,
    one video): its folder. Shared by the tests that need one; they copy it before changing it."""
    run_dir = tmp_path_factory.mktemp("cartpole_run") / "run"
    result = run_script(
        script, cli(script, eval_episodes=2, capture_video=True, run_dir=run_dir), timeout=300
    )
    assert_ok(result)
    (run_dir.parent / "stderr.txt").write_text(result.stderr)
    return run_dir


@pytest.fixture(scope="session")
def host_run(tmp_path_factory):
    """A finished tiny CartPole-v1 run of LIBRARY_HOST, in this process (2 evaluation episodes)."""
    run_dir = tmp_path_factory.mktemp("host_run") / "run"
    assert run_main(LIBRARY_HOST, cli(LIBRARY_HOST, eval_episodes=2, run_dir=run_dir)) == 0
    return run_dir


@pytest.fixture
def host_run_copy(host_run, tmp_path):
    """A copy of host_run to change."""
    shutil.copytree(host_run, tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture(scope="session", autouse=True)
def own_compile_cache(tmp_path_factory):
    """The scripts keep compiled functions under $XDG_CACHE_HOME (--compile-cache): give the suite
    its own, so that it neither fills the user's cache nor starts warm from an earlier suite. The
    two pytest-xdist workers share it (their temporary folders' parent is this suite's), as two
    runs of a user's sweep share the default one: a function either compiled, the other loads."""
    previous = os.environ.get("XDG_CACHE_HOME")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "xdg_cache"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("xdg_cache")
    os.environ["XDG_CACHE_HOME"] = str(folder)
    yield
    if previous is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = previous
