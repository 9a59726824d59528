"""Both blocks with their heads split over a mesh's "tp" axis equal the unsharded blocks.

The normal (single-device CPU) suite runs this file a second time in a child process with 4 host
devices (`test_on_host_devices`; XLA's device count is fixed when JAX starts, so it cannot be
raised in this process). There, and on a machine with several GPUs (`-m gpu`), the tests below
run directly: every block operation under a mesh of 2 and 4 devices against the unsharded block
(fp32, <= 1e-6 relative), through the references and the kernels (interpret mode on the CPU,
compiled on GPUs), the compiled program's collectives, the donated decode step updating its
state in place with no input moved per call, the head-count errors, `from_pretrained(...,
mesh=)` reading each device's slice only and `bench block --mesh 2 --smoke`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import gdn_jax
from gdn_jax.layers import GDNConfig, KDAConfig, KimiDeltaAttention, Qwen3NextGatedDeltaNet
from gdn_jax.layers import tensor_parallel as tp
from gdn_jax.loading import SafetensorsCheckpoint

from conftest import FULL, full_run

HOST_DEVICES = 4
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
# Mesh vs unsharded, fp32, relative L2. The two differ by summation order only: XLA's dot over a
# device's slice of a projection's rows does not round like the full projection (about 1e-7 per
# projection), and the partial outputs are summed by the all-reduce. Over 4 rows the outputs
# typically differ by 2e-7..4e-7; single-token outputs of the Qwen3.5 block reach 1.5e-6 where
# the random weights cancel, hence 2e-6 rather than the 1e-6 an ideal split would give.
TOL = 2e-6

several = pytest.mark.skipif(len(jax.devices()) < 2, reason=(
    "needs several devices: test_on_host_devices runs this file with 4 host devices"))


# The child runs in two shards (the serving cases, the rest) so the suite's workers share them.
CHILD_SHARDS = {"serving": "test_serving_matches_unsharded",
                "rest": "not test_serving_matches_unsharded"}


@pytest.mark.parametrize("shard", sorted(CHILD_SHARDS))
def test_on_host_devices(shard, request):
    """Run this file (one shard of it) in a child process with 4 host CPU devices; every test
    there must pass and none may be skipped for want of devices."""
    if len(jax.devices()) >= 2:
        pytest.skip("this process has several devices: the tests run here directly")
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={HOST_DEVICES}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = full_run(request.config)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        "-rs", "-k", CHILD_SHARDS[shard], *(["--full"] if full else []),
                        os.path.abspath(__file__)], env=env,
                       cwd=root, capture_output=True, text=True, timeout=1200)
    out = r.stdout[-8000:] + r.stderr[-3000:]
    assert r.returncode == 0, out
    passed = re.search(r"(\d+) passed", r.stdout)
    runs = lambda marks: not any(m.name == "gpu" or (m.name == "full" and not full) for m in marks)
    cpu = lambda cases: sum(1 for c in cases if runs(getattr(c, "marks", ())))
    # serving: every CPU serving case; rest: every CPU forward case plus the file's other tests
    # (two of them in the full matrix only)
    expected = cpu(SERVING_CASES) if shard == "serving" else cpu(FORWARD_CASES) + (9 if full else 7)
    assert passed and int(passed.group(1)) >= expected, out
    assert "needs several devices" not in r.stdout and "needs 4 devices" not in r.stdout, out


# --------------------------------------------------------------------------- helpers

def make_mesh(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    return Mesh(np.array(jax.devices()[:n]), ("tp",))


BLOCKS = {
    "qwen3_next": lambda **kw: Qwen3NextGatedDeltaNet(
        GDNConfig(hidden_size=32, num_k_heads=4, num_v_heads=8, head_k_dim=16, head_v_dim=16),
        rngs=nnx.Rngs(3), **kw),
    "qwen3_5_split": lambda **kw: Qwen3NextGatedDeltaNet(
        GDNConfig(hidden_size=32, num_k_heads=4, num_v_heads=8, head_k_dim=16, head_v_dim=16,
                  layout="split", conv_bias=True), rngs=nnx.Rngs(4), **kw),
    "kda": lambda **kw: KimiDeltaAttention(
        KDAConfig(hidden_size=32, num_heads=4, head_dim=16, lower_bound=-5.0, output_gate_bias=True),
        rngs=nnx.Rngs(5), **kw),
}


class Mode:
    """impl and interpret switch of a test mode (conftest.MODES)."""

    def __init__(self, mode):
        self.impl = "reference" if mode == "reference" else "pallas"
        self.interpret = mode == "interpret"

    def __enter__(self):
        self._ctx = gdn_jax.interpret(self.interpret)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close(got, want, what):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if jnp.issubdtype(want.dtype, jnp.floating):
        assert np.all(np.isfinite(np.asarray(got, np.float64))), what
        assert rel(got, want) <= TOL, (what, rel(got, want))
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)


def assert_states_close(block, got, want, what):
    """A mesh state (gathered to the unsharded layout) equals the unsharded block's state."""
    got = tp.gather_state(block, got)
    g_leaves, g_def = jax.tree_util.tree_flatten_with_path(got)
    w_leaves, w_def = jax.tree_util.tree_flatten_with_path(want)
    assert g_def == w_def, what
    for (path, g), (_, w) in zip(g_leaves, w_leaves):
        assert_close(g, w, f"{what}{jax.tree_util.keystr(path)}")


