"""oneDNN's inner product as the engine calls it (kernels.onednn_linear):
the plain-weight product of long prefills and the encoders' layers holding
their weights in oneDNN's layout, against float64 and F.linear."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.kernels import onednn_linear

needs_onednn = pytest.mark.skipif(onednn_linear.unavailable() is not None,
                                  reason=f"no oneDNN here: {onednn_linear.unavailable()}")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("rows", [1, 17, 700, 1500])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 37), (300, 1536)])
def test_dense_linear_is_x_times_w_transposed(rows, out_features, in_features):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    got = onednn_linear.dense_linear(x, weight)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert relative_error(got, x.double() @ weight.double().T) < 1e-5
    # a non-contiguous input (a slice of a wider tensor) gives the same sums
    wide = torch.randn(rows, in_features + 3)
    wide[:, :in_features] = x
    assert torch.equal(onednn_linear.dense_linear(wide[:, :in_features], weight), got)


@needs_onednn
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_in_onednn_layout_equals_nn_linear(dtype, tolerance, bias):
    torch.manual_seed(1)
    linear = nn.Linear(200, 300, bias=bias).to(dtype)
    layer = onednn_linear.OneDnnLinear(linear)
    assert layer.packed.is_mkldnn   # the weight lives in oneDNN's layout only
    for shape in [(1, 200), (37, 200), (3, 5, 200), (0, 200)]:
        x = torch.randn(shape).to(dtype)
        got = layer(x)
        assert got.shape == (*shape[:-1], 300) and got.dtype == dtype
        if x.numel():
            reference = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
            assert relative_error(got, reference) < tolerance
            assert relative_error(got, linear(x)) < tolerance
    with pytest.raises(ValueError, match=r"takes .* \[\.\.\., 200\] inputs; got"):
        layer(torch.randn(4, 199).to(dtype))
    with pytest.raises(ValueError, match="inputs; got torch.float64"):
        layer(torch.randn(4, 200, dtype=torch.float64))


@needs_onednn
def test_use_in_replaces_every_linear_and_keeps_the_outputs():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Sequential(nn.Linear(128, 32), nn.LayerNorm(32)))
    x = torch.randn(50, 64)
    want = model(x)
    assert onednn_linear.use_in(model) == 2
    assert [type(m).__name__ for m in model.modules()].count("OneDnnLinear") == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert relative_error(model(x), want) < 1e-5
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU weight"):
        onednn_linear.OneDnnLinear(nn.Linear(4, 4).double())


def test_without_onednn_f_linear_serves(monkeypatch):
    """Where torch lacks oneDNN (forced here by a stand-in for the check: the
    builds on these machines all have it), the product is F.linear's, bit for bit."""
    monkeypatch.setattr(onednn_linear, "unavailable", lambda: "torch was built without oneDNN")
    x, weight = torch.randn(20, 48), torch.randn(16, 48)
    assert torch.equal(onednn_linear.dense_linear(x, weight), F.linear(x, weight))
    model = nn.Sequential(nn.Linear(8, 8))
    assert onednn_linear.use_in(model) == 0 and isinstance(model[0], nn.Linear)


@needs_onednn
@pytest.mark.parametrize("activation,reference,tolerance", [
    ("gelu", F.gelu, 0.0), ("relu", F.relu, 0.0),
    ("gelu_tanh", lambda y: F.gelu(y, approximate="tanh"), 1e-6)])
def test_joined_linears_with_an_activation(activation, reference, tolerance):
    """Q, K and V as one layer (their outputs side by side), and an activation
    applied by oneDNN to the product: the separate layers' results."""
    torch.manual_seed(3)
    parts = [nn.Linear(96, n) for n in (96, 32, 32)]
    joined = onednn_linear.OneDnnLinear(parts, activation)
    x = torch.randn(41, 96)
    plain = onednn_linear.OneDnnLinear(parts)(x)
    assert relative_error(plain, torch.cat([p(x) for p in parts], dim=-1)) < 1e-5
    got = joined(x)
    assert got.shape == (41, 160)
    assert float((got - reference(plain)).abs().max()) <= tolerance
    with pytest.raises(ValueError, match="one input width"):
        onednn_linear.OneDnnLinear([nn.Linear(96, 8), nn.Linear(64, 8)])
    with pytest.raises(ValueError, match="with a bias or none"):
        onednn_linear.OneDnnLinear([nn.Linear(96, 8), nn.Linear(96, 8, bias=False)])
