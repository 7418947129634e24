"""The math of the asynchronous scripts against independent numpy references: V-trace (Espeholt et
al. 2018, eq. 1, written as the sum it is) and IMPALA's loss (summed as TorchBeast sums it)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import load_script, random_rollout

appo = load_script("appo_envpool.py")
impala = load_script("impala_envpool.py")

# ---------------------------------------------------------------------------------------------
# V-trace (Espeholt et al. 2018)
# ---------------------------------------------------------------------------------------------


def vtrace_by_definition(
    log_rhos, discounts, rewards, values, bootstrap_value, rho_bar, c_bar, pg_rho_bar, lam=1.0
):
    """Eq. 1 as the paper writes it, in float64, with per-step discounts in place of gamma^k:

        v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{k=s}^{t-1} discount_k c_k) rho_t delta_t,
        delta_t = r_t + discount_t V(x_{t+1}) - V(x_t),  rho_t = min(rho_bar, pi/mu),
        c_k = min(c_bar, pi/mu),  V(x_T) = bootstrap_value, v_T = bootstrap_value;
        pg advantage_s = min(pg_rho_bar, pi/mu) (r_s + discount_s v_{s+1} - V(x_s));
    with lam (rlax's lambda_): c_k = lam min(c_bar, pi/mu), and the advantage's v_{s+1} is
    lam v_{s+1} + (1 - lam) V(x_{s+1}).
    """
    log_rhos, discounts, rewards, values = (
        np.asarray(x, np.float64) for x in (log_rhos, discounts, rewards, values)
    )
    bootstrap_value = np.asarray(bootstrap_value, np.float64)
    T, B = rewards.shape
    ratios = np.exp(log_rhos)
    all_values = np.concatenate([values, bootstrap_value[None]], axis=0)  # V(x_0) ... V(x_T)
    vs = np.zeros((T + 1, B))
    vs[T] = bootstrap_value
    for b in range(B):
        for s in range(T):
            total = 0.0
            for t in range(s, T):
                weight = 1.0
                for k in range(s, t):
                    weight *= discounts[k, b] * lam * min(c_bar, ratios[k, b])
                delta = rewards[t, b] + discounts[t, b] * all_values[t + 1, b] - all_values[t, b]
                total += weight * min(rho_bar, ratios[t, b]) * delta
            vs[s, b] = values[s, b] + total
    following = lam * vs[1:] + (1 - lam) * all_values[1:]
    weights = (
        1.0 if pg_rho_bar is None else np.minimum(pg_rho_bar, ratios)
    )  # None: no rho (APPO's PPO loss)
    pg_advantages = weights * (rewards + discounts * following - values)
    return vs[:T], pg_advantages


def off_policy_rollout(seed):
    """helpers.random_rollout (episode ends inside, first and last) plus log importance ratios
    spread over [-2, 2], so that the ratios cross every clipping threshold tested."""
    rng = np.random.default_rng(seed)
    rewards, values, bootstrap_value, discounts = random_rollout(rng, T=11, B=6, gamma=0.95)
    log_rhos = rng.uniform(-2.0, 2.0, size=rewards.shape).astype(np.float32)
    return log_rhos, discounts, rewards, values, bootstrap_value


# (rho_bar, c_bar, pg_rho_bar)
THRESHOLDS = [
    (1.0, 1.0, 1.0),
    (0.5, 0.5, 0.5),
    (2.0, 2.0, 2.0),
    (1.0, 0.5, 1.0),
    (2.0, 1.0, 1.5),
    (0.5, 2.0, 1.0),
]


@pytest.mark.parametrize("thresholds", THRESHOLDS, ids=lambda t: "rho{}-c{}-pg{}".format(*t))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vtrace_matches_paper_sum(seed, thresholds):
    rho_bar, c_bar, pg_rho_bar = thresholds
    inputs = off_policy_rollout(seed)
    ratios = np.exp(inputs[0])
    for threshold in thresholds:  # the inputs do cross every threshold
        assert (ratios < threshold).mean() > 0.1 and (ratios > threshold).mean() > 0.1
    assert (inputs[1] == 0).any()

    vs, pg_advantages = appo.vtrace(*inputs, rho_bar, c_bar, pg_rho_bar)
    want_vs, want_pg = vtrace_by_definition(*inputs, rho_bar, c_bar, pg_rho_bar)
    assert vs.shape == pg_advantages.shape == inputs[2].shape
    np.testing.assert_allclose(np.asarray(vs), want_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pg_advantages), want_pg, rtol=1e-5, atol=1e-5)

    # The IMPALA script's copy of the function is the same function.
    vs_impala, pg_impala = impala.vtrace(*inputs, rho_bar, c_bar, pg_rho_bar)
    np.testing.assert_array_equal(np.asarray(vs_impala), np.asarray(vs))
    np.testing.assert_array_equal(np.asarray(pg_impala), np.asarray(pg_advantages))


@pytest.mark.parametrize("script", [appo, load_script("appo_envpool_xla.py")], ids=["appo", "xla"])
def test_vtrace_without_rho_in_the_advantage(script):
    """APPO's PPO loss weights each sample by pi / mu already (its ratio), so its V-trace advantage
    leaves out IMPALA's rho (clip_pg_rho_threshold None): the same v_s, the advantage r + discount
    (lam v_{s+1} + (1 - lam) V(x_{s+1})) - V(x_s) without the weight, which here matters."""
    inputs = off_policy_rollout(6)
    vs, pg_advantages = script.vtrace(*inputs, 1.0, 1.0, None, lambda_=0.8)
    want_vs, want_pg = vtrace_by_definition(*inputs, 1.0, 1.0, None, lam=0.8)
    np.testing.assert_allclose(np.asarray(vs), want_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pg_advantages), want_pg, rtol=1e-5, atol=1e-5)
    assert np.abs(want_pg - vtrace_by_definition(*inputs, 1.0, 1.0, 1.0, lam=0.8)[1]).max() > 0.1


def test_vtrace_default_thresholds_are_one():
    inputs = off_policy_rollout(3)
    vs, pg_advantages = appo.vtrace(*inputs)
    want_vs, want_pg = vtrace_by_definition(*inputs, 1.0, 1.0, 1.0)
    np.testing.assert_allclose(np.asarray(vs), want_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pg_advantages), want_pg, rtol=1e-5, atol=1e-5)


def discounted_returns(rewards, discounts, bootstrap_value):
    """G_t = r_t + discount_t G_{t+1}, G_T = bootstrap_value (the lambda = 1 return), float64."""
    T = rewards.shape[0]
    returns = np.zeros(rewards.shape)
    following = np.asarray(bootstrap_value, np.float64)
    for t in reversed(range(T)):
        following = rewards[t] + discounts[t] * following
        returns[t] = following
    return returns


@pytest.mark.parametrize("seed", [0, 1])
def test_vtrace_on_policy_is_discounted_return(seed):
    """With pi = mu and thresholds 1, v_s is the n-step (lambda = 1) return bootstrapped from the
    last value, cut at episode ends, and the pg advantage is that return minus V(x_s)."""
    _, discounts, rewards, values, bootstrap_value = off_policy_rollout(seed)
    vs, pg_advantages = appo.vtrace(
        np.zeros_like(rewards), discounts, rewards, values, bootstrap_value
    )
    returns = discounted_returns(
        rewards.astype(np.float64), discounts.astype(np.float64), bootstrap_value
    )
    np.testing.assert_allclose(np.asarray(vs), returns, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pg_advantages), returns - values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("thresholds", THRESHOLDS[:3], ids=lambda t: "rho{}-c{}-pg{}".format(*t))
def test_vtrace_with_lambda_matches_the_sum(thresholds):
    inputs = off_policy_rollout(4)
    vs, pg_advantages = appo.vtrace(*inputs, *thresholds, lambda_=0.8)
    want_vs, want_pg = vtrace_by_definition(*inputs, *thresholds, lam=0.8)
    np.testing.assert_allclose(np.asarray(vs), want_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pg_advantages), want_pg, rtol=1e-5, atol=1e-5)
    assert (
        np.abs(want_vs - vtrace_by_definition(*inputs, *thresholds)[0]).max() > 1e-2
    )  # lambda matters


def gae_by_definition(rewards, discounts, values, bootstrap_value, lam):
    """GAE (Schulman et al. 2016, eq. 16) as a sum, float64: A_s = sum_t (prod_{k<t} discount_k
    lam) delta_t."""
    rewards, discounts, values = (np.asarray(x, np.float64) for x in (rewards, discounts, values))
    all_values = np.concatenate([values, np.asarray(bootstrap_value, np.float64)[None]])
    deltas = rewards + discounts * all_values[1:] - all_values[:-1]
    T = rewards.shape[0]
    advantages = np.zeros_like(rewards)
    for s in range(T):
        weight = np.ones(rewards.shape[1])
        for t in range(s, T):
            advantages[s] += weight * deltas[t]
            weight = weight * discounts[t] * lam
    return advantages


@pytest.mark.parametrize("lam", [0.8, 0.95])
def test_vtrace_on_policy_with_lambda_is_gae(lam):
    """pi = mu: V-trace(lambda) gives sync PPO's targets, GAE(lambda) advantages and returns
    GAE + V, so that APPO with no lag learns from what the sync baseline learns from."""
    _, discounts, rewards, values, bootstrap_value = off_policy_rollout(5)
    vs, pg_advantages = appo.vtrace(
        np.zeros_like(rewards), discounts, rewards, values, bootstrap_value, lambda_=lam
    )
    gae = gae_by_definition(rewards, discounts, values, bootstrap_value, lam)
    np.testing.assert_allclose(np.asarray(pg_advantages), gae, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(vs), gae + values, rtol=1e-5, atol=1e-5)


def test_vtrace_hand_example():
    """T = 2, one env, gamma 0.5: ratios 2 (clipped to 1) then 0.5 (not clipped)."""
    log_rhos = np.log(np.array([[2.0], [0.5]], np.float32))
    discounts = np.array([[0.5], [0.5]], np.float32)
    rewards = np.array([[1.0], [2.0]], np.float32)
    values = np.array([[3.0], [4.0]], np.float32)
    bootstrap_value = np.array([6.0], np.float32)
    # delta_0 = 1 + 0.5*4 - 3 = 0, delta_1 = 2 + 0.5*6 - 4 = 1
    # v_1 = 4 + 0.5 * 1 = 4.5; v_0 = 3 + 1 * 0 + 0.5 * c_0 (=1) * 0.5 * 1 = 3.25
    # pg_0 = min(1, 2) * (1 + 0.5 * 4.5 - 3) = 0.25; pg_1 = 0.5 * (2 + 0.5 * 6 - 4) = 0.5
    vs, pg_advantages = appo.vtrace(log_rhos, discounts, rewards, values, bootstrap_value)
    np.testing.assert_allclose(np.asarray(vs), [[3.25], [4.5]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(pg_advantages), [[0.25], [0.5]], rtol=1e-6)


def test_vtrace_stops_gradients():
    inputs = off_policy_rollout(0)

    def total(log_rhos, values):
        vs, pg = appo.vtrace(log_rhos, inputs[1], inputs[2], values, inputs[4])
        return jnp.sum(vs) + jnp.sum(pg)

    grads = jax.grad(total, argnums=(0, 1))(jnp.asarray(inputs[0]), jnp.asarray(inputs[3]))
    for grad in grads:
        assert not np.asarray(grad).any()


# ---------------------------------------------------------------------------------------------
# IMPALA loss (Espeholt et al. 2018 §4; TorchBeast's sums)
# ---------------------------------------------------------------------------------------------

BASELINE_COST = 0.5
ENTROPY_COST = 0.01


def impala_case():
    """[T=2, B=3] hand-made transitions; (1, 2) is masked out, with absurd values."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return dict(
        logprobs=f32([[-0.5, -1.0, -2.0], [-0.25, -3.0, -50.0]]),
        pg_advantages=f32([[2.0, -1.0, 0.5], [4.0, 1.0, 100.0]]),
        values=f32([[1.0, 0.0, 2.0], [-1.0, 3.0, 100.0]]),
        vs=f32([[2.0, 0.0, 0.0], [1.0, 1.0, -100.0]]),
        entropy=f32([[0.5, 1.0, 0.25], [0.75, 0.5, 60.0]]),
        mask=f32([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
    )


def call_impala_loss(case, entropy_cost=ENTROPY_COST):
    return impala.impala_loss(
        case["logprobs"],
        case["pg_advantages"],
        case["values"],
        case["vs"],
        case["entropy"],
        case["mask"],
        BASELINE_COST,
        entropy_cost,
    )


def test_impala_loss_hand_computed():
    loss, diagnostics = call_impala_loss(impala_case())
    # TorchBeast: pg = sum(-logprob * A), baseline = 0.5 * sum((vs - V)^2), entropy = -sum(H),
    # total = pg + baseline_cost * baseline + entropy_cost * entropy; over the 5 unmasked entries.
    policy_loss = -(-0.5 * 2.0 + -1.0 * -1.0 + -2.0 * 0.5 + -0.25 * 4.0 + -3.0 * 1.0)  # = 5.0
    value_loss = 0.5 * (1.0 + 0.0 + 4.0 + 4.0 + 4.0)  # = 6.5
    entropy_sum = 0.5 + 1.0 + 0.25 + 0.75 + 0.5  # = 3.0
    assert policy_loss == 5.0 and value_loss == 6.5 and entropy_sum == 3.0
    assert float(diagnostics["policy_loss"]) == pytest.approx(policy_loss, rel=1e-6)
    assert float(diagnostics["value_loss"]) == pytest.approx(value_loss, rel=1e-6)
    assert float(diagnostics["entropy"]) == pytest.approx(entropy_sum / 5, rel=1e-6)
    want = policy_loss + BASELINE_COST * value_loss - ENTROPY_COST * entropy_sum
    assert float(loss) == pytest.approx(want, rel=1e-6)


def test_impala_loss_ignores_masked_entries():
    case = impala_case()
    loss_a, diag_a = call_impala_loss(case)
    changed = {k: (v.at[1, 2].set(-7.0) if k != "mask" else v) for k, v in case.items()}
    loss_b, diag_b = call_impala_loss(changed)
    assert float(loss_a) == float(loss_b)
    for name in diag_a:
        assert float(diag_a[name]) == float(diag_b[name]), name
    unmasked = dict(case, mask=jnp.ones_like(case["mask"]))
    assert float(call_impala_loss(unmasked)[0]) != pytest.approx(float(loss_a))
    loss, diagnostics = call_impala_loss(dict(case, mask=jnp.zeros_like(case["mask"])))
    assert float(loss) == 0.0
    assert all(math.isfinite(float(v)) for v in diagnostics.values())


def test_impala_loss_gradient_moves_log_prob_with_the_advantage():
    """d loss / d logits through log_prob_entropy: a gradient-descent step raises the chosen
    action's log-probability where the V-trace advantage is positive, lowers it where negative,
    and leaves masked transitions alone; the gradient is -mask * A * (onehot(a) - softmax)."""
    rng = np.random.default_rng(0)
    T, B, A = 2, 3, 4
    logits = jnp.asarray(rng.normal(size=(T * B, A)), jnp.float32)
    actions = jnp.asarray([0, 3, 1, 2, 2, 0])
    case = impala_case()
    advantages, mask = case["pg_advantages"].at[0, 1].set(-1.5), case["mask"]
    assert (advantages * mask < 0).any() and (advantages * mask > 0).any()

    def loss_of(logits):
        logprobs, entropy = impala.log_prob_entropy(logits, actions, False)
        return impala.impala_loss(
            logprobs.reshape(T, B),
            advantages,
            case["values"],
            case["vs"],
            entropy.reshape(T, B),
            mask,
            BASELINE_COST,
            0.0,
        )[0]

    grad = np.asarray(jax.grad(loss_of)(logits))
    x = np.asarray(logits, np.float64)
    probs = np.exp(x - x.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    onehot = np.eye(A)[np.asarray(actions)]
    want = -(np.asarray(advantages * mask).reshape(-1, 1)) * (onehot - probs)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)

    stepped = logits - 0.01 * grad
    before = np.asarray(impala.log_prob_entropy(logits, actions, False)[0])
    after = np.asarray(impala.log_prob_entropy(stepped, actions, False)[0])
    signed = np.asarray(advantages * mask).reshape(-1)
    assert np.all(after[signed > 0] > before[signed > 0])
    assert np.all(after[signed < 0] < before[signed < 0])
    np.testing.assert_array_equal(after[signed == 0], before[signed == 0])


def test_impala_optimizer_state_has_one_structure_for_any_momentum():
    """--rmsprop-momentum may change on resume: the optimiser state's structure must not."""
    params = {"w": np.zeros((3, 2), np.float32)}
    structures = {
        str(
            jax.tree.structure(
                impala.make_optimizer(impala.Args(rmsprop_momentum=m, max_grad_norm=40.0)).init(
                    params
                )
            )
        )
        for m in (0.0, 0.9)
    }
    assert len(structures) == 1, structures
