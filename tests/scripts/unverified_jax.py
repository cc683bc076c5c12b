"""A rank on a JAX jaxddp was not verified on (faked: ``jax.__version__`` set before
``import jaxddp``): one warning, the ordered path, correct values, JAX's rules untouched.

mpi4jax is imported first, with the real version: its own compatibility layer picks its
imports by ``jax.__version__``.

Prints ``unverified ok`` when every check passed.
"""

import os
import warnings

os.environ["MPI4JAX_NO_WARN_JAX_VERSION"] = "1"  # mpi4jax's own notice on jax 0.12

import jax
import jax.numpy as jnp
import mpi4jax  # noqa: F401
import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend.core.primitives import jit_p

FAKE = "0.13.0"
jax_rule = pe.custom_staging_rules[jit_p]
jax.__version__ = FAKE

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import jaxddp
    from jaxddp._collectives._jax import compat as _jax_compat
    from jaxddp._collectives._jax import path as _path

unverified = [w for w in caught if issubclass(w.category, _jax_compat.UnverifiedJaxWarning)]
assert len(unverified) == 1, [str(w.message) for w in caught]
message = str(unverified[0].message)
assert f"jax {FAKE}" in message, message
assert "ordered path" in message, message
assert "microseconds per argument" in message, message
fast, why = _path.path_reason()
assert not fast, why
assert FAKE in why, why

rank, size = jaxddp.rank(), jaxddp.world_size()
ranks = np.arange(size, dtype=np.float32)


@jax.jit
def helper(x):
    return jaxddp.allreduce(x, op="sum")


def loss(w, x):
    return jaxddp.masked_mean((w * x) ** 2, jnp.ones(x.shape[0], bool))


@jax.jit
def step(w, x):
    total = helper(x)  # a jitted helper inside the step
    mean = jaxddp.allreduce({"x": x}, op="mean")["x"]
    branch = jax.lax.cond(total.sum() > 0, lambda v: jaxddp.allreduce(v, op="max"), lambda v: v, x)
    grad = jax.grad(loss)(w, x)

    def body(carry, _):
        return carry + jaxddp.allreduce(x, op="sum"), None

    looped, _ = jax.lax.scan(body, jnp.zeros_like(x), None, length=3)
    return total, mean, branch, grad, looped


x = jnp.full((4,), rank + 1.0)
w = jnp.float32(0.5)
alone = helper(x)  # the helper called on its own first
total, mean, branch, grad, looped = step(w, x)
values = ranks + 1.0
np.testing.assert_array_equal(alone, np.full(4, values.sum()))
np.testing.assert_array_equal(total, np.full(4, values.sum()))
np.testing.assert_allclose(mean, np.full(4, values.mean()))
np.testing.assert_array_equal(branch, np.full(4, values.max()))
# averaged over the ranks, the one-process gradient of the mean of (w x)^2: mean(2 w x^2)
np.testing.assert_allclose(jaxddp.allreduce(grad), np.mean(2 * 0.5 * values**2), rtol=1e-6)
np.testing.assert_array_equal(looped, np.full(4, 3 * values.sum()))

text = str(jax.make_jaxpr(step)(w, x))
assert "jaxddp_ordered" in text, text
assert "jaxddp_chained" not in text, text
assert pe.custom_staging_rules[jit_p] is jax_rule, "jaxddp replaced JAX's jit staging rule"
ours = [p for p in pe.dce_rules if p.name.startswith("jaxddp")]
assert not ours, f"jaxddp registered DCE rules: {ours}"
print("unverified ok", flush=True)
