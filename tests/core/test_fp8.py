"""FP8 drafter matrices: the quantization's error bound, the twin against a float reference of the
dequantized matrix, a drafter-wide dtype change leaving the e4m3 values alone, and the
``weights`` setting's refusal of other values (and that of LongSpec's ``beam`` setting, its
neighbour in the drafter's ``longgen.toml``). The Triton GEMM that serves on a GPU is tested
against the twin in ``tests/kernels/test_fp8_gemm.py``."""

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
    linear,
    quantize,
    quantize_linears,
    reference_linear,
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


def test_the_twin_serves_on_a_cpu(monkeypatch):
    """The Triton GEMM is for CUDA devices only: on a CPU the twin always serves."""
    from sgl_longgen.kernels import fp8_gemm
    from sgl_longgen.kernels.fp8_linear import fp8_gemm_supported, fp8_linear, uses_fp8_gemm

    layer = Fp8Linear.quantize(matrix(32, 32))
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert not fp8_gemm_supported(torch.device("cpu")) and not uses_fp8_gemm(x, layer.weight)

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton GEMM called on a CPU")

    monkeypatch.setattr(fp8_gemm, "fp8_gemm", refuse)
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


def test_longspecs_beam_setting_takes_torch_or_compiled_only():
    """``[longspec] beam``: how the SGLang worker runs its graphed step (the compiled one is timed on
    a GPU by ``bench.gpu_check``); another value is refused naming the key."""
    assert convert({}, GenerateConfig).longspec.beam == "torch"
    assert convert({"longspec": {"beam": "compiled"}}, GenerateConfig).longspec.beam == "compiled"
    with pytest.raises(LonggenError, match=r"Invalid enum value 'fused' - at `\$\.longspec\.beam`"):
        convert({"longspec": {"beam": "fused"}}, GenerateConfig, "longgen.toml")
