"""python -m benchmarks.fresh: a trained model's first request, every run a fresh process, beside genai's.

`python -m benchmarks` times warm sessions: each engine is opened and run before it is timed. A user's process opens
the model, reads one prompt and decodes, and waits for all of it. So here every run is a new process, the way a user
starts it: ours `python -m runtime.generate EXPORT --target T --prompt-ids ... --json`, onnxruntime-genai's
`python -m benchmarks.genai_generate BUILD ...` on its builder's folder of the same weights. Each reports its open time,
its time to first token, every decode step with the window it ran over, and its own peak resident memory
(VmHWM: a wait4 rusage would also count the pages of this process, which it was forked from).

The prompts are the committed prompt set's text (benchmarks/prompts.json) through the model's tokenizer, end to end,
cut to each length. Rounds run the engines in turn, reversed every other round as `python -m benchmarks` does, and each
figure is the median over rounds. Writes benchmarks/MODEL/fresh.json and fresh.md; uses the export and the genai builds
`python -m benchmarks --kinds MODEL` makes (benchmarks/.work/MODEL, made here if missing).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from models import preset
from runtime.cli import Parser, run

from . import provenance
from .__main__ import ROOT, model_configs, prepare_folder, round_order
from .accuracy import prompt_file, trained_prompts
from .report import beside, fresh_markdown
from .workloads import GENAI, TRAINED, target_of

ENGINES = ("ort-ort", "ort-npu", "genai-fp32", "ort-ort-int4", "genai-int4")
LENGTHS = (128, 1024)  # prompt tokens: a chat turn, and a long document
NEW_TOKENS = 65  # a first token and 64 decode steps
RUNS = ("runtime.generate", "benchmarks.genai_generate")  # what the timed processes run


def prompt(folder: Path, length: int) -> list[int]:
    """The first `length` ids of the committed plain-text prompts (prose and code), end to end, repeated if they run
    short: a document the model goes on writing. A chat turn's answer ends at its eos (SmolLM2 wrote 6 tokens after
    the chats' ids cut at 128), and a median over so few steps is that of the session's first, slower, runs."""
    kinds = [p["kind"] for p in prompt_file()]
    ids = [int(t) for p, kind in zip(trained_prompts(folder), kinds) if kind != "chat" for t in p[0]]
    return (ids * (length // len(ids) + 1))[:length]


def command(engine: str, folders: dict, ids: list[int], threads: int, new_tokens: int = NEW_TOKENS) -> list[str]:
    """The process a user would start for `engine`."""
    common = ["--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(new_tokens), "--threads", str(threads)]
    if engine in GENAI:
        return [sys.executable, "-m", "benchmarks.genai_generate", str(folders[engine]), *common]
    target = target_of(engine)
    if target is None:
        raise ValueError(f"engine {engine!r}; expected one of {', '.join(ENGINES)}")
    return [sys.executable, "-m", "runtime.generate", str(folders["export"]), "--target", target, "--provider", "cpu",
            "--json", *common]


def once(cmd: list[str]) -> dict:
    """One fresh process: its last stdout line (JSON), which reports its own peak resident memory."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd[1:3])} exited with {proc.returncode}: "
                               f"{(err.read().strip().splitlines() or ['no message'])[-1][:300]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result.get("peak_rss_bytes") is None:
        raise RuntimeError(f"{' '.join(cmd[1:3])} reported no peak memory; expected Linux's /proc/self/status")
    return result


def crossings(result: dict) -> list[int]:
    """The decode steps that ran over another window than the step before (the prompt's, for the first)."""
    windows = [result.get("prompt_window"), *result.get("decode_windows", [])]
    return [i for i in range(len(windows) - 1) if windows[i + 1] != windows[i]]


def summary(results: list[dict]) -> dict:
    """One engine at one prompt length over its rounds: each figure's median, and the worst step against its run's
    median (at a window crossing, and anywhere)."""
    def med(key):
        return statistics.median(r[key] for r in results)
    crossing = [max(r["decode_ms_steps"][i] for i in c) / r["decode_ms_median"] for r in results if (c := crossings(r))]
    return {"open_ms": med("open_ms"), "time_to_first_token_ms": med("time_to_first_token_ms"),
            "decode_ms_median": med("decode_ms_median"), "decode_ms_worst": med("decode_ms_worst"),
            "worst_over_median": statistics.median(r["decode_ms_worst"] / r["decode_ms_median"] for r in results),
            "crossing_steps": crossings(results[0]),
            "crossing_over_median": statistics.median(crossing) if crossing else None,
            "peak_rss_bytes": med("peak_rss_bytes"), "generated_ids": results[0]["generated_ids"],
            "decode_steps": min(len(r["decode_ms_steps"]) for r in results),
            "rounds": [{k: v for k, v in r.items() if k not in ("prompt_ids", "generated_ids")} for r in results]}


def measure(folders: dict, engines: list[str], lengths: list[int], rounds: int, threads: int, log=print) -> list[dict]:
    prompts = {n: prompt(folders["weights"], n) for n in lengths}
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(rounds):
        for engine in round_order(engines, r):
            for n in lengths:
                result = once(command(engine, folders, prompts[n], threads))
                runs.setdefault((engine, n), []).append(result)
                log(f"round {r + 1}/{rounds} {engine:13s} prompt {n:5d}: open {result['open_ms']:.0f} ms, first token "
                    f"{result['time_to_first_token_ms']:.0f} ms, decode median {result['decode_ms_median']:.1f} ms, "
                    f"worst {result['decode_ms_worst']:.1f} ms, peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB")
    return [{"engine": e, "prompt_tokens": n, **summary(rs)} for (e, n), rs in runs.items()]


def main(argv=None) -> int:
    p = Parser(prog="python -m benchmarks.fresh", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=TRAINED[0], choices=TRAINED, help=f"the trained model [{TRAINED[0]}]")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES, help="engines to run [all]")
    p.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS), help="prompt lengths in tokens [128 1024]")
    p.add_argument("--rounds", type=int, default=3, help="runs of each engine and length, engines in turn [3]")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every engine [all cores]")
    p.add_argument("--out", default="benchmarks", help="output folder; writes OUT/MODEL/fresh.json [benchmarks]")
    return run(bench, p.parse_args(argv))


def bench(args) -> int:
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}; expected at least 1")
    if any(n < 1 for n in args.lengths):
        raise ValueError(f"--lengths {' '.join(map(str, args.lengths))}; expected positive token counts")
    config = model_configs(preset("minimind"), [args.model])[args.model]
    if max(args.lengths) + NEW_TOKENS > config.capacity:
        raise ValueError(f"--lengths up to {max(args.lengths)}: with {NEW_TOKENS} new tokens that passes the cache's "
                         f"{config.capacity} rows; expected at most {config.capacity - NEW_TOKENS}")
    out, start = Path(args.out), provenance.stamp(also=RUNS)
    folders = prepare_folder(config, args.model, out / ".work" / args.model, args.engines)
    folders["export"] = folders[args.model]
    if missing := [e for e in args.engines if e in GENAI and e not in folders]:
        raise RuntimeError(f"{', '.join(missing)}: onnxruntime-genai is not installed; expected it (make setup)")
    doc = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "new_tokens": NEW_TOKENS,
           "round_order": "the order reversed every other round",
           "results": measure(folders, args.engines, args.lengths, args.rounds, args.threads)}
    provenance.unchanged(start)
    doc["runs"] = [provenance.stamp(also=RUNS)]
    path = out / args.model / "fresh.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    path.with_suffix(".md").write_text(beside(path, doc, fresh_markdown))
    print(f"wrote {path}, {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
