"""The fused tanh GELU (activations.py) against transformers' `NewGELUActivation` and a float64 reference formula.

Figures measured here (x = linspace(-20, 20, 400001) and 1e6 draws of 5 N(0, 1)): fp32, fused vs NewGELU at most
4.8e-7 apart (1 ulp at |gelu(x)| ~ 4), both within 1.6e-7 max(|gelu(x)|, 1) of float64; gradients 1.1e-6 apart
(fused 1.0e-6, NewGELU's autograd 5.6e-7 from float64). bf16 against float64: max / mean error 7.8e-3 / 4.8e-4
fused, 8.9e-3 / 7.2e-4 NewGELU in bf16 (it rounds after each of its ops).
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.bloom.modeling_bloom import bloom_gelu_forward

from hf_alibi.models.alibi.activations import TANH_GELUS, mlp_activation

FP32_EPS = torch.finfo(torch.float32).eps


def tanh_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU as written in the GELU paper, with its exact constants."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def wide_inputs(dtype=torch.float32) -> torch.Tensor:
    """Both tails (gelu -> 0 and gelu -> x) and the curved middle, densely, plus random draws of std 5."""
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-20, 20, 400_001), 5 * torch.randn(1_000_000, generator=generator)])  # (N,)
    return x.to(dtype)


def test_tanh_gelu_names_are_exactly_the_acts_that_compute_the_formula():
    # float64 leaves rounding at ~1e-16, so a different constant shows: gelu_fast's 10-digit sqrt(2/pi) gives ~1e-12.
    x = wide_inputs(torch.float64)
    reference = tanh_gelu_reference(x)
    errors = {name: (ACT2FN[name](x) - reference).abs().max().item() for name in ACT2FN if "gelu" in name}
    exact = {name for name, error in errors.items() if error <= 1e-14}
    assert exact == TANH_GELUS, errors
    assert 1e-13 < errors["gelu_fast"] < 1e-11, errors  # the same formula with sqrt(2/pi) cut at 10 digits


@pytest.mark.parametrize("name", sorted(TANH_GELUS))
def test_every_tanh_gelu_name_runs_the_fused_kernel(name):
    x = wide_inputs()
    assert torch.equal(mlp_activation(name)(x), F.gelu(x, approximate="tanh"))


@pytest.mark.parametrize("name", ["gelu", "gelu_fast", "relu", "quick_gelu"])
def test_other_activations_are_transformers_own(name):
    x = wide_inputs()
    assert torch.equal(mlp_activation(name)(x), ACT2FN[name](x))


def test_fused_and_new_gelu_agree_to_fp32_rounding():
    x = wide_inputs()
    reference = tanh_gelu_reference(x.double())
    scale = reference.abs().clamp_min(1)  # (N,) relative where |gelu| > 1, absolute near 0 (the left tail cancels)
    fused, new = F.gelu(x, approximate="tanh").double(), ACT2FN["gelu_new"](x).double()
    for name, result in (("fused", fused), ("NewGELU", new)):
        error = ((result - reference).abs() / scale).max().item()
        assert error <= 2 * FP32_EPS, f"{name} is {error:.2e} from float64"
    difference = (fused - new).abs()
    assert (difference / scale).max().item() <= 2 * FP32_EPS, f"fused vs NewGELU: {difference.max().item():.2e}"


def test_fused_gradient_agrees_with_autograd_of_new_gelu():
    x = wide_inputs()
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()]
    F.gelu(inputs[0], approximate="tanh").sum().backward()
    ACT2FN["gelu_new"](inputs[1]).sum().backward()
    tanh_gelu_reference(inputs[2]).sum().backward()
    reference = inputs[2].grad  # (N,) in [-0.17, 1.13]
    for name, grad in (("fused", inputs[0].grad), ("NewGELU", inputs[1].grad)):
        error = (grad.double() - reference).abs().max().item()
        assert error <= 16 * FP32_EPS, f"{name}'s gradient is {error:.2e} from float64"  # a few ulps of O(1) values


def test_fused_bf16_is_no_less_accurate_than_new_gelu_in_bf16():
    x = wide_inputs(torch.bfloat16)
    reference = tanh_gelu_reference(x.double())  # the formula on the very bf16 inputs
    fused = (F.gelu(x, approximate="tanh").double() - reference).abs()
    new = (ACT2FN["gelu_new"](x).double() - reference).abs()  # rounds to bf16 after each of its ops
    assert fused.max() <= new.max(), f"max error: fused {fused.max():.2e}, NewGELU {new.max():.2e}"
    assert fused.mean() <= new.mean(), f"mean error: fused {fused.mean():.2e}, NewGELU {new.mean():.2e}"


def test_bloom_gelu_is_the_fused_kernel_in_fp32():
    # The BLOOM import names BLOOM's GELU `gelu_new`: its 0.79788456 and sqrt(2/pi) are the same fp32 constant.
    x = wide_inputs()
    scale = tanh_gelu_reference(x.double()).abs().clamp_min(1)
    difference = (bloom_gelu_forward(x) - F.gelu(x, approximate="tanh")).double().abs() / scale
    assert difference.max().item() <= 2 * FP32_EPS, f"{difference.max().item():.2e}"


def test_fused_gelu_keeps_only_its_input_for_backward():
    # The point of fusing in training: NewGELU's autograd graph holds several (B, L, 4d) intermediates.
    def saved_elements(act, x):
        sizes = []

        def pack(tensor):
            sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            act(x)
        return sum(sizes)

    x = torch.randn(4, 64, requires_grad=True)
    assert saved_elements(mlp_activation("gelu_new"), x) == x.numel()
    assert saved_elements(ACT2FN["gelu_new"], x) >= 3 * x.numel()


def with_new_gelu(model):
    """A copy of `model` whose MLPs run transformers' NewGELUActivation, as GPT-2 does."""
    model = copy.deepcopy(model)
    for block in model.transformer.h:
        block.mlp.act = ACT2FN["gelu_new"]
    return model


