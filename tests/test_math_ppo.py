"""The math of ppo_sync_baseline.py against independent numpy references and hand-computed cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import load_script, random_rollout

ppo = load_script("ppo_sync_baseline.py")

# ---------------------------------------------------------------------------------------------
# GAE (Schulman et al. 2016)
# ---------------------------------------------------------------------------------------------


def gae_by_definition(rewards, values, bootstrap_value, discounts, gae_lambda):
    """Eq. 16 written as the sum it is, in float64: A_t = sum_l (prod_{k<l} lambda d_{t+k})
    delta_{t+l}."""
    rewards, values, discounts = (np.asarray(x, np.float64) for x in (rewards, values, discounts))
    T, B = rewards.shape
    next_values = np.concatenate(
        [values[1:], np.asarray(bootstrap_value, np.float64)[None]], axis=0
    )
    deltas = rewards + discounts * next_values - values
    advantages = np.zeros((T, B))
    for b in range(B):
        for t in range(T):
            weight, total = 1.0, 0.0
            for k in range(T - t):
                total += weight * deltas[t + k, b]
                weight *= gae_lambda * discounts[t + k, b]
            advantages[t, b] = total
    return advantages


@pytest.mark.parametrize("gae_lambda", [0.0, 0.8, 0.95, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compute_gae_matches_definition(seed, gae_lambda):
    rewards, values, bootstrap_value, discounts = random_rollout(np.random.default_rng(seed))
    got = np.asarray(ppo.compute_gae(rewards, values, bootstrap_value, discounts, gae_lambda))
    want = gae_by_definition(rewards, values, bootstrap_value, discounts, gae_lambda)
    assert got.shape == rewards.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_compute_gae_lambda_one_is_discounted_return_minus_value():
    """With lambda = 1, A_t + V_t is the discounted return, bootstrapped only if no episode end."""
    gamma = 0.9
    rewards = np.array([[1.0, 1.0], [2.0, 0.0], [3.0, 5.0]], np.float32)
    values = np.array([[0.5, 1.0], [0.25, 2.0], [4.0, 3.0]], np.float32)
    bootstrap_value = np.array([10.0, 20.0], np.float32)
    dones = np.array([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]], np.float32)  # env 1 ends after step 1
    discounts = gamma * (1.0 - dones)
    returns = np.array(
        [
            [1 + 0.9 * 2 + 0.81 * 3 + 0.729 * 10, 1 + 0.9 * 0],
            [2 + 0.9 * 3 + 0.81 * 10, 0.0],
            [3 + 0.9 * 10, 5 + 0.9 * 20],
        ]
    )
    got = np.asarray(ppo.compute_gae(rewards, values, bootstrap_value, discounts, 1.0))
    np.testing.assert_allclose(got + values, returns, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Time-limit bootstrap (Pardo et al. 2018)
# ---------------------------------------------------------------------------------------------


def test_time_limit_bootstrap_hand_example():
    rewards = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
    values = np.array([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]], np.float32)
    bootstrap_value = np.array([70.0, 80.0], np.float32)
    # env 0 is cut by the time limit at t=0 (its final obs is the obs of t=1), env 1 at t=2
    # (its final obs is the bootstrap obs).
    truncated = np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]], np.float32)
    got = np.asarray(ppo.time_limit_bootstrap(rewards, values, bootstrap_value, truncated, 0.5))
    want = np.array([[1 + 0.5 * 30, 2.0], [3.0, 4.0], [5.0, 6 + 0.5 * 80]])
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# PPO-clip loss (Schulman et al. 2017, eq. 7)
# ---------------------------------------------------------------------------------------------

CLIP = 0.2
VF_COEF = 0.5
ENT_COEF = 0.01


def ppo_case():
    """Hand-made transitions: (ratio, advantage) chosen for each side of the clip; the last is
    masked."""
    ratios = np.array([1.5, 0.5, 0.9, 1.5, 0.5, 3.0])
    advantages = np.array([1.0, -1.0, 2.0, -1.0, 1.0, 100.0])
    mask = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    old_logprobs = np.array([-0.3, -1.2, -0.7, -2.0, -0.1, -0.5])
    logprobs = old_logprobs + np.log(ratios)
    values = np.array([1.0, 2.0, 0.0, -1.0, 0.5, 100.0])
    returns = np.array([2.0, 0.0, 0.0, 1.0, 0.5, -100.0])
    entropy = np.array([0.5, 0.7, 0.6, 0.2, 1.0, 50.0])
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return dict(
        logprobs=f32(logprobs),
        old_logprobs=f32(old_logprobs),
        advantages=f32(advantages),
        values=f32(values),
        returns=f32(returns),
        entropy=f32(entropy),
        mask=f32(mask),
    )


def call_ppo_loss(case, norm_adv=False):
    return ppo.ppo_loss(
        case["logprobs"],
        case["old_logprobs"],
        case["advantages"],
        case["values"],
        case["returns"],
        case["entropy"],
        case["mask"],
        CLIP,
        VF_COEF,
        ENT_COEF,
        norm_adv,
    )


def test_ppo_loss_hand_computed():
    loss, diagnostics = call_ppo_loss(ppo_case())
    # Per valid transition, -min(r A, clip(r) A):
    #   r=1.5, A=+1: clipped at 1.2         -> -1.2
    #   r=0.5, A=-1: clipped at 0.8         -> +0.8
    #   r=0.9, A=+2: inside the clip range  -> -1.8
    #   r=1.5, A=-1: unclipped is smaller   -> +1.5
    #   r=0.5, A=+1: unclipped is smaller   -> -0.5
    policy_loss = (-1.2 + 0.8 - 1.8 + 1.5 - 0.5) / 5
    value_loss = 0.5 * (1.0 + 4.0 + 0.0 + 4.0 + 0.0) / 5
    entropy = (0.5 + 0.7 + 0.6 + 0.2 + 1.0) / 5
    ratios = np.array([1.5, 0.5, 0.9, 1.5, 0.5])
    approx_kl = np.mean(ratios - 1 - np.log(ratios))
    assert float(diagnostics["policy_loss"]) == pytest.approx(policy_loss, rel=1e-5)
    assert float(diagnostics["value_loss"]) == pytest.approx(value_loss, rel=1e-5)
    assert float(diagnostics["entropy"]) == pytest.approx(entropy, rel=1e-5)
    assert float(diagnostics["approx_kl"]) == pytest.approx(approx_kl, rel=1e-4)
    assert float(diagnostics["clipfrac"]) == pytest.approx(4 / 5)
    assert float(loss) == pytest.approx(
        policy_loss + VF_COEF * value_loss - ENT_COEF * entropy, rel=1e-5
    )


def test_ppo_loss_gradients_clip_and_mask():
    """Clipped transitions and masked ones give no policy gradient; the others the surrogate's."""
    case = ppo_case()

    def loss_of(logprobs, values):
        return call_ppo_loss(dict(case, logprobs=logprobs, values=values))[0]

    grad_logprobs, grad_values = jax.grad(loss_of, argnums=(0, 1))(case["logprobs"], case["values"])
    # d(-r A)/d logprob = -r A where the unclipped term is active, 0 where clipped; / 5 valid.
    want_logprobs = np.array([0.0, 0.0, -0.9 * 2.0, 1.5, -0.5, 0.0]) / 5
    # d(vf_coef * 0.5 * mean((v - R)^2))/dv = vf_coef * (v - R) / 5 where valid.
    want_values = VF_COEF * np.array([-1.0, 2.0, 0.0, -2.0, 0.0, 0.0]) / 5
    np.testing.assert_allclose(np.asarray(grad_logprobs), want_logprobs, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_values), want_values, atol=1e-6)


