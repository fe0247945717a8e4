"""The Baichuan benchmark's contestants time a stated function: `baichuan-eager` computes what the float64 forward of
Baichuan2-13B's architecture does (tests/conversion/baichuan_checkpoints.py, written independently), and
`alibi-from-baichuan` the very function `baichuan-eager` times, or refuses to start."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT, ROOT / "tests" / "conversion"):  # the benchmarks folder; the conversion tests' reference
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from baichuan_checkpoints import their_logits  # noqa: E402
from benchmarks.baichuan_eager import MODEL_MAX_LENGTH, BaichuanEager, intermediate_size  # noqa: E402
from benchmarks.contestants import Shape, build_model, imported_baichuan  # noqa: E402
from hf_alibi.conversion.remote_code import Checkpoint  # noqa: E402

SHAPE = Shape(n_embd=80, n_layer=2, n_head=40, vocab_size=512)  # Baichuan-13B's 40 heads, tiny otherwise


def perturbed(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():  # norm weights off 1: every weight's place matters
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def test_baichuan_eager_computes_the_float64_forward_of_their_architecture():
    model, _ = build_model("baichuan-eager", SHAPE, 128)
    model = perturbed(model)
    checkpoint = Checkpoint(dict(model.config), {name: tensor.clone() for name, tensor in model.state_dict().items()})
    ids, mask = torch.randint(3, 512, (2, 40)), torch.ones(2, 40, dtype=torch.long)
    mask[0, :6] = 0
    with torch.no_grad():
        got = model.eval()(ids, attention_mask=mask).logits
    expected = their_logits(checkpoint, ids, mask)  # NormHead: z_loss_weight is in the config
    error = (got.double() - expected)[mask.bool()].abs().max().item()
    assert error < 1e-5 * expected.abs().max().item(), f"baichuan-eager differs from their forward by {error:.2e}"
    assert model.config["intermediate_size"] == intermediate_size(80) and intermediate_size(5120) == 13696
    assert model.model.future_mask.shape == (40, MODEL_MAX_LENGTH, MODEL_MAX_LENGTH)  # their buffer, from the start


def test_alibi_from_baichuan_holds_baichuan_eagers_weights_and_logits():
    baichuan, _ = build_model("baichuan-eager", SHAPE, 128)
    alibi, _ = build_model("alibi-from-baichuan", SHAPE, 128)
    assert alibi.config._attn_implementation == "sdpa" and alibi.config.norm_type == "rms_norm"
    ids = torch.randint(3, 512, (1, 100))
    with torch.no_grad():
        torch.testing.assert_close(alibi(ids).logits, baichuan.eval()(ids).logits, atol=2e-5, rtol=0)


def test_imported_baichuan_refuses_to_benchmark_a_different_function():
    baichuan = BaichuanEager(512, 80, 1, 40)
    baichuan.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(RuntimeError, match="differ"):
        imported_baichuan(baichuan)
