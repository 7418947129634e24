"""jax_async_rl.convolution: the matmul form computes what lax.conv_general_dilated computes, its
gradients included, for every layer the scripts' torsos use and for odd sizes, strides and
paddings; `--conv` picks the form; a CPU-trained Pong checkpoint plays the same greedy actions with
either."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers import REPO_ROOT, assert_ok, assert_usage_error, cli, load_script, run_script
from jax_async_rl import convolution, tasks
from jax_async_rl.flags import RunArgs, UsageError, check_bounds

NHWC = ("NHWC", "HWIO", "NHWC")
LAYERS = {
    # the Nature CNN on Atari's 84 x 84 x 4 and on Procgen's 64 x 64 x 3
    "nature 1": ((84, 84, 4), (8, 8, 4, 32), (4, 4), "VALID"),
    "nature 2": ((20, 20, 32), (4, 4, 32, 64), (2, 2), "VALID"),
    "nature 3": ((9, 9, 64), (3, 3, 64, 64), (1, 1), "VALID"),
    "procgen 1": ((64, 64, 3), (8, 8, 3, 32), (4, 4), "VALID"),
    # the MiniGrid torso's 2 x 2 convolutions
    "grid 1": ((7, 7, 3), (2, 2, 3, 16), (1, 1), "VALID"),
    "grid 2": ((3, 3, 16), (2, 2, 16, 32), (1, 1), "VALID"),
    # odd sizes, strides that do not divide, SAME and explicit padding
    "odd same": ((11, 13, 5), (3, 3, 5, 6), (2, 2), "SAME"),
    "odd strides": ((10, 7, 2), (5, 3, 2, 4), (3, 2), "SAME"),
    "explicit": ((7, 7, 3), (3, 3, 3, 8), (1, 1), ((1, 2), (0, 1))),
    "negative": ((8, 9, 3), (3, 2, 3, 4), (2, 1), ((-1, 0), (1, -2))),
    "kernel past input": ((6, 6, 3), (7, 7, 3, 2), (1, 1), "SAME"),
    "stride past kernel": ((13, 11, 2), (2, 2, 2, 3), (3, 4), "VALID"),
    "odd 84": ((83, 85, 4), (8, 8, 4, 5), (4, 4), "VALID"),
}


def both(shape, kernel_shape, strides, padding, batch=3):
    """(native, matmul): each (output, input gradient, kernel gradient) on random inputs."""
    rng = np.random.default_rng(sum(shape) + sum(kernel_shape))
    x = jnp.asarray(rng.standard_normal((batch, *shape)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal(kernel_shape), jnp.float32)
    cotangent = None
    results = []
    for conv in (lax.conv_general_dilated, convolution.conv_general_dilated):

        def f(x, kernel, conv=conv):
            return conv(x, kernel, strides, padding, dimension_numbers=NHWC)

        out, vjp = jax.vjp(f, x, kernel)
        if cotangent is None:
            cotangent = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
        results.append((out, *vjp(cotangent)))
    return results


@pytest.fixture
def form():
    """convolution.use for the test, back to "auto" after it."""
    yield convolution.use
    convolution.use("auto")


@pytest.mark.parametrize("layer", list(LAYERS))
def test_matmul_form_equals_native_with_gradients(form, layer):
    form("matmul")
    native, matmul = both(*LAYERS[layer])
    for name, a, b in zip(("output", "input gradient", "kernel gradient"), native, matmul):
        assert a.shape == b.shape, name
        scale = float(jnp.abs(a).max()) or 1.0
        assert float(jnp.abs(a - b).max()) <= 1e-5 * scale, (layer, name)


def primitives(choice, dimension_numbers=NHWC, shape=(2, 12, 12, 3)):
    convolution.use(choice)
    x = jnp.zeros(shape)
    kernel = jnp.zeros((3, 3, 3, 4) if dimension_numbers == NHWC else (4, 3, 3, 3))
    jaxpr = jax.make_jaxpr(
        lambda x, k: convolution.conv_general_dilated(
            x, k, (2, 2), "VALID", dimension_numbers=dimension_numbers
        )
    )(x, kernel)
    return {equation.primitive.name for equation in jaxpr.jaxpr.eqns}


def test_the_form_follows_the_choice_and_the_backend(form):
    assert "conv_general_dilated" not in primitives("matmul")
    assert "dot_general" in primitives("matmul")
    assert "conv_general_dilated" in primitives("native")
    # auto: the backend's (these tests run on the CPU)
    assert jax.default_backend() == "cpu"
    assert "conv_general_dilated" not in primitives("auto")
    # what the matmul form does not take falls back to the native call: NCHW layouts
    assert "conv_general_dilated" in primitives("matmul", None, (2, 3, 12, 12))
    with pytest.raises(ValueError, match="one of auto, matmul, native"):
        form("fast")


def test_flax_conv_keeps_its_parameters(form):
    """nn.Conv with the argument: the same parameter tree, and parameters initialised by the
    native layer give its output (a checkpoint moves between the forms)."""
    form("matmul")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 84, 84, 4)), jnp.float32)
    native = nn.Conv(32, (8, 8), (4, 4), "VALID")
    matmul = nn.Conv(
        32, (8, 8), (4, 4), "VALID", conv_general_dilated=convolution.conv_general_dilated
    )
    params = native.init(jax.random.PRNGKey(0), x)
    assert jax.tree.map(jnp.shape, matmul.init(jax.random.PRNGKey(0), x)) == jax.tree.map(
        jnp.shape, params
    )
    a, b = native.apply(params, x), matmul.apply(params, x)
    assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(a).max())


def test_the_conv_flag_is_checked():
    check_bounds(dataclasses.replace(RunArgs(), conv="native"))
    with pytest.raises(UsageError, match="--conv.*auto, matmul or native"):
        check_bounds(dataclasses.replace(RunArgs(), conv="fast"))


def test_a_cpu_trained_pong_checkpoint_plays_the_same_greedy_actions(tmp_path, form):
    """Two updates of the sync baseline on Pong (--conv matmul, the CPU's own); the checkpoint's
    network on 64 recorded frames: the same logits to float32 rounding, the same greedy actions
    with either form."""
    run_dir = tmp_path / "run"
    flags = dict(
        num_envs=4,
        num_steps=16,
        num_minibatches=1,
        update_epochs=2,
        total_timesteps=128,
        learning_rate=3e-3,
        eval_episodes=0,
        conv="matmul",
        run_dir=run_dir,
        compile_cache="",
    )
    assert_ok(run_script("ppo_sync_baseline.py", cli("ppo_sync_baseline.py", "Pong-v5", **flags)))
    evaluate = load_script("utils/evaluate.py")
    payload = evaluate.checkpoints.read_checkpoint(str(run_dir / "checkpoint.msgpack"))
    module = evaluate.load_training_script(REPO_ROOT / "ppo_sync_baseline.py")
    args = evaluate.rebuild_args(module, payload["config"], str(run_dir))
    assert args.conv == "matmul"
    built, _, params = evaluate.restore(module, args, payload, str(run_dir))
    envs = tasks.make_env("Pong-v5", 8, 5, 1, train=False)
    obs, _ = envs.reset()
    frames = []
    rng = np.random.default_rng(0)
    for _ in range(8):
        obs, *_ = envs.step(rng.integers(0, 6, size=8))
        frames.append(obs)
    envs.close()
    frames = np.concatenate(frames)
    logits = []
    for choice in ("native", "matmul"):
        form(choice)
        logits.append(np.asarray(built[0].apply(params, frames)[0]))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-5)
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()
    # the forms differ far less than the frames do: the comparison sees the pixels
    assert np.abs(logits[0] - logits[1]).max() < 0.01 * np.ptp(logits[0], axis=0).max()


def test_a_bad_conv_flag_is_one_line():
    assert_usage_error(
        run_script("ppo_sync_baseline.py", ["--env-id", "CartPole-v1", "--conv", "fast"]),
        "--conv",
        "auto, matmul or native",
    )