def test_ppo_loss_ignores_masked_entries():
    """Changing every input of a masked transition leaves the loss and diagnostics unchanged."""
    case = ppo_case()
    changed = {k: v.at[-1].set(-7.0 if k != "mask" else 0.0) for k, v in case.items()}
    loss_a, diag_a = call_ppo_loss(case)
    loss_b, diag_b = call_ppo_loss(changed)
    assert float(loss_a) == float(loss_b)
    for name in diag_a:
        assert float(diag_a[name]) == float(diag_b[name]), name
    # ... while un-masking it does change the loss, so the comparison above can fail.
    unmasked = dict(case, mask=jnp.ones_like(case["mask"]))
    assert float(call_ppo_loss(unmasked)[0]) != pytest.approx(float(loss_a))


def test_ppo_loss_normalises_advantages_over_the_valid_transitions():
    """norm_adv (CleanRL's detail 7): the loss with normalised advantages equals the loss without,
    fed (A - mean) / (std + 1e-8) over the transitions that count (masked ones excluded)."""
    case = ppo_case()
    valid = np.asarray(case["mask"]) > 0
    advantages = np.asarray(case["advantages"], np.float64)
    normalised = (advantages - advantages[valid].mean()) / (advantages[valid].std() + 1e-8)
    loss, diagnostics = call_ppo_loss(case, norm_adv=True)
    want_loss, want = call_ppo_loss(dict(case, advantages=jnp.asarray(normalised, jnp.float32)))
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert float(diagnostics["policy_loss"]) == pytest.approx(float(want["policy_loss"]), rel=1e-5)
    assert float(loss) != pytest.approx(
        float(call_ppo_loss(case)[0]), rel=1e-3
    )  # it did change the loss