def test_model_with_fused_gelu_matches_new_gelu_logits_and_gradients(make_model, random_ids):
    fused = make_model()
    assert fused.config.activation_function == "gelu_new"  # the config keeps the name it was given
    with torch.no_grad():  # preactivations of std ~5: the GELU's curved middle and both tails, not its linear part
        for block in fused.transformer.h:
            block.mlp.c_fc.weight.mul_(25)
    new = with_new_gelu(fused)
    reference = with_new_gelu(fused).double()
    ids = random_ids(2, 16)
    results = {}
    for name, model in (("fused", fused), ("NewGELU", new), ("float64", reference)):
        output = model(ids, labels=ids)
        output.loss.backward()
        grads = torch.cat([p.grad.flatten().double() for p in model.parameters()])  # (P,)
        results[name] = (output.logits.detach().double(), grads)  # (B, L, V), (P,)
    for index, what in enumerate(("logits", "gradients")):
        fused_error = (results["fused"][index] - results["float64"][index]).abs().max().item()
        new_error = (results["NewGELU"][index] - results["float64"][index]).abs().max().item()
        scale = results["float64"][index].abs().max().item()
        message = f"{what} from float64: fused {fused_error:.2e}, NewGELU {new_error:.2e}"
        assert fused_error <= 2 * new_error + FP32_EPS * scale, message
        torch.testing.assert_close(
            results["fused"][index],
            results["NewGELU"][index],
            rtol=0,
            atol=8 * FP32_EPS * scale,
            msg=lambda m, what=what: f"{what}: {m}",
        )


def test_erf_gelu_models_compute_exactly_as_before(make_model, random_ids):
    # MPT's and Falcon's exact GELU is not the tanh one: transformers' GELUActivation, bit for bit.
    model = make_model(activation_function="gelu")
    before = copy.deepcopy(model)
    for block in before.transformer.h:
        block.mlp.act = ACT2FN["gelu"]
    ids = random_ids(2, 16)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before(ids).logits)
