"""hf_alibi.experiments.length.length_eval against a naive per-token reference on a tiny float64 GPT-2, plus the evaluate metric."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from hf_alibi.experiments.length import length_eval
from hf_alibi.experiments.length.length_eval import (
    ModelEvaluation,
    evaluate_model,
    nonoverlapping_windows,
    sliding_windows,
    token_nll,
)

REPO = Path(__file__).resolve().parents[3]
VOCAB = 50


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run ~50x faster on one thread than on two oversubscribed cores (thread hand-off dominates)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gpt2(n_positions: int = 64, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=n_positions, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config).double().eval()  # float64: the reference comparison is exact to ~1e-12


def documents(*sizes: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator) for n in sizes]


@torch.inference_mode()
def naive_nll(model, context: torch.Tensor, target: torch.Tensor) -> float:
    """-log p(target | context), one forward per token."""
    logits = model(input_ids=context[None]).logits[0, -1]
    return -torch.log_softmax(logits.double(), dim=-1)[target].item()


def truncate_to_whole_longest_windows(docs, longest):
    """The selection rule spelled out: keep documents of > longest tokens, cut to 1 + k * longest tokens."""
    return [doc[: 1 + longest * ((doc.numel() - 1) // longest)] for doc in docs if doc.numel() > longest]


def reference_nonoverlapping(model, docs, length):
    """Token t of a document is predicted from the tokens of its window, starting at length * floor((t-1)/length)."""
    nlls = []
    for doc in docs:
        for t in range(1, doc.numel()):
            start = length * ((t - 1) // length)
            nlls.append(naive_nll(model, doc[start:t], doc[t]))
    return nlls


def reference_sliding(model, docs, length, stride):
    """The Hugging Face strided loop, with exact labels: [(window id, nll)] of each token, scored once."""
    scored, window = [], 0
    for doc in docs:
        last, begin, done = doc.numel() - 1, 0, 0  # done: highest target scored so far
        while done < last:
            begin = min(begin, last - length)  # the final window ends at the document's end
            for t in range(max(done, begin) + 1, begin + length + 1):
                scored.append((window, naive_nll(model, doc[begin:t], doc[t])))
            done, begin, window = begin + length, begin + stride, window + 1
    return scored


def assert_close(actual, expected, rtol=1e-9, what="value"):
    assert math.isclose(actual, expected, rel_tol=rtol), f"{what}: {actual} vs {expected}, diff {actual - expected:.3e}"


def test_nonoverlapping_perplexity_equals_per_token_reference():
    model, docs, lengths = tiny_gpt2(), documents(70, 40, 10, 101), [8, 16, 32]
    result = evaluate_model(model, docs, lengths, batch_tokens=40).by_length()
    kept = truncate_to_whole_longest_windows(docs, max(lengths))
    for length in lengths:
        nlls = reference_nonoverlapping(model, kept, length)
        assert result[length].tokens_nonoverlapping == len(nlls)
        expected = math.exp(math.fsum(nlls) / len(nlls))
        assert_close(result[length].ppl_nonoverlapping, expected, what=f"nonoverlapping ppl at {length}")


def test_sliding_perplexity_equals_per_token_reference():
    model, docs, lengths = tiny_gpt2(), documents(70, 40, 101), [8, 16]
    result = evaluate_model(model, docs, lengths, stride=3, batch_tokens=40).by_length()
    kept = truncate_to_whole_longest_windows(docs, max(lengths))
    for length in lengths:
        nlls = [nll for _, nll in reference_sliding(model, kept, length, stride=3)]
        assert result[length].tokens_sliding == len(nlls) == sum(doc.numel() - 1 for doc in kept)
        expected = math.exp(math.fsum(nlls) / len(nlls))
        assert_close(result[length].ppl_sliding, expected, what=f"sliding ppl at {length}")


def test_perplexity_is_token_weighted_not_a_mean_of_batch_means():
    model, docs, length, stride = tiny_gpt2(), documents(65), 16, 5
    # one window per batch: the first window scores 16 tokens, later ones 5, the last one fewer
    result = evaluate_model(model, docs, [length], stride=stride, batch_tokens=length).lengths[0]
    scored = reference_sliding(model, docs, length, stride)
    per_window = {}
    for window, nll in scored:
        per_window.setdefault(window, []).append(nll)
    assert len({len(v) for v in per_window.values()}) > 1, "the windows must be uneven for this test to mean anything"
    exact = math.exp(math.fsum(nll for _, nll in scored) / len(scored))
    mean_of_means = math.exp(sum(sum(v) / len(v) for v in per_window.values()) / len(per_window))
    assert abs(mean_of_means - exact) > 1e-4 * exact, f"uneven batches should disagree: {mean_of_means} vs {exact}"
    assert_close(result.ppl_sliding, exact, what="sliding ppl (token-weighted)")


def test_sliding_with_stride_equal_to_length_equals_nonoverlapping():
    model, docs = tiny_gpt2(), documents(70, 101)
    for length in (8, 16):
        r = evaluate_model(model, docs, [length, 16], stride=length).by_length()[length]
        assert r.tokens_sliding == r.tokens_nonoverlapping and r.windows_sliding == r.windows_nonoverlapping
        assert_close(r.nll_sliding, r.nll_nonoverlapping, rtol=1e-12, what=f"summed NLL at {length}")


def test_batching_does_not_change_results():
    model, docs, lengths = tiny_gpt2(), documents(70, 40, 101), [8, 16, 32]
    one = evaluate_model(model, docs, lengths, stride=3, batch_tokens=1).by_length()
    many = evaluate_model(model, docs, lengths, stride=3, batch_tokens=10_000).by_length()
    for length in lengths:
        a, b = one[length], many[length]
        assert (a.tokens_nonoverlapping, a.tokens_sliding) == (b.tokens_nonoverlapping, b.tokens_sliding)
        assert_close(a.ppl_nonoverlapping, b.ppl_nonoverlapping, rtol=1e-12, what=f"nonoverlapping at {length}")
        assert_close(a.ppl_sliding, b.ppl_sliding, rtol=1e-12, what=f"sliding at {length}")
        assert a.position_loss.count == b.position_loss.count


def test_every_length_scores_the_same_tokens_and_reports_skipped_documents():
    evaluation = evaluate_model(tiny_gpt2(), documents(70, 40, 10, 101), [8, 16, 32])
    assert evaluation.selection.documents == 3 and evaluation.selection.skipped == 1  # 10 < 33 tokens
    assert evaluation.selection.tokens_dropped == (70 - 65) + (40 - 33) + (101 - 97)
    counts = {(r.tokens_nonoverlapping, r.tokens_sliding) for r in evaluation.lengths}
    assert counts == {(64 + 32 + 96, 64 + 32 + 96)}, counts


def test_position_loss_counts_sum_to_scored_tokens():
    for r in evaluate_model(tiny_gpt2(), documents(70, 101), [8, 16, 32], sliding=False).lengths:
        loss = r.position_loss
        assert sum(loss.count) == r.tokens_nonoverlapping
        assert loss.context_start[0] == 1 and loss.context_end[-1] == r.length + 1  # contexts 1..L, all covered
        assert_close(sum(m * n for m, n in zip(loss.mean_nll, loss.count)), r.nll_nonoverlapping, what="bucket sums")


def test_lengths_past_the_position_table_are_reported_not_raised():
    result = evaluate_model(tiny_gpt2(n_positions=16), documents(70), [8, 16, 32]).by_length()
    assert result[32].unsupported == "unsupported: exceeds position table of 16"
    assert result[32].ppl_nonoverlapping is None and result[32].ppl_sliding is None
    assert result[16].unsupported is None and result[16].ppl_nonoverlapping is not None
    capped = evaluate_model(tiny_gpt2(), documents(70), [8, 16], max_length=8).by_length()
    assert capped[16].unsupported == "unsupported: exceeds position table of 8"


def test_alibi_model_runs_past_its_training_length(make_model):
    model = make_model()  # conftest: n_positions (the training length) 16
    model.train()
    lengths = [16, 32, 64]
    result = evaluate_model(model, documents(130, seed=2), lengths, train_length=16)
    assert result.max_length is None and [r.factor for r in result.lengths] == [1.0, 2.0, 4.0]
    assert all(r.unsupported is None and math.isfinite(r.ppl_nonoverlapping) for r in result.lengths)
    assert model.training, "evaluation must hand the model back in the mode it came in"


def test_other_model_errors_propagate():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, **kwargs):
            raise RuntimeError("a bug in the model")

    with pytest.raises(RuntimeError, match="a bug in the model"):
        evaluate_model(Broken(), documents(70), [8])


def scored_targets(windows, length):
    return [start + 1 + i for start, score_from in windows for i in range(score_from, length)]


def test_window_plans_score_each_target_once_with_full_windows():
    for num_tokens, length, stride in [(33, 8, 3), (65, 16, 16), (50, 16, 7), (17, 16, 1), (100, 10, 10)]:
        sliding = sliding_windows(num_tokens, length, stride)
        nonoverlapping = nonoverlapping_windows(num_tokens, length)
        for windows in (sliding, nonoverlapping):
            assert all(start + length <= num_tokens - 1 for start, _ in windows), (num_tokens, length, stride)
        assert sorted(scored_targets(sliding, length)) == list(range(1, num_tokens)), (num_tokens, length, stride)
        whole = length * ((num_tokens - 1) // length)  # nonoverlapping drops a remainder shorter than a window
        assert sorted(scored_targets(nonoverlapping, length)) == list(range(1, whole + 1)), (num_tokens, length)


def test_token_nll_in_chunks_equals_full_cross_entropy(monkeypatch):
    logits = torch.randn(3, 11, VOCAB, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (3, 11))
    full = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(3, 11)
    monkeypatch.setattr(length_eval, "_LOSS_CHUNK_ELEMENTS", 2 * VOCAB)  # forces many chunks
    torch.testing.assert_close(token_nll(logits, targets), full, rtol=1e-12, atol=1e-12)
    half = token_nll(logits.to(torch.bfloat16), targets)
    assert half.dtype == torch.float64 and torch.isfinite(half).all()


def test_results_round_trip_through_json():
    evaluation = evaluate_model(tiny_gpt2(n_positions=16), documents(70), [8, 16, 32], name="tiny")
    again = ModelEvaluation.from_dict(json.loads(json.dumps(evaluation.to_dict())))
    assert again == evaluation


def test_evaluate_metric_loads_offline_and_matches_library_perplexity(monkeypatch, tmp_path):
    evaluate = pytest.importorskip("evaluate")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)
    model, length = tiny_gpt2(), 16
    doc = documents(length + 1)[0]
    library = evaluate_model(model, [doc], [length], sliding=False).lengths[0]
    with torch.inference_mode():
        logits = model(input_ids=doc[None]).logits[0]  # (L + 1, V): position i predicts token i + 1
    from_logits = evaluate.load("metrics/length_perplexity", cache_dir=str(tmp_path))
    out = from_logits.compute(predictions=[logits.float().numpy()], references=[doc.numpy()])
    assert out["tokens"] == library.tokens_nonoverlapping == length
    assert_close(out["perplexity"], library.ppl_nonoverlapping, rtol=1e-5, what="metric from float32 logits")
    script = REPO / "metrics" / "length_perplexity" / "length_perplexity.py"  # a file path loads too
    from_nll = evaluate.load(str(script), "nll", cache_dir=str(tmp_path))
    nll = token_nll(logits[None, :-1], doc[None, 1:])[0]
    out = from_nll.compute(predictions=[nll[:5].tolist(), nll[5:].tolist()])  # uneven examples, token-weighted
    assert_close(out["perplexity"], library.ppl_nonoverlapping, rtol=1e-12, what="metric from NLLs")
