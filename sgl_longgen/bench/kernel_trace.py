"""Where a profiled stretch of GPU time goes: per-kernel totals of a torch profiler trace.

SGLang's ``start_profile`` (``sgl.Engine.start_profile``, the server's ``/start_profile``) writes
a Chrome trace per profiled stage. Comparing two engines step by step (plain decoding against a
speculative engine's plain steps) needs the kernels each launches per forward and the time the
device spends busy and idle, not the timeline itself: :func:`summarize` folds a trace into that,
per CUDA-graph launch (one forward each in a decode step) and per graph (a speculative step's
draft and verify graphs apart), and :func:`markdown` prints it.

    python -m sgl_longgen.bench.kernel_trace TRACE.json.gz [TRACE2 ...] [--top 30]

:func:`profile` does the same for a callable of our own (a graphed step, a drafter's beam):
it runs it under torch's profiler and folds the trace it writes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def short_name(name: str) -> str:
    """A kernel's name without template arguments and parameter lists (still tells kernels apart)."""
    name = re.sub(r"\(.*", "", name.replace("(anonymous namespace)", "{anon}"))
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    name = "".join(out).strip().removeprefix("void ").strip()
    return name[:90] or "?"


def _union(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def summarize(path: Path) -> dict:
    """Device events of one trace: per kernel name count and total us, the busy time (union of
    the device intervals), the span from the first to the last, the CUDA-graph launches, and
    the host's calls into CUDA by total time (a synchronizing call's time is the host waiting)."""
    events = _load(path)
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    runtime: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # host calls into CUDA: syncs show here
    intervals = []
    graph_launches = 0
    launched: dict[int, list[tuple[str, float, float]]] = defaultdict(list)  # device events by correlation id
    graph_ids: set[int] = set()  # the correlation ids of the graph launches
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        correlation = e.get("args", {}).get("correlation")
        if cat in DEVICE_CATEGORIES:
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
            intervals.append((start, start + dur))
            name = short_name(e.get("name", "?")) if cat == "kernel" else cat
            row = per[name]
            row[0] += 1
            row[1] += dur
            if correlation is not None:
                launched[correlation].append((name, start, start + dur))
        elif cat in ("cuda_runtime", "cuda_driver"):
            name = e.get("name", "?")
            if name.startswith("cudaGraphLaunch"):
                graph_launches += 1
                if correlation is not None:
                    graph_ids.add(correlation)
            runtime[name][0] += 1
            runtime[name][1] += float(e.get("dur", 0.0))
    graphs = _graphs({c: launched[c] for c in graph_ids if launched.get(c)})
    span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) if intervals else 0.0
    kernels = sorted(({"name": k, "count": int(v[0]), "us": round(v[1], 1)} for k, v in per.items()),
                     key=lambda r: -r["us"])
    calls = sorted(({"name": k, "count": int(v[0]), "us": round(v[1], 1)} for k, v in runtime.items()),
                   key=lambda r: -r["us"])
    return {"trace": path.name, "graph_launches": graph_launches, "device_events": len(intervals),
            "busy_us": round(_union(intervals), 1), "span_us": round(span, 1), "kernels": kernels,
            "runtime_calls": calls, "graphs": graphs}


def _graphs(launches: dict[int, list[tuple[str, float, float]]], top: int = 12) -> list[dict]:
    """The CUDA-graph launches grouped by graph: a replay's kernels carry its ``cudaGraphLaunch``'s
    correlation id, and one graph replays the same kernels every time, so launches with as many
    kernels are taken as one graph (a speculative step's draft graph and its verify graph then
    come apart). Per graph: its launches, and per launch the busy time (union of its kernels),
    the span from its first kernel to its last and the ``top`` kernels by time."""
    by_size: dict[int, list[list[tuple[str, float, float]]]] = defaultdict(list)
    for kernels in launches.values():
        by_size[len(kernels)].append(kernels)
    out = []
    for size, group in sorted(by_size.items(), key=lambda kv: -len(kv[1]) * kv[0]):
        n = len(group)
        per_kernel: dict[str, float] = defaultdict(float)
        for kernels in group:
            for name, start, stop in kernels:
                per_kernel[name] += stop - start
        busy = sum(_union([(a, b) for _, a, b in kernels]) for kernels in group)
        span = sum(max(b for _, _, b in kernels) - min(a for _, a, _ in kernels) for kernels in group)
        out.append({"kernels_per_launch": size, "launches": n, "busy_us": round(busy / n, 1),
                    "span_us": round(span / n, 1),
                    "top": [{"name": k, "us": round(v / n, 1)}
                            for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]]})
    return out


def profile(fn, path: Path, steps: int = 10, warmup: int = 2, top: int = 40) -> dict:
    """:func:`summarize` of ``steps`` calls of ``fn`` (after ``warmup`` untraced ones) under torch's
    profiler: the trace at ``path`` (``.json``), its :func:`markdown` beside it (``.md``, ``top``
    kernels). ``"calls"`` in the summary is ``steps``, so totals divide into per-call figures even
    where ``fn`` launches no graph."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    trace = path.with_suffix(".json")
    prof.export_chrome_trace(str(trace))
    summary = summarize(trace)
    summary["calls"] = steps
    path.with_suffix(".md").write_text(markdown(summary, top))
    return summary


def markdown(summary: dict, top: int = 30) -> str:
    n = max(1, summary.get("calls") or summary["graph_launches"])
    per = "per call" if summary.get("calls") else "per launch"
    lines = [f"### {summary['trace']}",
             f"{summary['graph_launches']} graph launches, {summary['device_events']} device events; busy "
             f"{summary['busy_us'] / 1e3:.2f} ms of a {summary['span_us'] / 1e3:.2f} ms span "
             f"({per}: {summary['busy_us'] / n:.1f} us busy, {summary['span_us'] / n:.1f} us span, "
             f"{summary['device_events'] / n:.1f} events)", "",
             f"| kernel | count | {per} | total us | {per} us |", "|---|---|---|---|---|"]
    for row in summary["kernels"][:top]:
        lines.append(f"| {row['name']} | {row['count']} | {row['count'] / n:.1f} | {row['us']:.0f} | {row['us'] / n:.1f} |")
    lines += ["", f"| host call into CUDA | count | {per} | total us | {per} us |", "|---|---|---|---|---|"]
    for row in summary["runtime_calls"][:12]:
        lines.append(f"| {row['name']} | {row['count']} | {row['count'] / n:.1f} | {row['us']:.0f} | {row['us'] / n:.1f} |")
    for graph in summary.get("graphs", []):
        head = (f"Graph of {graph['kernels_per_launch']} kernels, {graph['launches']} launches: per launch "
                f"{graph['busy_us']:.1f} us busy, {graph['span_us']:.1f} us span")
        lines += ["", head, "",
                  "| kernel | us per launch |", "|---|---|"]
        lines += [f"| {row['name']} | {row['us']:.1f} |" for row in graph["top"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", type=Path, nargs="+")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    for path in args.traces:
        print(markdown(summarize(path), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
