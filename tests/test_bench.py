"""optirs bench's own reference check passes for every optimizer definition (it would hide a bad figure)."""

from __future__ import annotations

import pytest

import optirs
from optirs.core.definitions import DEFINITIONS
from optirs.tools import bench


@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_bench_reference_check_passes_for_every_definition(backend, name):
    kind = bench.make_kind(optirs.get_backend(backend))
    result = bench.check_against_reference(backend, kind, name, DEFINITIONS[name].benchmark_params())
    assert result.startswith("ok"), result


def test_bench_arrays_keep_their_shape():
    kind = bench.make_kind(optirs.get_backend("cpu"))
    import numpy as np

    assert kind.make(np.zeros((3, 4), np.float32)).shape == (3, 4)


def test_bench_cpu_formats_selects_labels_that_hold_commas(capsys):
    """``bench_cpu_formats.py --formats`` takes ';' between labels (which hold commas), ',' where no ';'
    is given, and refuses a selection that matches nothing (naming the labels)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu_formats.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_formats", path)
    bcf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bcf)
    picked = [f[0] for f in bcf.select("remainder8, int8 sqrt;fp32 params, int8 sqrt")]
    assert picked == ["fp32 params, int8 sqrt state", "bf16 params, remainder8, int8 sqrt state"]
    assert {f[0] for f in bcf.select("int8,bf16 state")} == {f[0] for f in bcf.FORMATS
                                                             if "int8" in f[0] or "bf16 state" in f[0]}
    assert bcf.select("") == list(bcf.FORMATS)
    assert [f[0] for f in bcf.select("fp32 params, int8 sqrt")] == ["fp32 params, int8 sqrt state"]
    with pytest.raises(SystemExit) as e:
        bcf.main(["--formats", "no such format"])
    assert e.value.code != 0 and "fp32 params, fp32 state" in capsys.readouterr().err


def test_diag_cpu_format_parts_refuses_unknown_parts_and_formats(capsys):
    """The parts diagnostic fails loudly, before starting any process, on a part or a format it does not know."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "diag_cpu_format_parts.py"
    spec = importlib.util.spec_from_file_location("diag_cpu_format_parts", path)
    diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diag)
    for argv, said in ((["--parts", "decode,nonsense"], "nonsense"), (["--formats", "no such;label"], "no such"),
                       (["--threads", "one"], "one")):
        with pytest.raises(SystemExit) as e:
            diag.main(argv)
        assert e.value.code != 0 and said in capsys.readouterr().err
    sys.modules.pop("bench_cpu_formats", None)


