"""export/progress.py: the lines an export logs as it goes, the bar a terminal gets under them, and the split of
its time at the end."""
from export.progress import Progress


def test_a_log_gets_plain_lines_and_no_bar(capsys):
    lines = []
    p = Progress(2, lines.append)
    with p.stage("passes"):
        p.made(2, "prefill over 64 rows: 2 graph(s) saved")
    with p.stage("checks"):
        p.graph("prefill.ort.onnx")
        p.graph("prefill.npu.onnx")
    summary = p.summary()
    assert [line.split(" (")[0] for line in lines] == ["prefill over 64 rows: 2 graph(s) saved",
                                                       "[1/2] prefill.ort.onnx", "[2/2] prefill.npu.onnx"]
    assert summary.startswith("time: ") and "passes" in summary and "checks" in summary
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_a_bar_of_graphs_made_and_checked_named_by_its_stage(capsys):
    lines = []
    p = Progress(3, lines.append, bar=True)
    with p.stage("passes"):
        p.made(3, "decode over 64 rows: 3 graph(s) saved")
    with p.stage("checks"):
        for name in ("a", "b", "c"):
            p.graph(name)
    p.summary()
    out, err = capsys.readouterr()
    assert lines == []  # above the bar, on stdout, not through a log that would draw over it
    assert out.splitlines()[0].startswith("decode over 64 rows") and out.splitlines()[-1].startswith("[3/3] c")
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("checks:") and "6/6" in final, final
