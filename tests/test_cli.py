"""The command line: --version, each subcommand's --help, env, check (passing, failing, bad
input, a checkpoint block), demo --make-checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import numpy as np
import pytest

import gdn_jax
from gdn_jax import check
from gdn_jax.cli import main

from conftest import FULL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--batch", "2", "--num-k-heads", "1", "--num-v-heads", "2", "--head-k-dim", "16",
         "--head-v-dim", "16", "--dtypes", "float32", "--quiet"]


def test_version_console_script_and_single_source():
    out = subprocess.run([sys.executable, "-m", "gdn_jax", "--version"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"gdn_jax {gdn_jax.__version__}"
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)
    assert proj["project"]["scripts"]["gdn-jax"] == "gdn_jax.cli:main"
    assert "version" in proj["project"]["dynamic"] and "version" not in proj["project"]
    assert proj["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gdn_jax.__version__"}
    assert not any(d.startswith("chex") for d in proj["project"]["dependencies"])


@pytest.mark.parametrize("argv,expect", [
    (["--help"], "demo"), (["demo", "--help"], "--make-checkpoint"), (["env", "--help"], "--json"),
    (["check", "--help"], "--checkpoint"), (["bench", "--help"], "prefill"),
    (["bench", "prefill", "--help"], "--write-md"),
])
def test_help(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert expect in capsys.readouterr().out


def test_env_json(tmp_path, capsys):
    path = tmp_path / "env.json"
    assert main(["env", "--json", str(path)]) == 0
    rep = json.loads(path.read_text())
    assert rep["gdn_jax"] and rep["devices"] and rep["packages"]["jax"]
    assert "impl=\"auto\"" in capsys.readouterr().out
    decode_rows = [r for r in rep["auto"] if r["call"].startswith("gdn_decode")]
    assert decode_rows and all(r["choice"] in ("pallas", "reference") and r["why"] for r in decode_rows)
    if rep["backend"] != "gpu":
        assert all(r["choice"] == "reference" and "GPU" in r["why"] for r in decode_rows)
        gpu = {r["call"]: r for r in rep["auto_on_gpu"]}
        k96 = next(r for c, r in gpu.items() if "K=96" in c)
        assert k96["choice"] == "reference" and "K=96" in k96["why"]
        assert any(r["choice"] == "pallas" for r in gpu.values())
        # on a GPU, sequences go to the chunked prefill kernels (GDN and KDA), T = 1 to decode
        for fn in ("gated_delta_rule", "kda"):
            long = gpu[next(c for c in gpu if c.startswith(f"{fn}, B=1 T=8192"))]
            assert (long["choice"], long["family"]) == ("pallas", "chunked prefill")
        one = gpu[next(c for c in gpu if c.startswith("gated_delta_rule, B=1 T=1 "))]
        assert (one["choice"], one["family"]) == ("pallas", "decode")
    seq = next(r for r in rep["auto"] if r["call"].startswith("gated_delta_rule, B=1 T=8192"))
    assert seq["choice"] == "chunked"


def test_check_passes_and_writes_json(tmp_path, capsys):
    path = tmp_path / "check.json"
    rc = main(["check", *SMALL, "--ops", "decode,verify", "--json", str(path)])
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())["rows"]
    assert rc == 0, out
    assert "passed" in out and "rel err" in out
    by = {(r["op"], r["impl"]): r for r in rows}
    assert by[("decode", "pallas")]["status"] == "pass"          # the kernel (interpret mode on CPU)
    assert by[("verify", "pallas")]["status"] == "pass"
    assert all(r["status"] in ("pass", "n/a") for r in rows)
    assert all(r["rel_err"] is not None for r in rows if r["status"] == "pass")


@FULL  # each of these kernels has its own tests; this is the check command's longest run
def test_check_runs_the_prefill_kernels_and_carried_verify(tmp_path):
    """T > 1 under impl="pallas" is the chunked prefill kernel (dense, packed, into a pool), and
    carried verify goes through a DeltaPool: every such row runs (interpret mode) and passes."""
    path = tmp_path / "check.json"
    rc = main(["check", *SMALL, "--seq-len", "70", "--draft-tokens", "2",
               "--ops", "gdn,prefill_pool,carried_verify", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert rc == 0
    by = {(r["op"], r["impl"]): r["status"] for r in rows}
    for key in (("gdn", "pallas"), ("gdn varlen", "pallas"), ("prefill_pool", "pallas"),
                ("prefill_pool", "reference"), ("carried_verify", "pallas (exact)"),
                ("carried_verify", "pallas (fast)")):
        assert by[key] == "pass", (key, by)


def test_check_fails_on_a_wrong_implementation(monkeypatch, capsys):
    """The harness can fail: an implementation that is off by 1e-3 is a FAIL and exit status 1."""
    from gdn_jax import decode as dec
    real = dec.gdn_decode

    def off(*a, **kw):
        o, s = real(*a, **kw)
        return o * 1.001, s
    monkeypatch.setattr(dec, "gdn_decode", off)
    rc = main(["check", *SMALL, "--ops", "decode"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out


def test_check_bad_input(capsys):
    assert main(["check", "--ops", "nonsense", "--quiet"]) == 2
    assert "ops" in capsys.readouterr().err
    with pytest.raises(ValueError, match="num_v_heads"):
        check.run_check(check.Shapes(num_k_heads=3, num_v_heads=4), progress=None)
    with pytest.raises(ValueError, match="checkpoint and layer"):
        check.run_check(checkpoint="x", progress=None)


def test_oracle_matches_the_reference_scan():
    import jax.numpy as jnp
    q, k, v, g, beta, h0 = check._inputs(3, check.Shapes(batch=1, num_k_heads=1, num_v_heads=2,
                                                         head_k_dim=8, head_v_dim=8), 7, "float32",
                                         per_channel=True)
    o, st = gdn_jax.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                        use_qk_l2norm=True, impl="reference")
    ow, sw = check.oracle_delta_rule(q, k, v, g, beta, h0)
    assert check.rel_err(o, ow) < 1e-5 and check.rel_err(st, sw[:, -1]) < 1e-5
    assert check.rel_err(np.full(3, np.nan), np.ones(3)) == float("inf")


def test_oracle_state_none_is_zeros_and_a_wrong_state_is_named():
    q, k, v, g, beta, _ = check._inputs(4, check.Shapes(batch=1, num_k_heads=1, num_v_heads=2,
                                                        head_k_dim=8, head_v_dim=4), 5, "float32",
                                        per_channel=False)
    o0, s0 = check.oracle_delta_rule(q, k, v, g, beta, None, keep_states=False)
    oz, sz = check.oracle_delta_rule(q, k, v, g, beta, np.zeros((1, 2, 8, 4)), keep_states=False)
    assert np.all(np.isfinite(o0)) and np.abs(o0).max() > 0
    np.testing.assert_array_equal(o0, oz)
    np.testing.assert_array_equal(s0, sz)
    with pytest.raises(ValueError, match=r"state: expected shape \(1, 2, 8, 4\)"):
        check.oracle_delta_rule(q, k, v, g, beta, np.zeros((1, 2, 4, 8)))


@FULL  # the checkpoint and the check command run in other default tests; this joins them
def test_make_checkpoint_and_check_its_block(tmp_path, capsys):
    ckpt = tmp_path / "tiny"
    assert main(["demo", "--make-checkpoint", str(ckpt)]) == 0
    assert sorted(os.listdir(ckpt)) == ["config.json", "model.safetensors"]
    rc = main(["check", *SMALL, "--seq-len", "6", "--ops", "decode", "--checkpoint", str(ckpt),
               "--layer", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "block Qwen3NextGatedDeltaNet[0]" in out and "prefill+decode" in out


@pytest.mark.gpu
def test_check_compiled_on_gpu(tmp_path):
    """`gdn-jax check` on a GPU: every kernel compiled, at the production head dims, both dtypes."""
    path = tmp_path / "gpu.json"
    rc = main(["check", "--batch", "4", "--num-k-heads", "2", "--num-v-heads", "4", "--head-k-dim",
               "128", "--head-v-dim", "128", "--seq-len", "130", "--json", str(path), "--quiet"])
    rows = json.loads(path.read_text())["rows"]
    assert rc == 0, [r for r in rows if r["status"] == "FAIL"]
    assert any(r["impl"].startswith("pallas") and r["status"] == "pass" for r in rows)
