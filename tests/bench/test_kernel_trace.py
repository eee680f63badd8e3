import gzip
import json

from sgl_longgen.bench.kernel_trace import markdown, short_name, summarize


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_a_trace_folds_into_per_kernel_totals_per_graph_launch(tmp_path):
    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 50, "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 60, "dur": 5},
        _kernel("void flash::FlashAttnFwdSm90<Cutlass::Shape<128>, true>::operator()(Params)", 10, 20),
        _kernel("void flash::FlashAttnFwdSm90<Cutlass::Shape<64>, false>::operator()(Params)", 25, 10),  # overlaps
        _kernel("prepare_varlen_num_blocks_kernel(int, int)", 60, 4),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 70, "dur": 2},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 80},
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize(path)
    assert s["graph_launches"] == 2 and s["device_events"] == 4
    assert s["busy_us"] == 31.0  # [10, 35) + [60, 64) + [70, 72): the overlap counted once
    assert s["span_us"] == 62.0
    rows = {r["name"]: r for r in s["kernels"]}
    assert rows["flash::FlashAttnFwdSm90::operator"] == {"name": "flash::FlashAttnFwdSm90::operator", "count": 2,
                                                         "us": 30.0}
    assert rows["prepare_varlen_num_blocks_kernel"]["count"] == 1 and rows["gpu_memcpy"]["us"] == 2.0
    assert s["kernels"][0]["name"] == "flash::FlashAttnFwdSm90::operator"
    assert s["runtime_calls"][0] == {"name": "cudaGraphLaunch", "count": 2, "us": 10.0}
    text = markdown(s)
    assert "| flash::FlashAttnFwdSm90::operator | 2 | 1.0 | 30 | 15.0 |" in text


def test_short_names_drop_templates_and_parameters():
    assert short_name("void at::native::vectorized_elementwise_kernel<4, at::native::Foo<float>>(int, Foo)") == \
        "at::native::vectorized_elementwise_kernel"
    assert short_name("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, double>(double*, int)") == \
        "at::native::{anon}::cunn_SoftMaxForward"


def _launch(correlation, ts):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5,
            "args": {"correlation": correlation}}


def _replayed(name, ts, dur, correlation):
    return {**_kernel(name, ts, dur), "args": {"correlation": correlation}}


def test_a_speculative_steps_draft_and_verify_graphs_come_apart(tmp_path):
    # Two steps, each a 2-kernel draft graph and a 3-kernel verify graph, and an eager kernel between.
    events = []
    for step, t in enumerate((0, 1000)):
        draft, verify = 10 * step + 1, 10 * step + 2
        events += [_launch(draft, t), _replayed("head_gemm", t + 10, 30, draft), _replayed("topk", t + 40, 10, draft),
                   _launch(verify, t + 60), _replayed("attention", t + 100, 200, verify),
                   _replayed("gemm", t + 300, 100, verify), _replayed("gemm", t + 450, 50, verify),
                   {**_kernel("walk", t + 600, 5), "args": {"correlation": 99 + step}}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    graphs = summarize(path)["graphs"]
    assert [(g["kernels_per_launch"], g["launches"]) for g in graphs] == [(3, 2), (2, 2)]
    verify, draft = graphs
    assert verify["busy_us"] == 350.0 and verify["span_us"] == 400.0  # the gap inside the replay: idle
    assert verify["top"] == [{"name": "attention", "us": 200.0}, {"name": "gemm", "us": 150.0}]
    assert draft["busy_us"] == 40.0 and draft["top"][0] == {"name": "head_gemm", "us": 30.0}
    assert "Graph of 3 kernels, 2 launches: per launch 350.0 us busy, 400.0 us span" in markdown(summarize(path))