def random_serving(block, num_slots, key):
    """A serving state with random pools (nothing pending): untouched slots must stay so."""
    s = block.init_serving_state(num_slots)
    k1, k2 = jax.random.split(key)
    import dataclasses
    delta = dataclasses.replace(s.delta, states=0.1 * jax.random.normal(k1, s.delta.states.shape))
    conv = dataclasses.replace(s.conv, windows=jax.random.normal(k2, s.conv.windows.shape))
    return dataclasses.replace(s, delta=delta, conv=conv)


def copy_tree(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


class Compiled:
    """An unsharded block whose operations (`__call__`, `prefill`, `decode`, ...) each run as one
    jitted program, compiled once per operation, static keywords and shapes: the side the mesh
    is compared with compiles a few whole programs instead of dispatching op by op (the CPU
    suite's time). The same block code runs, traced under the caller's interpret switch."""

    def __init__(self, block):
        self.block = block
        self.config = block.config
        self._graphdef, self._params = nnx.split(block)
        self._programs = {}

    def _program(self, op, **static):
        key = (op, tuple(sorted(static.items())))
        if key not in self._programs:
            graphdef = self._graphdef
            self._programs[key] = jax.jit(
                lambda params, *args: getattr(nnx.merge(graphdef, params), op)(*args, **static))
        return self._programs[key]

    def __getattr__(self, op):
        if op.startswith("_"):
            raise AttributeError(op)
        return lambda *args, **static: self._program(op, **static)(self._params, *args)

    def __call__(self, *args, **static):
        return self._program("__call__", **static)(self._params, *args)

    def init_state(self, *args):
        return self.block.init_state(*args)


# --------------------------------------------------------------------------- equality

# (devices, block, mode): each block through the references and the kernels, on 2 and 4
# devices, kept few because each case compiles a dozen sharded programs on the CPU. On GPUs every
# block runs compiled on 2.
# Kept few (the suite's time budget): each block variant, each mode and both mesh sizes appear
# (the reference mode in the full matrix only).
# The full matrix adds the KDA serving case (KDA's mesh path is in the forward cases) and the
# references' forward case (references and kernels share the blocks' mesh code, which the other
# cases run).
FORWARD_CASES = [pytest.param(2, "qwen3_next", "reference", marks=FULL),
                 (2, "qwen3_5_split", "interpret"), (4, "kda", "interpret")]
FORWARD_CASES += [pytest.param(2, b, "gpu", marks=pytest.mark.gpu) for b in BLOCKS]
SERVING_CASES = [(2, "qwen3_next", "interpret"), pytest.param(4, "kda", "reference", marks=FULL)]
SERVING_CASES += [pytest.param(2, b, "gpu", marks=pytest.mark.gpu) for b in BLOCKS]


@several
@pytest.mark.parametrize("n,name,mode", FORWARD_CASES)
def test_forward_matches_unsharded(name, mode, n):
    """__call__: a prefill from a given state, then a single-token continuation."""
    mesh = make_mesh(n)
    one, split = Compiled(BLOCKS[name]()), BLOCKS[name](mesh=mesh)
    b, t, hidden = 4, 5, one.config.hidden_size
    ks = jax.random.split(jax.random.PRNGKey(n), 4)
    x = jax.random.normal(ks[0], (b, t + 1, hidden))
    state = one.init_state(b)
    state = type(state)(recurrent=0.1 * jax.random.normal(ks[1], state.recurrent.shape),
                        conv=jax.random.normal(ks[2], state.conv.shape))
    with Mode(mode) as m:
        y1, s1 = one(x[:, :t], copy_tree(state), impl=m.impl)
        ys, ss = split(x[:, :t], tp.shard_state(split, copy_tree(state)), impl=m.impl)
        assert_close(ys, y1, "prefill y")
        assert_states_close(split, ss, s1, "prefill state")
        assert ss.recurrent.sharding.spec == jax.sharding.PartitionSpec(None, "tp")
        y1, s1 = one(x[:, t:], s1, impl=m.impl)
        ys, ss = split(x[:, t:], ss, impl=m.impl)
        assert_close(ys, y1, "decode y")
        assert_states_close(split, ss, s1, "decode state")
        # A fresh state (state=None) is made on the mesh (the prefill's shapes: no new program).
        y1, _ = one(x[:, :t], impl=m.impl)
        ys, ss = split(x[:, :t], impl=m.impl)
        assert_close(ys, y1, "fresh y")


@several
@pytest.mark.parametrize("n,name,mode", SERVING_CASES)
def test_serving_matches_unsharded(name, mode, n):
    """prefill, decode, carried verify + accept, verify with intermediate states + accept,
    decode, flush: every output, flag and the whole serving state after each step."""
    mesh = make_mesh(n)
    one, split = Compiled(BLOCKS[name]()), BLOCKS[name](mesh=mesh)
    hidden, num_slots = one.config.hidden_size, 5
    ks = jax.random.split(jax.random.PRNGKey(10 + n), 8)
    s1 = random_serving(one.block, num_slots, ks[0])
    ss = tp.shard_state(split, copy_tree(s1))
    slots = jnp.array([3, -1, 0, 4], jnp.int32)
    x = lambda i, t: jax.random.normal(ks[i], (4, t, hidden))
    with Mode(mode) as m:
        def both(op, *args, **kw):
            out1 = getattr(one, op)(*args[0], **kw)
            outs = getattr(split, op)(*args[1], **kw)
            return out1, outs

        x0 = x(1, 6)
        (y1, s1), (ys, ss) = both("prefill", (x0, s1, slots), (x0, ss, slots), impl=m.impl)
        assert_close(ys, y1, "prefill y")
        assert_states_close(split, ss, s1, "after prefill")
        x1 = x(2, 1)
        (y1, s1), (ys, ss) = both("decode", (x1, s1, slots), (x1, ss, slots), impl=m.impl)
        assert_close(ys, y1, "decode y")
        assert_states_close(split, ss, s1, "after decode")
        x2 = x(3, 3)
        assert split.carry_engages(ss, 3, impl=m.impl)
        (y1, s1, r1), (ys, ss, rs) = both("verify", (x2, s1, slots), (x2, ss, slots), impl=m.impl)
        assert_close(ys, y1, "carried verify y")
        assert_close(rs, r1, "carried verify refused")
        assert_states_close(split, ss, s1, "after carried verify")
        acc = jnp.array([2, 1, 3, 1], jnp.int32)
        (s1, i1), (ss, i_s) = both("accept", (s1, slots, acc), (ss, slots, acc))
        assert_close(i_s, i1, "accept invalid")
        assert_states_close(split, ss, s1, "after accept")
        x3 = x(4, 2)
        (y1, s1, r1), (ys, ss, rs) = both("verify", (x3, s1, slots), (x3, ss, slots), carry=False,
                                          impl=m.impl)
        assert ss.candidates is not None
        assert_close(ys, y1, "verify (intermediate states) y")
        assert_states_close(split, ss, s1, "after verify with intermediate states")
        acc = jnp.array([1, 1, 2, 2], jnp.int32)
        (s1, i1), (ss, i_s) = both("accept", (s1, slots, acc), (ss, slots, acc))
        assert_states_close(split, ss, s1, "after its accept")
        x4 = x(5, 1)
        (y1, s1), (ys, ss) = both("decode", (x4, s1, slots), (x4, ss, slots), impl=m.impl)
        assert_close(ys, y1, "second decode y")
        x5 = x(6, 3)   # the first carried verify's width: its programs again
        (y1, s1, _), (ys, ss, _) = both("verify", (x5, s1, slots), (x5, ss, slots), impl=m.impl)
        (s1, _), (ss, _) = both("accept", (s1, slots, acc), (ss, slots, acc))
        s1, ss = one.flush(s1, impl=m.impl), split.flush(ss, impl=m.impl)
        assert_states_close(split, ss, s1, "after flush")
        assert int(np.max(np.asarray(ss.delta.stash.pending))) == 0


@several
def test_verify_refusal_under_mesh():
    """A second verify before the verdict is refused with the unsharded path's ValueError."""
    mesh = make_mesh(2)
    split = BLOCKS["kda"](mesh=mesh)
    ss = split.init_serving_state(4)
    slots = jnp.array([1, 2], jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 2, split.config.hidden_size))
    _, ss, refused = split.verify(x, ss, slots)
    assert not np.any(np.asarray(refused))
    with pytest.raises(ValueError, match="awaiting its verdict"):
        split.verify(x, ss, slots)
    with pytest.raises(ValueError, match="accepted must lie in 1..4"):
        split.accept(ss, slots, jnp.array([0, 1], jnp.int32))