def test_ppo_loss_all_masked_is_finite():
    case = ppo_case()
    loss, diagnostics = call_ppo_loss(dict(case, mask=jnp.zeros_like(case["mask"])), norm_adv=True)
    assert math.isfinite(float(loss))
    assert all(math.isfinite(float(v)) for v in diagnostics.values())


# ---------------------------------------------------------------------------------------------
# Log-probabilities and entropy
# ---------------------------------------------------------------------------------------------


def test_log_prob_entropy_categorical():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=2.0, size=(6, 4)).astype(np.float32)
    logits[5] = [60.0, -40.0, 0.0, 59.0]  # large logits: a naive softmax would overflow
    actions = np.array([0, 1, 2, 3, 1, 3])
    logprob, entropy = ppo.log_prob_entropy(jnp.asarray(logits), jnp.asarray(actions), False)
    assert logprob.shape == entropy.shape == (6,)
    x = logits.astype(np.float64)
    shifted = np.exp(x - x.max(axis=1, keepdims=True))
    probs = shifted / shifted.sum(axis=1, keepdims=True)
    want_logprob = np.log(probs[np.arange(6), actions])
    want_entropy = -np.sum(
        np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1.0)), 0.0), axis=1
    )
    np.testing.assert_allclose(np.asarray(logprob), want_logprob, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy), want_entropy, rtol=1e-5, atol=1e-5)
    # Uniform logits: log(1/A) and entropy log(A).
    logprob, entropy = ppo.log_prob_entropy(jnp.zeros((1, 4)), jnp.array([2]), False)
    assert float(logprob[0]) == pytest.approx(-math.log(4), rel=1e-6)
    assert float(entropy[0]) == pytest.approx(math.log(4), rel=1e-6)


def test_log_prob_entropy_diagonal_gaussian():
    rng = np.random.default_rng(1)
    B, A = 5, 3
    mean = rng.normal(size=(B, A))
    log_std = rng.normal(scale=0.5, size=(B, A))
    actions = rng.normal(size=(B, A)) * 2.0
    pi = np.concatenate([mean, log_std], axis=-1).astype(np.float32)
    logprob, entropy = ppo.log_prob_entropy(
        jnp.asarray(pi), jnp.asarray(actions, jnp.float32), True
    )
    assert logprob.shape == entropy.shape == (B,)
    sigma = np.exp(log_std)
    density = np.exp(-((actions - mean) ** 2) / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi))
    want_logprob = np.log(np.prod(density, axis=-1))
    want_entropy = np.sum(0.5 * np.log(2 * math.pi * math.e * sigma**2), axis=-1)
    np.testing.assert_allclose(np.asarray(logprob), want_logprob, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy), want_entropy, rtol=1e-5, atol=1e-5)
    # Standard normal in A dimensions at its mean: -A/2 log(2 pi).
    pi = jnp.zeros((1, 2 * A))
    logprob, _ = ppo.log_prob_entropy(pi, jnp.zeros((1, A)), True)
    assert float(logprob[0]) == pytest.approx(-A / 2 * math.log(2 * math.pi), rel=1e-6)


def test_sample_action_distribution():
    """Samples follow the distribution that log_prob_entropy scores (fixed key: deterministic)."""
    key_c, key_g = jax.random.split(jax.random.PRNGKey(0))
    logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
    samples = np.asarray(
        ppo.sample_action(
            jnp.repeat(logits, 20_000, axis=0), jax.random.split(key_c, 20_000), False
        )
    )
    np.testing.assert_allclose(
        np.bincount(samples, minlength=3) / samples.size, [0.1, 0.6, 0.3], atol=0.02
    )
    pi = jnp.repeat(jnp.array([[1.0, -2.0, math.log(0.5), math.log(2.0)]]), 20_000, axis=0)
    samples = np.asarray(ppo.sample_action(pi, jax.random.split(key_g, 20_000), True))
    assert samples.shape == (20_000, 2)
    np.testing.assert_allclose(samples.mean(axis=0), [1.0, -2.0], atol=0.05)
    np.testing.assert_allclose(samples.std(axis=0), [0.5, 2.0], rtol=0.05)
