"""Fixtures shared by the test files: the script under test and one tiny finished run of it."""

import os

import pytest

from helpers import SCRIPTS, assert_ok, cli, run_script


@pytest.fixture(scope="session", params=SCRIPTS)
def script(request):
    """File name of the script under test (every entry of helpers.SCRIPTS)."""
    return request.param


@pytest.fixture(scope="session")
def cartpole_run(script, tmp_path_factory):
    """A finished tiny CartPole-v1 run (2 evaluation episodes, one video): its folder.

    Shared by the tests that need an existing run; they copy it before changing anything.
    """
    run_dir = tmp_path_factory.mktemp("cartpole_run") / "run"
    result = run_script(script, cli(script, eval_episodes=2, capture_video=True, run_dir=run_dir), timeout=300)
    assert_ok(result)
    (run_dir.parent / "stderr.txt").write_text(result.stderr)
    return run_dir


@pytest.fixture(scope="session", autouse=True)
def own_compile_cache(tmp_path_factory):
    """The scripts keep compiled functions under $XDG_CACHE_HOME (--compile-cache): give the suite
    its own, so that it neither fills the user's cache nor starts warm from an earlier suite."""
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if previous is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = previous