# --------------------------------------------------------------------------- the compiled program

def _count_collectives(text):
    return (len(re.findall(r"\ball-reduce(?:-start)?\(", text)),
            len(re.findall(r"\b(?:all-gather|all-to-all|collective-permute)(?:-start)?\(", text)))


@several
@pytest.mark.parametrize("name", ["qwen3_next", pytest.param("kda", marks=FULL)])
def test_one_all_reduce_no_gather(name):
    """Each block call compiles to exactly one all-reduce (the output projection's partial
    sums) and no all-gather / all-to-all / permute: the state never leaves its device.
    accept and flush have no collective at all. The donated serving decode step updates its
    state in place and moves no input between devices per call (`_check_donated_step`)."""
    mesh = make_mesh(2)
    split = BLOCKS[name](mesh=mesh)
    graphdef, params = nnx.split(split)
    hidden = split.config.hidden_size
    x3 = jax.random.normal(jax.random.PRNGKey(1), (2, 3, hidden))
    slots = jnp.array([1, 0], jnp.int32)
    serving = split.init_serving_state(4)
    state = split.init_state(2)

    def compiled(fn, *args):
        return jax.jit(fn).lower(*args).compile().as_text()

    calls = {
        "__call__": (lambda p, x, s: nnx.merge(graphdef, p)(x, s), params, x3, state),
        "prefill": (lambda p, x, s, sl: nnx.merge(graphdef, p).prefill(x, s, sl), params, x3,
                    serving, slots),
        "verify": (lambda p, x, s, sl: nnx.merge(graphdef, p).verify(x, s, sl), params, x3,
                   serving, slots),
    }
    for what, (fn, *args) in calls.items():
        reduces, others = _count_collectives(compiled(fn, *args))
        assert (reduces, others) == (1, 0), (what, reduces, others)
    for what, fn, args in (
            ("accept", lambda p, s, sl: nnx.merge(graphdef, p).accept(s, sl, jnp.ones_like(sl)),
             (params, serving, slots)),
            ("flush", lambda p, s: nnx.merge(graphdef, p).flush(s), (params, serving))):
        assert _count_collectives(compiled(fn, *args)) == (0, 0), what
    # The serving decode as the bench times it (donated, inputs on the mesh): the same one
    # all-reduce, and the state updated in place (the pure-JAX path on the CPU).
    _check_donated_step(split, "serving decode")


