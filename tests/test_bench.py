"""The benchmarks as commands (never timed tests): shared flags, one line without a GPU, nothing
written unless asked, JSON / PNG / markdown on request, the FLA decode call by keyword."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import pathlib
import re

import jax
import numpy as np
import pytest

from gdn_jax.bench import common
from gdn_jax.cli import _bench_names

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = ["block", "decode", "kda", "prefill", "verify"]
SHARED = ["--batches", "--seq-lens", "--dtype", "--peers", "--repeats", "--smoke", "--json",
          "--plot", "--write-md"]


def test_bench_names():
    assert _bench_names() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_shared_flags(name, capsys):
    mod = importlib.import_module(f"gdn_jax.bench.{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in SHARED:
        assert flag in out, f"bench {name} lacks {flag}"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the no-GPU message")
@pytest.mark.parametrize("name,extra", [(n, []) for n in NAMES] + [("block", ["--mesh", "2"])],
                         ids=NAMES + ["block-mesh"])
def test_one_line_without_gpu(name, extra, capsys, tmp_path, monkeypatch):
    """Every bench (bench block --mesh too, which parses before its check) says so in one line."""
    monkeypatch.chdir(tmp_path)
    rc = importlib.import_module(f"gdn_jax.bench.{name}").main(["--batches", "1", *extra])
    out = capsys.readouterr()
    assert rc == 2
    assert out.out.count("\n") == 1 and "no GPU" in out.out and "Traceback" not in out.err
    assert out.out.startswith(f"gdn-jax bench {name}: no GPU")
    assert os.listdir(tmp_path) == []


def test_runs_here_says_why_once(capsys):
    """The shared check after parsing: True with --smoke (nothing printed); without a GPU and
    without --smoke, False and one line naming the benchmark."""
    args = argparse.Namespace(smoke=True)
    assert common.runs_here("x", args) and capsys.readouterr().out == ""
    if jax.default_backend() != "gpu":
        assert not common.runs_here("x", argparse.Namespace(smoke=False))
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and out.startswith("gdn-jax bench x: no GPU")


def test_smoke_writes_only_what_is_asked(tmp_path, monkeypatch, capsys):
    """bench kda --smoke in an empty folder: JSON, PNG and the markdown section where asked, nothing
    else (and nothing in the source tree)."""
    tracked = (ROOT / "BENCHMARKS.md").read_text()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    out = tmp_path / "out"
    out.mkdir()
    md = out / "B.md"
    md.write_text("# Benchmarks\n\n## Other\n\nkeep me\n")
    from gdn_jax.bench import kda
    assert kda.main(["--smoke", "--json", str(out / "r.json"), "--plot", str(out / "r.png"),
                     "--write-md", str(md)]) == 0
    assert os.listdir(work) == []
    assert (ROOT / "BENCHMARKS.md").read_text() == tracked
    data = json.loads((out / "r.json").read_text())
    assert data["meta"]["smoke"] and data["meta"]["copy_GBps"] > 0
    assert {r["mode"] for r in data["rows"]} == {"prefill", "decode"}
    assert all(r["us"] > 0 for r in data["rows"])
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert "keep me" in text and "## KDA prefill and decode vs FLA" in text and "SMOKE RUN" in text
    assert "[bench kda]" in capsys.readouterr().out          # progress lines


def test_decode_smoke(tmp_path, capsys):
    from gdn_jax.bench import decode
    path = tmp_path / "d.json"
    assert decode.main(["--smoke", "--sweep", "--state-dtypes", "float32", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["B"] for r in rows] == [1, 3] and all(r["rel_err"] < 5e-3 for r in rows)
    out = capsys.readouterr().out
    assert "measured in this run" in out
    # the sweep builds plain DecodeBlockSizes (block_v/tile_v/num_warps) and times them
    sweep = [ln for ln in out.splitlines() if ln.startswith("- float32 B=")]
    assert sweep and all(re.search(r"\d+/\d+/\d+ [\d.]+", ln) for ln in sweep)


# the other bench commands' smoke runs stay in the default run; this one is the longest. (The
# mark by name: a peer subprocess imports this module without the tests folder on its path.)
@pytest.mark.full
def test_block_smoke(tmp_path):
    """bench block --smoke: decode through the one-launch kernel (interpret mode) beside its
    parts, prefill beside the prefill kernel, outputs checked against the unfused chain."""
    from gdn_jax.bench import block
    path = tmp_path / "b.json"
    assert block.main(["--smoke", "--blocks", "kimi", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    steps = [r for r in rows if r["who"].startswith("block __call__ T=1")]
    assert [r["B"] for r in steps] == [1, 3]
    assert all(r["path"] == "one launch" and r["rel_err_vs_unfused"] < 2e-2 for r in steps)
    assert [r["B"] for r in rows if r["who"].startswith("block serving decode")] == [1]
    decode_parts = {r["who"] for r in rows if r["mode"] == "decode" and r["B"] == 3}
    assert {"recurrence kernel alone", "one-launch kernel alone",
            "projections alone"} <= decode_parts
    assert {r["who"] for r in rows if r["mode"] == "prefill"} == {
        "block __call__", "prefill kernel alone", "projections alone"}
    assert all(r["us"] > 0 for r in rows)


def test_prefill_smoke_times_the_chunked_prefill_kernel(tmp_path, capsys):
    """impl="pallas" for T > 1 is the chunked prefill kernel (interpret mode in --smoke); an impl
    that cannot run would be reported in one line, never a traceback (one run checks both)."""
    from gdn_jax.bench import prefill
    path = tmp_path / "p.json"
    assert prefill.main(["--smoke", "--no-varlen", "--impls", "chunked,pallas", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out
    lines = [ln for ln in out.splitlines() if ln.startswith("[bench prefill] impl='pallas'")]
    assert len(lines) <= 1
    who = [r["who"] for r in json.loads(path.read_text())["rows"]]
    assert "ours impl=pallas" in who and "ours impl=chunked" in who


def test_kernels_option_records_each_timed_call(tmp_path, capsys):
    """--kernels: one per-kernel entry in the JSON report for each of our timed calls (prefill:
    every case and impl; kda: the prefill cases), and off a GPU one line saying the times need
    one (the smoke run's kernels run in interpret mode, so no GPU kernel is traced there)."""
    from gdn_jax.bench import kda, prefill
    for mod, extra, want in ((prefill, ["--no-varlen"], {"B=1 T=64 impl=pallas",
                                                          "B=2 T=40 impl=pallas"}),
                             (kda, [], {"prefill B=1 T=40 impl=pallas"})):
        path = tmp_path / "k.json"
        assert mod.main(["--smoke", "--kernels", "--impls", "pallas", "--json", str(path), *extra]) == 0
        kernels = json.loads(path.read_text())["meta"]["kernels"]
        assert set(kernels) == want
        out = capsys.readouterr().out
        if jax.default_backend() != "gpu":
            assert all(v == {} for v in kernels.values())
            assert out.count("no GPU kernels traced") == len(want)


@pytest.mark.parametrize("name", ["prefill", "kda"])
def test_calls_flag_parses_and_rejects_nonpositive(name, capsys):
    """--calls (the prefill timings' back-to-back calls per sync): default PREFILL_CALLS; 0, a
    negative or a non-integer count exits with status 2 and a message naming it (as --repeats)."""
    parser = importlib.import_module(f"gdn_jax.bench.{name}").build_parser()
    assert parser.parse_args([]).calls == common.PREFILL_CALLS
    assert parser.parse_args(["--calls", "7"]).calls == 7
    for flag, bad in (("--calls", "0"), ("--calls", "-3"), ("--calls", "x"), ("--repeats", "0")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([flag, bad])
        assert e.value.code == 2
        assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("name,extra", [("prefill", ["--no-varlen"]), ("kda", [])])
def test_calls_flag_reaches_the_timings(name, extra, monkeypatch, capsys):
    """Outside --smoke, each prefill timing is --calls back-to-back calls and the table says so
    (the GPU check, the copy bandwidth and the timing itself replaced: no GPU here)."""
    seen = []

    def fake_time(fn, *args, calls=40, repeats=5, chain=None):
        seen.append(calls)
        return 1e-3

    monkeypatch.setattr(common, "missing_gpu", lambda smoke: None)
    monkeypatch.setattr(common, "measure_copy_gbps", lambda *a, **k: 1000.0)
    monkeypatch.setattr(common, "time_jax", fake_time)
    mod = importlib.import_module(f"gdn_jax.bench.{name}")
    assert mod.main(["--batches", "1", "--seq-lens", "40", "--impls", "chunked",
                     "--peers", "none", "--repeats", "1", "--calls", "3", *extra]) == 0
    # the one prefill timing took 3 calls (kda's decode row then times its chained steps, 10
    # jitted calls a sync)
    assert seen == ([3] if name == "prefill" else [3, 10])
    assert "3 back-to-back calls per sync" in capsys.readouterr().out


@pytest.mark.gpu
def test_kernels_option_names_the_prefill_kernels_on_gpu(tmp_path):
    """bench prefill --kernels on a GPU (one small dense case, no peers): the entry of the
    pallas call holds the Mosaic prep and scan with positive device times."""
    from gdn_jax.bench import prefill
    path = tmp_path / "k.json"
    assert prefill.main(["--batches", "2", "--seq-lens", "512", "--peers", "none", "--no-varlen",
                         "--impls", "pallas", "--repeats", "1", "--kernels",
                         "--json", str(path)]) == 0
    times = json.loads(path.read_text())["meta"]["kernels"]["B=2 T=512 impl=pallas"]
    for name in ("gdn_prefill_mgpu_prep", "gdn_prefill_mgpu_scan"):
        assert any(n.startswith(name) and us > 0 for n, us in times.items()), times


def test_write_section_replaces_only_its_section(tmp_path):
    p = tmp_path / "x.md"
    p.write_text("# T\n\n## A\n\nold a\n\n## B\n\nb\n")
    common.write_section(str(p), "A", "new a")
    assert p.read_text() == "# T\n\n## A\n\nnew a\n\n## B\n\nb\n"
    common.write_section(str(p), "C", "c")
    assert p.read_text().endswith("## C\n\nc\n\n") and "## B\n\nb" in p.read_text()


def test_peer_available_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name: None)
    msg = common.peer_available("fla")
    assert msg.count("\n") == 0 and "torch" in msg and "flash-linear-attention" in msg


def test_usable_peers_notes_each_peer_left_out(monkeypatch):
    rep = common.Report("decode", argparse.Namespace(smoke=False))
    monkeypatch.setattr(common, "peer_available",
                        lambda name: None if name == "fla" else f"peer {name} skipped: gone")
    args = argparse.Namespace(smoke=False, peers="jla,fla")
    assert common.usable_peers(args, rep) == ["fla"]
    assert common.usable_peers(args, rep, supported=("jla",), why_not="FLA only here") == []
    assert rep.notes == ["peer jla skipped: gone", "peer jla skipped: gone",
                         "peer fla skipped: FLA only here"]


def test_fla_decode_peer_passes_g_and_beta_by_keyword():
    """FLA 0.6's fused_recurrent_gated_delta_rule is (q, k, v, g, gk, gv, beta, ...): a positional
    beta lands in gk. Every call of an FLA function in the benches passes only q, k, v positionally."""
    fla_funcs = {"fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule", "chunk_kda",
                 "fused_recurrent_kda"}
    seen = set()
    for name in NAMES:
        tree = ast.parse((ROOT / "gdn_jax" / "bench" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in fla_funcs:
                seen.add(node.func.id)
                assert len(node.args) <= 3, f"{name}: {node.func.id} takes more than q, k, v positionally"
                kws = {k.arg for k in node.keywords}
                assert {"g", "beta"} <= kws, f"{name}: {node.func.id} without g=/beta= keywords"
    assert seen == fla_funcs


def test_jla_kda_peer_call(monkeypatch):
    """bench kda calls jla's Mosaic GPU KDA with the same raw rows as ours, the in-kernel q/k norm
    as asked, and the final state (stand-in module: jla is a GPU-only peer)."""
    import sys
    import types
    from gdn_jax.bench import kda
    calls = []

    def fake_kda(q, k, v, g, beta, **kw):
        calls.append(kw)
        return q, g
    mod = types.ModuleType("jla.ops.mosaic_gpu.kda")
    mod.kda = fake_kda
    for name in ("jla", "jla.ops", "jla.ops.mosaic_gpu"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "jla.ops.mosaic_gpu.kda", mod)
    out = kda._jla_call("q", "k", "v", "g", "beta", use_qk_l2norm=True)
    assert out == ("q", "g")
    kda._jla_call("q", "k", "v", "g", "beta", use_qk_l2norm=False)
    assert calls == [dict(output_final_state=True, use_qk_l2norm=True),
                     dict(output_final_state=True, use_qk_l2norm=False)]
    assert kda.build_parser().parse_args([]).peers == "fla,jla"


def test_chunk_flops_counts_the_chunk_form():
    # per token and head: 4CK + 3CV + 6KV
    assert common.chunk_flops(1, 1, 1, 128, 128) == 4 * 64 * 128 + 3 * 64 * 128 + 6 * 128 * 128
    assert common.chunk_flops(2, 10, 3, 16, 32) == 60 * (4 * 64 * 16 + 3 * 64 * 32 + 6 * 16 * 32)


def fake_peer(cases, out_dir):
    """A stand-in peer for run_peer's plumbing (runs in the subprocess, through peer_cases)."""
    def run_case(c):
        if c["key"] == "bad":
            raise ValueError("no")
        return {"us": 1.5}, {"q": common.np_inputs(c["seed"], 1, 2, 1, 1, 4, 4, state=False)["q"]}
    common.peer_cases(cases, out_dir, run_case, tag="fake", res={"meta": {"GBps": 2.0}})
    print("fake peer done", flush=True)


def fake_peer_crash(cases, out_dir):
    raise RuntimeError("CUDA not available")


def test_run_peer_plumbing():
    """Cases in, times and output samples back; the peer regenerates our inputs from the seed."""
    lines = []
    res = common.run_peer("tests.test_bench:fake_peer", [{"key": "a", "seed": 3}, {"key": "bad"}],
                          progress=lines.append, timeout=120)
    assert res["a"]["us"] == 1.5 and res["bad"]["error"] == "ValueError: no"
    assert res["meta"] == {"GBps": 2.0} and "samples" not in res["bad"]
    want = common.np_inputs(3, 1, 2, 1, 1, 4, 4, state=False)["q"]
    assert (res["a"]["samples"]["q"] == want).all()
    assert "fake peer done" in lines
    lines = []
    assert common.run_peer("tests.test_bench:fake_peer_crash", [], progress=lines.append) == {}
    assert len(lines) == 1 and "CUDA not available" in lines[0]


# KDA's run is the same comparison with its per-channel flag (its kernels are tested elsewhere).
# (`pytest.mark.full` spelled out, not conftest's FULL: a peer subprocess imports this module
# without the tests folder on its path.)
@pytest.mark.parametrize("bench", ["prefill", pytest.param("kda", marks=pytest.mark.full)])
def test_prefill_short_smoke_compares_the_two_kernels(tmp_path, bench):
    """bench prefill|kda --short --smoke: the token-serial and the chunked kernel on the same
    short prompts (GDN's gate, KDA's per-channel gate), checked against each other, a crossover
    per batch beside the family's table."""
    import importlib
    path = tmp_path / "short.json"
    assert importlib.import_module(f"gdn_jax.bench.{bench}").main(
        ["--short", "--smoke", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["meta"]["mode"] == "short"
    rows = data["rows"]
    assert [(r["B"], r["T"]) for r in rows] == [(1, 3), (2, 3)]
    for r in rows:
        assert r["serial_us"] > 0 and r["chunked_us"] > 0
        assert r["rel_err_serial_vs_chunked"] <= common.PEER_TOL
    assert set(data["meta"]["crossover"]) == {"1", "2"}


@pytest.mark.parametrize("name", ["prefill", "kda"])
def test_accuracy_smoke_against_float64(name, tmp_path):
    """bench prefill / kda --accuracy --smoke: both cases, each impl asked, errors against the
    float64 oracle measured (nonzero: bf16 outputs) and within the bf16 bound."""
    bench = importlib.import_module(f"gdn_jax.bench.{name}")
    path = tmp_path / "acc.json"
    assert bench.main(["--accuracy", "--smoke", "--impls", "chunked,pallas", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["case"], r["who"]) for r in rows] == [
        (c, f"ours impl={i}") for c in common.ACCURACY_CASES for i in ("chunked", "pallas")]
    for r in rows:
        assert 0 < r["rel_err_o"] <= common.BF16_BOUND and r["within_bound"], r
        assert 0 < r["rel_err_state"] <= common.BF16_BOUND, r


def test_fla_accuracy_peer_plumbing():
    """The FLA --accuracy peer in a fresh process takes the JSON cases and answers each by key:
    with FLA, its outputs; without torch (this machine), one error line per case."""
    cases = common.accuracy_cases(argparse.Namespace(smoke=True), dict(hk=1, hv=2, k=16),
                                  per_channel=True)
    res = common.run_peer("gdn_jax.bench.common:fla_accuracy_peer", cases, progress=lambda _: None)
    assert set(res) == {c["key"] for c in cases}
    for r in res.values():
        if common.peer_available("fla") is None:
            assert r["samples"]["o"].shape == (1, cases[0]["T"], 2, 16), r
        else:
            assert "error" in r and "samples" not in r, r


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_accuracy_inputs_are_what_they_say(per_channel):
    """The ill-conditioned case has three distinct keys per head and q = k; every input but g is
    a bf16 value (what each implementation and the oracle take exactly); g has the gate's shape."""
    import ml_dtypes
    q, k, v, g, beta = common.accuracy_inputs("repeated keys", 40, 2, 4, 16, per_channel=per_channel)
    assert all(len(np.unique(k[0, :, h], axis=0)) == 3 for h in range(2)) and np.array_equal(q, k)
    for a in (q, k, v, beta):
        assert np.array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float64), a)
    assert g.shape == ((1, 40, 4, 16) if per_channel else (1, 40, 4))
    q, *_ = common.accuracy_inputs("random", 40, 2, 4, 16, per_channel=per_channel)
    assert np.allclose(np.linalg.norm(q, axis=-1), 1.0, atol=1e-2)


@pytest.mark.skipif(len(jax.devices()) >= 2, reason="the message for too few devices")
def test_block_mesh_needs_devices(capsys):
    """`bench block --mesh 2` where JAX already runs on one device: one line, status 2 (the
    comparison itself runs in tests/test_tensor_parallel.py's child process on host devices)."""
    from gdn_jax.bench import block
    assert block.main(["--smoke", "--mesh", "2"]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "--mesh 2 needs 2 devices" in out
    with pytest.raises(SystemExit, match="--mesh must be at least 1"):
        block.main(["--mesh", "0"])


@pytest.mark.parametrize("name", _bench_names())
def test_every_global_name_a_bench_uses_is_defined(name):
    """Peer branches run only where the peer is installed (a GPU machine), so a name a refactor
    removed would fail there first: every global a bench module's functions read must be a
    module-level name, an import, or a builtin."""
    import builtins
    import symtable
    path = pathlib.Path(importlib.import_module(f"gdn_jax.bench.{name}").__file__)
    source = path.read_text()
    module = symtable.symtable(source, str(path), "exec")
    defined = set(dir(builtins)) | {s.get_name() for s in module.get_symbols()
                                    if s.is_assigned() or s.is_imported()}
    missing = set()

    def walk(table):
        for sym in table.get_symbols():
            if sym.is_global() and sym.is_referenced() and sym.get_name() not in defined:
                missing.add(sym.get_name())
        for child in table.get_children():
            walk(child)

    walk(module)
    assert not missing, f"{path.name} reads undefined names: {sorted(missing)}"
