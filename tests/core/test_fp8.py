"""FP8 drafter matrices: the quantization's error bound, the twin against a float reference of the
dequantized matrix, a drafter-wide dtype change leaving the e4m3 values alone, and the
``weights`` setting's refusal of other values. On a CUDA GPU of compute capability 8.9 and up,
the fp8 GEMM against the twin, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sgl_longgen.config import GenerateConfig, convert
from sgl_longgen.core.fp8 import (
    E4M3,
    E4M3_MAX,
    Fp8Linear,
    dequantize,
    fp8_linear,
    linear,
    quantize,
    quantize_linears,
    reference_linear,
    scaled_mm_linear,
    scaled_mm_supported,
    uses_scaled_mm,
)
from sgl_longgen.errors import LonggenError

torch.set_num_threads(1)


def matrix(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, so one scale per row matters."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.logspace(-3, 2, n)[:, None]


def test_each_row_is_quantized_within_e4m3s_rounding_at_its_own_scale():
    w = matrix(40, 64)
    w[7] = 0.0
    q, scale = quantize(w)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (40,)
    assert scale[7] == 1.0 and (q[7].float() == 0).all()
    live = torch.arange(40) != 7
    torch.testing.assert_close(scale[live], w[live].abs().amax(1) / E4M3_MAX)
    assert (q[live].float().abs().amax(1) == E4M3_MAX).all()  # a row's largest entry maps to 448
    # 3 mantissa bits: half a step is 2^-4 of a normal value; subnormals (below 2^-6) step by 2^-9
    err = (dequantize(q, scale) - w).abs()
    assert (err <= torch.maximum(w.abs() * 2**-4, scale[:, None] * 2**-10) * (1 + 1e-6)).all()


def test_chunked_and_gathered_rows_quantize_as_the_whole_matrix(monkeypatch):
    from sgl_longgen.core import fp8

    w = matrix(50, 32, seed=1)
    whole = quantize(w)
    monkeypatch.setattr(fp8, "CHUNK_ROWS", 7)
    chunked = quantize(w)
    assert torch.equal(chunked[0].float(), whole[0].float()) and torch.equal(chunked[1], whole[1])
    rows = torch.tensor([49, 3, 3, 17, 0])
    picked = quantize(w, rows)
    assert torch.equal(picked[0].float(), whole[0][rows].float()) and torch.equal(picked[1], whole[1][rows])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_twin_is_a_float_matmul_by_the_dequantized_matrix(dtype):
    layer = Fp8Linear.quantize(matrix(24, 48, seed=2))
    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    # float64 reference; the dequantized matrix is float32's product of an e4m3 value and its scale
    want = x @ (layer.weight.float() * layer.scale[:, None]).double().T
    out = layer(x.to(dtype))
    assert out.dtype == dtype and out.shape == (3, 5, 24)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert torch.equal(linear(x, layer), reference_linear(x, layer.weight, layer.scale))
    w = torch.randn(24, 48, dtype=torch.float64)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))  # a plain matrix: F.linear


def test_the_fp8_gemm_serves_only_where_cublas_has_it(monkeypatch):
    """On a CPU (torch's CPU ``_scaled_mm`` takes per-tensor scales only) the twin always serves."""
    layer = Fp8Linear.quantize(matrix(32, 32))
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert not scaled_mm_supported(torch.device("cpu")) and not uses_scaled_mm(x, layer.weight)

    def refuse(*args, **kwargs):
        raise AssertionError("_scaled_mm called on a CPU")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    assert torch.equal(fp8_linear(x, layer.weight, layer.scale), reference_linear(x, layer.weight, layer.scale))


def test_quantized_layers_keep_their_storage_through_a_modules_dtype_change():
    net = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 8, bias=False))
    before = net[0].weight.detach().clone()
    quantize_linears(net, ["0"])
    layer = net[0]
    assert isinstance(layer, Fp8Linear) and isinstance(net[1], nn.Linear)
    q, scale = layer.weight, layer.scale
    net.double()
    assert layer.weight is q and layer.scale is scale  # e4m3 and float32, not recast
    assert net[1].weight.dtype == torch.float64
    assert (layer.dequantize().double() - before.double()).abs().max() <= before.abs().max() * 2**-4
    quantize_linears(net, ["0"])  # already quantized: left as it is
    assert net[0] is layer
    with pytest.raises(TypeError, match="bias-free"):
        quantize_linears(nn.Sequential(nn.Linear(4, 4)), ["0"])


@pytest.mark.parametrize("method", ["owl", "longspec"])
def test_the_weights_setting_takes_bf16_or_fp8_only(method):
    assert getattr(convert({}, GenerateConfig), method).weights == "bf16"
    assert getattr(convert({method: {"weights": "fp8"}}, GenerateConfig), method).weights == "fp8"
    with pytest.raises(LonggenError, match=rf"Invalid enum value 'fp16' - at `\$\.{method}\.weights`"):
        convert({method: {"weights": "fp16"}}, GenerateConfig, "longgen.toml")


def test_a_drafter_directorys_bad_weights_setting_names_the_file(tmp_path):
    from sgl_longgen.sglang.draft_dir import read_defaults

    (tmp_path / "longgen.toml").write_text('[owl]\nweights = "int8"\n')
    with pytest.raises(LonggenError, match=r"longgen.toml.*'int8'.*\$\.owl\.weights"):
        read_defaults(tmp_path)


# ------------------------------------------------------------------------------------------------
# the fp8 GEMM (CUDA, compute capability >= 8.9)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The GEMM differs from the twin by the activations' e4m3 rounding (about 3% of each product, in
# relative RMS; it averages out over a row) and the bf16 result: relative Frobenius error <= 6%.
# Against an emulation with the activations quantized the same way only the accumulation order
# and the bf16 result differ: 1% of the output's scale.
TWIN_RTOL = 6e-2
EMULATED_TOL = 1e-2


def _needs_fp8_gemm():
    if not scaled_mm_supported(torch.device("cuda")):
        pytest.skip("the fp8 GEMM needs compute capability 8.9 or newer")


@gpu
@pytest.mark.parametrize("rows", [1, 10, 16, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fp8_gemm_matches_the_twin(rows, dtype):
    _needs_fp8_gemm()
    from sgl_longgen.core.fp8 import _quantize_rows

    layer = Fp8Linear.quantize(matrix(4096, 1024, seed=4)).cuda()
    x = torch.randn(2, rows, 1024, generator=torch.Generator().manual_seed(5)).to("cuda", dtype)
    assert uses_scaled_mm(x, layer.weight)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, rows, 4096)
    twin = reference_linear(x.float(), layer.weight, layer.scale)
    rel = (out.float() - twin).norm() / twin.norm()
    print(f"fp8 GEMM vs twin, {rows} rows, {dtype}: relative error {rel:.4f}")
    assert rel <= TWIN_RTOL
    xq, x_scale = _quantize_rows(x.reshape(-1, 1024).float())
    emulated = ((xq.float() * x_scale[:, None]) @ layer.dequantize().T).view_as(twin)
    torch.testing.assert_close(out.float(), emulated, rtol=EMULATED_TOL, atol=EMULATED_TOL * emulated.abs().max().item())


@gpu
def test_the_fp8_gemm_replays_from_a_cuda_graph():
    _needs_fp8_gemm()
    layer = Fp8Linear.quantize(matrix(512, 256, seed=6)).cuda()
    x = torch.randn(10, 256, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    for seed in (7, 8):
        x.copy_(torch.randn(10, 256, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16))
        graph.replay()
        torch.testing.assert_close(out, scaled_mm_linear(x, layer.weight, layer.scale), rtol=0, atol=0)