def _aliased_params(hlo: str) -> set[int]:
    """The entry parameters the compiled module updates in place (its input_output_alias)."""
    header = hlo.split("\n", 1)[0]
    m = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", header)
    return {int(i) for i in re.findall(r":\s*\((\d+),", m.group(1))} if m else set()


def _check_donated_step(block, op, *, copies=True):
    """The donated step `bench block --mesh` times for `op` ("serving decode" or "call T=1"),
    compiled once on `block`'s mesh: one all-reduce and no other collective; every state
    buffer (pool, windows, stashes) aliased in place and, with `copies`, no copy of a
    state-sized buffer; with the inputs where the bench puts them, two chained calls move
    nothing between devices (`jax.transfer_guard("disallow")`) and consume the donated state."""
    from test_blocks_fused import _state_copies

    from gdn_jax.bench.block import mesh_case
    program, args, chain = mesh_case(block, op, 2, unroll=1)
    state = args[2]
    compiled = program.lower(*args).compile()
    hlo = compiled.as_text()
    assert _count_collectives(hlo) == (1, 0), op
    first = len(jax.tree.leaves(args[:2]))
    want = set(range(first, first + len(jax.tree.leaves(state))))
    assert want <= _aliased_params(hlo), (op, sorted(want - _aliased_params(hlo)))
    pools = ((state.delta.states, state.conv.windows) if op == "serving decode"
             else (state.recurrent, state.conv))
    if copies:
        for pool in pools:
            local = pool.sharding.shard_shape(pool.shape)
            assert _state_copies(hlo, local) == [], (op, local)
    with jax.transfer_guard("disallow"):
        out = compiled(*args)
        assert all(p.is_deleted() for p in pools), op
        out = compiled(*chain(out, args))
    assert np.all(np.isfinite(np.asarray(out[0], np.float32))), op
    # x made on the default device, uncommitted (as `jax.random.normal` makes it): it would be
    # moved onto the mesh on every call.
    x_default_device = jnp.asarray(np.asarray(args[1]))
    with jax.transfer_guard("disallow"), pytest.raises(Exception, match="(?i)disallowed"):
        compiled(*chain(out, (args[0], x_default_device) + tuple(args[2:])))