def test_ncu_sass_segments_counts_instructions_an_element(tmp_path, capsys):
    """The source-page reader counts warp instructions x 32 an element, groups equal execution counts
    into segments with their stall share, and fails (exit 2) on a file without the counters."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_sass_segments.py"
    spec = importlib.util.spec_from_file_location("ncu_sass_segments", path)
    seg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seg)
    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
              '"stall_long_sb","stall_wait"\n')
    body = [("0x10", "LDG.E.128 R4, desc[UR8][R2.64]", 1, 8, 0, 1), ("0x20", "FFMA R5, R4, R4, R4", 9, 8, 8, 1),
            ("0x30", "@!P0 FMUL R6, R5, R5", 0, 8, 0, 0), ("0x40", "EXIT", 0, 2, 0, 0)]
    csv_path = tmp_path / "k.csv"
    csv_path.write_text('"Kernel Name","k"\n' + header + "".join(
        f'"{a}","{s}","{st}","{n}","{lsb}","{w}"\n' for a, s, st, n, lsb, w in body))
    lines, stalls = seg.read(str(csv_path))
    assert [n for _, _, n, _ in lines] == [8, 8, 8, 2] and stalls == {"long_sb": 8, "wait": 2}
    assert [(g[1], g[2], g[3]) for g in seg.segments(lines)] == [(3, 8, 10), (1, 2, 0)]
    assert seg.opcode("@!P0 FMUL R6, R5, R5") == "FMUL"
    assert seg.main([str(csv_path), "--elements", "64"]) == 0
    assert "13.0 executed an element" in capsys.readouterr().out  # (3 * 8 + 2) * 32 / 64
    bad = tmp_path / "bad.csv"
    bad.write_text('"Address","Source"\n"0x10","EXIT"\n')
    assert seg.main([str(bad), "--elements", "64"]) == 2
    assert "Instructions Executed" in capsys.readouterr().err


def test_diag_cpu_placement_refuses_bad_input_and_reads_its_mappings(capsys):
    """The placement diagnostic fails loudly on a format or cpu list it cannot use, and finds the
    mapping of an array it allocated (its huge-page count is a number, 0 or more)."""
    import importlib.util
    import sys
    from pathlib import Path

    import numpy as np

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "diag_cpu_placement.py"
    spec = importlib.util.spec_from_file_location("diag_cpu_placement", path)
    diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diag)
    for argv, said in ((["--format", "no such format"], "no such format"), (["--cpus", "zero"], "zero")):
        with pytest.raises(SystemExit) as e:
            diag.main(argv)
        assert e.value.code != 0 and said in capsys.readouterr().err
    a = np.ones(1 << 20, np.float32)
    found = diag.huge_kb({"a": a.ctypes.data})
    assert set(found) == {"a"} and found["a"] >= 0
    sys.modules.pop("bench_cpu_formats", None)


def test_round_cycle_counts_the_cheapest_way_once_around_the_round_loop():
    """ptx_rounds.round_cycle: the shortest path from the round loop's head back to it, taking a
    predicated branch past a block (never into a called slow path), and 0 without a loop."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "ptx_rounds.py"
    spec = importlib.util.spec_from_file_location("ptx_rounds", path)
    pr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pr)
    lines = ["MOV R1, c[0x0][0x28]", "LDG.E R2, desc[UR4][R8.64]", "LDG.E R3, desc[UR4][R8.64]",
             "LDG.E R5, desc[UR4][R8.64]", "@P0 BRA 0x90", "MUFU.RCP R6, R2", "FMUL R6, R6, R3", "FMUL R6, R6, R3",
             "FMUL R6, R6, R3", "MUFU.SQRT R7, R5", "MUFU.RSQ R9, R5", "MUFU.RCP R10, R3", "STG.E desc[UR4][R8.64], R7",
             "@P1 BRA 0x10", "EXIT"]

    def sass_of(lines):
        return "        Function : k\n" + "".join(f"        /*{16 * i:04x}*/                   {x} ;\n"
                                                 for i, x in enumerate(lines))

    sass = sass_of(lines)
    ins = pr.sass_functions(sass, guards=True)["k"]
    # the head (0x10), two loads, the branch, then 0x90's three MUFU, the store and the backward branch
    assert pr.round_cycle(ins) == 9
    # a branch around the slow block that is not taken by its predicate's absence: through it
    forced = sass.replace("@P0 BRA 0x90", "NOP")
    assert pr.round_cycle(pr.sass_functions(forced, guards=True)["k"]) == 13
    assert pr.round_cycle(pr.sass_functions(sass.replace("@P1 BRA 0x10", "NOP"), guards=True)["k"]) == 0
    # a chunk loop's short back edge (a chunk with no round of its own: its loads and one MUFU) is not
    # the round, though it spans fewer instructions
    chunk = ["MOV R1, c[0x0][0x28]", "LDG.E R2, desc[UR4][R8.64]", "LDG.E R3, desc[UR4][R8.64]",
             "LDG.E R5, desc[UR4][R8.64]", "MUFU.RCP R6, R2", "@P2 BRA 0x10"]
    shifted = [x.replace("0x90", "0xe0").replace("0x10", "0x60") for x in lines[1:]]  # 5 instructions on
    loop = pr.round_loop(pr.sass_functions(sass_of(chunk + shifted))["k"])
    assert [o for _, o, _ in loop].count("MUFU.SQRT") == 1 and loop[0][0] == 0x60


