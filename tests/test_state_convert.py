"""State dtype converters (pallas_kernels/state_convert.py via gdn_jax.decode.convert_state).

Narrowing must be round-to-nearest-even, bit for bit (ties included); widening exact; out of
place. Interpret mode on the CPU, compiled on the GPU (`-m gpu`)."""

import jax
import gdn_jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import KERNEL_MODES as MODES, interpret_flag

from gdn_jax import decode as dec
from gdn_jax import reference as ref



def _state_with_ties(shape, dtype, seed):
    """Random fp32 values, a quarter of them exact halfway points between two 16-bit values
    (where only round-to-nearest-even gives the right answer), some tiny, some huge."""
    rng = np.random.default_rng(seed)
    x = (0.3 * rng.standard_normal(shape)).astype(np.float32)
    lo = x.astype(dtype).astype(np.float32)
    hi = np.nextafter(x.astype(dtype), np.asarray(np.inf, dtype)).astype(np.float32)
    tie = rng.random(shape) < 0.25
    x = np.where(tie, (lo.astype(np.float64) + hi) / 2, x).astype(np.float32)
    x.flat[:7] = [1e-8, -3e-6, 6.0e4, -7.0e4, 1e30, 0.0, -0.0]  # fp16 overflows to inf, as a cast does
    return x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(3, 4, 32, 32), (2, 2, 64, 16)])
def test_narrowing_is_round_to_nearest_even(mode, dtype, shape):
    npdt = np.float16 if dtype == jnp.float16 else ml_dtypes.bfloat16
    x = _state_with_ties(shape, npdt, seed=sum(shape))
    with np.errstate(over="ignore"):
        want = x.astype(npdt)  # numpy / ml_dtypes cast: IEEE round to nearest even
    xs = jnp.asarray(x)
    y = dec.convert_state(xs, dtype, impl="pallas", interpret=interpret_flag(mode))
    assert y.dtype == dtype and y.shape == shape
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(xs), x)  # out of place: the input is intact
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16),
                                  np.asarray(ref.state_to_16bit(xs, dtype)).view(np.uint16))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_widening_is_exact(mode, dtype):
    npdt = np.float16 if dtype == jnp.float16 else ml_dtypes.bfloat16
    with np.errstate(over="ignore"):
        x16 = _state_with_ties((4, 2, 32, 32), npdt, seed=5).astype(npdt)
    y = dec.convert_state(jnp.asarray(x16), jnp.float32, impl="pallas", interpret=interpret_flag(mode))
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), x16.astype(np.float32))


def test_convert_dispatch_and_errors():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2, 16, 16)), jnp.float32)
    # auto on CPU takes the reference (same bits)
    if jax.default_backend() != "gpu":
        choice = gdn_jax.explain("convert_state", x, jnp.float16, interpret=False)
        assert choice.impl == "reference" and "GPU" in choice.reason
        with pytest.raises(ValueError, match="need a GPU"):
            dec.convert_state(x, jnp.float16, impl="pallas", interpret=False)
    y = dec.convert_state(x, jnp.float16)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x).astype(np.float16))
    with pytest.raises(ValueError, match="between fp32 and a 16-bit"):
        dec.convert_state(x, jnp.float32, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        dec.convert_state(x.reshape(-1)[:15], jnp.float16, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="^state must be a floating-point array"):
        dec.convert_state(x.astype(jnp.int32), jnp.float16, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="impl must be"):
        dec.convert_state(x, jnp.float16, impl="fast")
    from gdn_jax import dispatch
    assert dispatch.select("convert_state", dec.ConvertCall("float32", "bfloat16", 1 << 20), "auto",
                           backend="gpu").impl == "pallas"