@several
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_next", "kda"])
def test_donated_steps_in_place_gpu(name):
    """On GPUs (the kernels compiled): the serving decode and the T=1 call (the one-launch
    kernel) under a mesh of 2 alias their state in place with no state-sized copy."""
    one = BLOCKS[name]()
    state = one.init_state(2)
    x = jnp.ones((2, 1, one.config.hidden_size))
    # The fused kernel takes the unsharded call (the mesh's bodies have the same head dims).
    assert one._one_launch(x, state.recurrent, state.conv, None, "auto") is not None
    block = BLOCKS[name](mesh=make_mesh(2))
    for op in ("serving decode", "call T=1"):
        _check_donated_step(block, op)


# --------------------------------------------------------------------------- errors

def test_heads_must_divide_the_mesh():
    """ValueError naming `mesh` when the "tp" axis does not divide the head counts, when it has
    no "tp" axis, or when it is not a Mesh; before any weight is made or read."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    mesh3 = Mesh(np.array(jax.devices()[:3]), ("tp",))
    with pytest.raises(ValueError, match=r"mesh: .*3 devices.*num_k_heads=4"):
        BLOCKS["qwen3_next"](mesh=mesh3)
    with pytest.raises(ValueError, match=r"mesh: .*3 devices.*num_k_heads=4"):
        BLOCKS["kda"](mesh=mesh3)
    mesh4 = make_mesh(4)
    with pytest.raises(ValueError, match=r"mesh: .*4 devices.*num_k_heads=2"):
        Qwen3NextGatedDeltaNet.from_pretrained(os.path.join(GOLDEN, "qwen3_next"), 1, mesh=mesh4)
    with pytest.raises(ValueError, match="mesh must have an axis named 'tp'"):
        BLOCKS["kda"](mesh=Mesh(np.array(jax.devices()[:2]), ("model",)))
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        BLOCKS["kda"](mesh=jax.devices()[:2])


# --------------------------------------------------------------------------- loading

@several
@pytest.mark.parametrize("family,cls,n", [("qwen3_next", Qwen3NextGatedDeltaNet, 2),
                                          ("kimi_linear", KimiDeltaAttention, 4),
                                          ("glm5_next", KimiDeltaAttention, 2)])
def test_from_pretrained_reads_slices(family, cls, n, monkeypatch):
    """from_pretrained(mesh=) equals the unsharded load, and each device reads only its rows
    (or columns) of a split tensor: every split tensor's bytes are read once in all."""
    path = os.path.join(GOLDEN, family)
    one = cls.from_pretrained(path, 1)
    reads = []
    real = SafetensorsCheckpoint.get_slice

    def recording(self, name, index, shape=None):
        arr = real(self, name, index, shape)
        reads.append((name, arr.size))
        return arr

    monkeypatch.setattr(SafetensorsCheckpoint, "get_slice", recording)
    split = cls.from_pretrained(path, 1, mesh=make_mesh(n))
    layout = split._shard_layout()
    sizes = {}
    for name, size in reads:
        sizes[name] = sizes.get(name, 0) + size
    for path_, var in nnx.to_flat_state(nnx.state(split, nnx.Param)):
        pname = ".".join(str(k) for k in path_)
        if layout[pname] != tp.REPLICATED:
            read = sum(s for name, s in sizes.items() if name.endswith("." + pname)
                       or (pname.startswith("conv1d.") and name.endswith("_" + pname)))
            assert read == var.get_value().size, (pname, read)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, one.config.hidden_size))
    y1, s1 = one(x)
    ys, ss = split(x)
    assert_close(ys, y1, f"{family} y")
    assert_states_close(split, ss, s1, f"{family} state")


@several
def test_shard_gather_round_trip():
    mesh = make_mesh(2)
    split = BLOCKS["qwen3_5_split"](mesh=mesh)
    s = random_serving(BLOCKS["qwen3_5_split"](), 3, jax.random.PRNGKey(2))
    back = tp.gather_state(split, tp.shard_state(split, copy_tree(s)))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(s)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sharded = tp.shard_state(split, s)
    assert sharded.conv.windows.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")


@several
@FULL
def test_bench_block_mesh_smoke(tmp_path):
    """`gdn-jax bench block --smoke --mesh 2`: the serving decode, the T=1 call and prefill on 1
    and 2 devices, finite ratios, the mesh's output equal to one device's within bf16."""
    import json

    from gdn_jax.bench import block as bench_block
    out = tmp_path / "mesh.json"
    assert bench_block.main(["--smoke", "--mesh", "2", "--blocks", "kimi", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["serving decode", "call T=1", "prefill"]
    assert all(np.isfinite(r["ratio"]) and r["ratio"] > 0 and r["rel_err_vs_1"] < 2e-2 for r in rows)