def test_cuda_sass_rounds_refuses_bad_input_and_skips_without_its_tools(tmp_path, capsys):
    """The cuda SASS tool fails loudly on a format or family it does not know, and skips (exit 0,
    saying why) where ptxas and cuobjdump are missing, before compiling anything."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_sass_rounds.py"
    spec = importlib.util.spec_from_file_location("cuda_sass_rounds", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert [f[0] for f in tool.formats(["remainder8, int8 sqrt"])] == ["bf16 params, remainder8, int8 sqrt state"]
    for argv, said in ((["no such format"], "no such format"), (["remainder8", "--family", "nadam2"], "nadam2")):
        with pytest.raises(SystemExit) as e:
            tool.main(argv)
        assert e.value.code != 0 and said in capsys.readouterr().err
    assert tool.main(["remainder8, int8 sqrt", "--bin", str(tmp_path)]) == 0
    assert "skipped: ptxas and cuobjdump not found" in capsys.readouterr().out
    sys.modules.pop("bench_formats", None)


def test_bench_formats_models_are_gpt2_parameter_shapes(monkeypatch):
    """``bench_formats.py --model``'s shapes are GPT-2's own parameters (transformers' GPT2LMHeadModel
    on the meta device, its tied head once), for 124M and 1.3B."""
    import collections
    import importlib.util
    from pathlib import Path

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location("bench_formats", folder / "bench_formats.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for model, (width, layers) in (("124m", (768, 12)), ("1.3b", (2048, 24))):
        config = transformers.GPT2Config(n_embd=width, n_layer=layers, n_head=16 if width == 2048 else 12)
        with torch.device("meta"):
            gpt = transformers.GPT2LMHeadModel(config)
        theirs = collections.Counter(tuple(p.shape) for p in gpt.parameters())
        assert collections.Counter(bench.model_shapes("cuda", False, model)) == theirs
    assert bench.model_shapes("cuda", False) == bench.model_shapes("cuda", False, "124m")


def test_bench_formats_shape_variants_keep_the_count(monkeypatch, capsys):
    """``--flat``, ``--split``, ``--min-size`` and ``--misalign`` remake the model's shapes: one tensor
    or N of a multiple of 256 elements each (the last takes the rest) with the same count, the small
    tensors left out, a tensor of K elements in front; a bad count exits non-zero naming it."""
    import importlib.util
    import math
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location("bench_formats", folder / "bench_formats.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shapes = bench.model_shapes("cuda", False, "124m")
    n = sum(math.prod(s) for s in shapes)
    assert bench.variant_shapes(shapes, flat=True) == [(n,)]
    split = bench.variant_shapes(shapes, split=148)
    assert len(split) == 148 and sum(math.prod(s) for s in split) == n
    assert all(s[0] % 256 == 0 and s[0] == split[0][0] for s in split[:-1]) and split[-1][0] >= split[0][0]
    aligned = bench.variant_shapes(shapes, split=148, split_align=2048)
    assert sum(math.prod(s) for s in aligned) == n and all(s[0] % 2048 == 0 for s in aligned[:-1])
    big = bench.variant_shapes(shapes, min_size=4096)
    assert big == [s for s in shapes if math.prod(s) >= 4096] and len(big) < len(shapes)
    assert bench.variant_shapes(shapes, misalign=1) == [(1,)] + shapes
    for argv, said in ((["--split", "0"], "--split 0"), (["--misalign", "-1"], "--misalign -1"),
                       (["--split", "2", "--split-align", "0"], "--split-align 0"),
                       (["--backend", "opencl", "--one-buffer"], "--one-buffer")):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert said in str(e.value.code)
    with pytest.raises(SystemExit) as e:  # argparse: one of --flat and --split
        bench.main(["--flat", "--split", "2"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err
    sys.modules.pop("bench_formats", None)
