"""benchmarks/scale_check.py and benchmarks/server_rss.py: their pure parts (model choice, flag
checks, cells and ratios, the table and verdict, the request plan, the RSS bound). No engine,
no server, no timing: the scripts themselves are run by hand (see benchmarks/README.md)."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pytest

from benchmarks import scale_check, server_rss
from benchmarks.report import BenchError
from benchmarks.scale_check import Cell, Model, cells_of, check_sizes, record, resolve_models


@pytest.fixture
def files(tmp_path) -> tuple[Path, Path]:
    builtin, qwen = tmp_path / "small.gguf", tmp_path / "qwen.gguf"
    builtin.write_bytes(b"x" * 10)
    qwen.write_bytes(b"y" * 20)
    return builtin, qwen


# ---- scale_check: models and flags ---------------------------------------------------------


def test_models_default_gated_qwen_not(files):
    builtin, qwen = files
    models, skipped = resolve_models(["default", "qwen"], builtin, qwen)
    assert [(m.name, m.path, m.gated) for m in models] == [
        ("default", builtin, True), ("qwen", qwen, False)]
    assert skipped == []


def test_models_missing_qwen_is_skipped_with_a_message(files, tmp_path):
    builtin, _ = files
    models, skipped = resolve_models(["default", "qwen"], builtin, tmp_path / "absent.gguf")
    assert [m.name for m in models] == ["default"]
    assert len(skipped) == 1 and "absent.gguf" in skipped[0] and "fetch_qwen" in skipped[0]


def test_models_a_path_of_the_builtin_file_is_gated(files):
    builtin, qwen = files
    models, _ = resolve_models([str(builtin), str(qwen)], builtin, qwen)
    assert [m.gated for m in models] == [True, False]


@pytest.mark.parametrize("names, match", [([], "empty"), (["nowhere.gguf"], "neither"),
                                          (["default", "default"], "twice")])
def test_models_errors(files, names, match):
    builtin, qwen = files
    with pytest.raises(BenchError, match=match):
        resolve_models(names, builtin, qwen)


@pytest.mark.parametrize("sizes", [([], [], 64, 32, 3), ([0], [512], 64, 32, 3),
                                   ([1], [512], 64, 32, 0), ([1], [-5], 64, 32, 1),
                                   ([1, 8, 1], [512], 64, 32, 1), ([1], [512, 512], 8, 8, 1)])
def test_check_sizes_refuses(sizes):
    with pytest.raises(BenchError):
        check_sizes(*sizes)


def test_check_sizes_accepts_one_kind_only():
    check_sizes([1], [], 8, 8, 1)
    check_sizes([], [512], 8, 8, 1)


def test_main_without_old_exits_2(capsys):
    assert scale_check.main(["--models", "default"]) == 2
    assert "--old" in capsys.readouterr().err


# ---- scale_check: cells, ratios, verdict ----------------------------------------------------


def _answer(tok_s: list[float], step_ms: list[float], prefill_s: list[float]) -> dict:
    return {"tok_s": {str(b): v for b, v in zip((1, 8), tok_s)},
            "step_ms": {str(c): v for c, v in zip((512, 2048), step_ms)},
            "prefill_s": {str(c): v for c, v in zip((512, 2048), prefill_s)}}


def test_record_fills_cells_in_flag_order():
    cells = cells_of(Model("default", Path("m"), True), [1, 8], [512, 2048])
    assert [c.name for c in cells] == [
        "decode tok/s, batch 1", "decode tok/s, batch 8", "decode ms/step, context 512",
        "decode ms/step, context 2048", "prefill s, context 512", "prefill s, context 2048"]
    record(cells, "old", _answer([10, 80], [20, 25], [1.0, 4.0]))
    record(cells, "new", _answer([11, 40], [10, 25], [2.0, 4.0]))
    assert [c.values for c in cells[:3]] == [{"old": [10], "new": [11]},
                                            {"old": [80], "new": [40]},
                                            {"old": [20], "new": [10]}]
    # Speed ratios: tok/s new / old; a time old / new (half the step time is twice as fast).
    assert [c.ratios() for c in cells] == [[1.1], [0.5], [2.0], [1.0], [0.5], [1.0]]
    # Gated: the decode cells of the gated file; prefill never.
    assert [c.failed() for c in cells] == [False, True, False, False, False, False]


def test_record_refuses_a_short_answer():
    cells = cells_of(Model("default", Path("m"), True), [1, 8], [512, 2048])
    with pytest.raises(BenchError, match="values"):
        record(cells, "old", _answer([10], [20, 25], [1.0, 4.0]))


def test_median_over_rounds_and_bar():
    c = Cell("default", "decode tok/s, batch 1", True, True,
             {"old": [100, 100, 100], "new": [90, 96, 99]})
    assert c.median_ratio() == pytest.approx(0.96)
    assert not c.failed(0.95) and c.failed(0.97)
    ungated = Cell("qwen", "decode tok/s, batch 1", True, False, {"old": [100], "new": [50]})
    assert not ungated.failed()
    empty = Cell("default", "decode tok/s, batch 1", True, True)
    assert empty.failed()  # no data is no pass


def test_table_rows_and_verdicts():
    cells = [Cell("default", "decode tok/s, batch 1", True, True,
                  {"old": [100, 102], "new": [90, 92]}),
             Cell("default", "decode ms/step, context 512", False, True,
                  {"old": [20.0, 20.0], "new": [19.0, 21.0]}),
             Cell("default", "prefill s, context 512", False, False,
                  {"old": [1.0], "new": [2.0]}),
             Cell("qwen", "decode tok/s, batch 1", True, False, {"old": [10], "new": [5]})]
    lines = scale_check.table(cells)
    assert lines[0].startswith("| cell | old | new | new / old speed |")
    rows = [[x.strip() for x in line.strip("|").split("|")] for line in lines[2:]]
    assert rows[0][:3] == ["decode tok/s, batch 1", "101.0", "91.0"]
    assert rows[0][3] == f"{(0.9 + 92 / 102) / 2:.3f}x" and "below" in rows[0][5]
    assert rows[1][3] == f"{(20 / 19 + 20 / 21) / 2:.3f}x" and rows[1][5] == "ok"
    assert rows[2][5] == "info" and rows[3][5] == "not gated"


# ---- server_rss: request plan, checkpoints, bound -------------------------------------------


def test_request_plan_covers_every_kind_evenly():
    chat, code = ["c0", "c1", "c2"], ["k0", "k1"]
    plan = server_rss.request_plan(100, chat, code)
    assert len(plan) == 100
    kinds = [(r.prompt.workload, r.prompt.endpoint, r.stream, r.mode) for r in plan]
    every = set(itertools.product(["chat", "code"], ["chat", "completions"], [True, False],
                                  [None, "off"]))
    assert set(kinds[:16]) == every  # each of the 16 kinds in every 16 requests
    assert all(r.prompt.text in (chat if r.prompt.workload == "chat" else code) for r in plan)
    assert {r.prompt.text for r in plan} == set(chat + code)


def test_checkpoints():
    assert server_rss.checkpoints(100) == [10, 50, 100]
    assert server_rss.checkpoints(50) == [10, 50]
    assert server_rss.checkpoints(5) == [5]


def test_bound_arithmetic():
    mb = server_rss.MB
    b = server_rss.Bound(gguf_bytes=100 * mb, kv_blocks=64, kv_block_bytes=mb // 2,
                         headroom_bytes=300 * mb)
    assert b.kv_bytes == 32 * mb and b.total_bytes == 432 * mb
    assert b.met(432 * mb) and not b.met(432 * mb + 1)


def _result(rss_mb: dict, errors=(), used=0) -> server_rss.FileResult:
    mb = server_rss.MB
    bound = server_rss.Bound(100 * mb, 10, mb, 300 * mb)  # 410 MB
    return server_rss.FileResult(Model("default", Path("/x/small.gguf"), True), bound,
                                 dict(rss_mb), list(errors), used)


def test_file_result_verdict_and_rows():
    ok = _result({"ready": 300.0, "after 10": 380.0, "after 100": 409.0})
    big = _result({"ready": 300.0, "after 100": 420.0})
    failed = _result({"ready": 300.0, "after 100": 350.0}, errors=["request 3: HTTP 500"])
    leak = _result({"ready": 300.0, "after 100": 350.0}, used=2)
    assert [r.ok for r in (ok, big, failed, leak)] == [True, False, False, False]
    table, lines = server_rss.rows([ok, big])
    assert table[0].split("|")[6:9] == [" RSS ready MB ", " RSS after 10 MB ",
                                        " RSS after 100 MB "]
    assert "| 10 (10 x 1000000) | 410 | none | 300 | 380 | 409 |" in table[2]
    assert "| 300 | - | 420 |" in table[3]  # no reading at 10: a dash
    assert "**met**" in lines[0] and "-1 MB" in lines[0]
    assert "**missed**" in lines[1] and "+10 MB" in lines[1]


def test_memory_mb_parts_add_up():
    import os

    mem = server_rss.memory_mb(os.getpid())
    assert mem["RssAnon"] > 0 and mem["RssFile"] > 0
    assert mem["RssAnon"] + mem["RssFile"] <= mem["VmRSS"] + 0.01  # VmRSS adds shared memory


def test_disk_bytes(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 3)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"x" * 4)
    assert server_rss.disk_bytes(str(tmp_path)) == 7
    assert server_rss.disk_bytes(str(tmp_path / "a")) == 3
    assert server_rss.disk_bytes(None) == 0


@pytest.mark.parametrize("flags", [["--requests", "0"], ["--concurrency", "0"],
                                   ["--headroom-mb", "-1"]])
def test_server_rss_flag_errors(flags, capsys):
    assert server_rss.main([*flags, "--models", "default", "--no-write"]) == 2
    assert "must be" in capsys.readouterr().err


def test_check_args_accepts_defaults():
    server_rss.check_args(server_rss.build_parser().parse_args([]))
    assert isinstance(server_rss.build_parser().parse_args([]), argparse.Namespace)
