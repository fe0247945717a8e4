"""Training cost measured the same way for every model: interleaved steps in rotating order, warm-up untimed,
tokens/s from the median step, Trainer's own step (clipping included), bits per byte from perplexity."""

import math

import pytest
import torch

from hf_alibi.experiments.reporting.results import bits, bits_table, training_cost_table
from hf_alibi.experiments.training import training_cost
from hf_alibi.experiments.training.training_cost import measure_training_costs, training_step


class _Counted(torch.nn.Module):
    """A one-parameter "model" whose forward records which model ran, so the order of steps is observable."""

    def __init__(self, name, log):
        super().__init__()
        self.name, self.log = name, log
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, input_ids, labels):
        self.log.append(self.name)

        class Out:
            loss = (self.weight * input_ids.float()).sum() * 0 + self.weight.sum() ** 2

        return Out()


def _builder(name, log, batch=(2, 8)):
    def build():
        model = _Counted(name, log)
        ids = torch.ones(batch, dtype=torch.long)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), {"input_ids": ids, "labels": ids}

    return build


def test_steps_interleave_in_rotating_order_after_untimed_warmups():
    log = []
    costs = measure_training_costs({n: _builder(n, log) for n in "abc"}, steps=3, warmup=2)
    assert log == ["a", "a", "b", "b", "c", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    for name, cost in costs.items():
        assert len(cost["step_seconds"]) == 3, name
        assert cost["step_seconds_median"] == sorted(cost["step_seconds"])[1]
        assert cost["tokens_per_step"] == 16
        assert cost["tokens_per_second"] == pytest.approx(16 / cost["step_seconds_median"], rel=1e-3)
        assert "interleaved" in cost["protocol"] and cost["memory_source"]


def test_training_step_clips_like_trainer_and_updates_the_weights():
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, labels):
            class Out:
                loss = 100.0 * self.inner(input_ids.float()).sum()

            return Out()

    wrapped = Wrapped()
    ids = torch.ones(1, 4, dtype=torch.long)
    training_step(wrapped, optimizer, {"input_ids": ids, "labels": ids}, max_grad_norm=1.0)
    step = torch.ones(1, 4) - model.weight.detach()
    assert step.norm().item() == pytest.approx(1.0, rel=1e-5), "the gradient was not clipped to norm 1"
    assert model.weight.grad is None, "gradients must be cleared after the step"


def test_bad_step_counts_are_refused_naming_them():
    with pytest.raises(ValueError, match="steps=0"):
        measure_training_costs({"a": _builder("a", [])}, steps=0)


def test_peak_memory_covers_building_the_model(monkeypatch):
    def build():
        model = torch.nn.Linear(4096, 4096)  # 64 MiB of weights, allocated inside the measured block
        ids = torch.ones(1, 4, dtype=torch.long)
        return model, torch.optim.SGD(model.parameters(), lr=0.0), {"input_ids": ids, "labels": ids}

    monkeypatch.setattr(training_cost, "training_step", lambda *args: None)
    cost = measure_training_costs({"big": build}, steps=1, warmup=1)["big"]
    if cost["peak_memory_mib"] is None:
        pytest.skip(cost["memory_source"])
    assert cost["peak_memory_mib"] >= 60, cost


def test_bits_per_byte_is_log2_perplexity_over_bytes_per_token(make_evaluation):
    assert bits(2.0**3.5) == pytest.approx(3.5)
    assert bits(2.0**3.5, bytes_per_token=3.5) == pytest.approx(1.0)
    evaluation = make_evaluation("alibi", {128: 6.6, 2048: 6.5}, train_length=128)
    table = bits_table({"alibi": evaluation}, 1.0)
    assert f"| alibi | {math.log2(6.6):.3f} | {math.log2(6.5):.3f} |" in table


def test_cost_table_prefers_the_interleaved_measurement_and_states_its_protocol(make_evaluation):
    results = {n: make_evaluation(n, {128: 7.0}, train_length=128) for n in ("alibi", "learned")}
    metadata = {
        f"{n}_training": {
            "train_length": 128,
            "per_device_train_batch_size": 32,
            "train_tokens": 4096,
            "train_tokens_per_second": 999.0,
            "train_seconds": 3.0,
            "peak_memory_mib": 1.0,
        }
        for n in results
    }
    metadata["alibi_cost"] = {
        "tokens_per_second": 4000.0,
        "step_seconds_median": 1.0,
        "peak_memory_mib": 400.0,
        "protocol": "10 interleaved steps",
    }
    metadata["learned_cost"] = {
        "tokens_per_second": 3200.0,
        "step_seconds_median": 1.25,
        "peak_memory_mib": 380.0,
        "protocol": "10 interleaved steps",
    }
    table = training_cost_table(results, metadata)
    assert "| alibi | 128 | 32 | 4,096 | 4,000 | 1000.0 | 1.000 | 400 | 3.0 |" in table
    assert "| learned | 128 | 32 | 4,096 | 3,200 | 1250.0 | 1.250 | 380 | 3.0 |" in table
    assert "10 interleaved steps" in table and "999" not in table
