"""Token-weighted perplexity as an `evaluate` module: the figure `hf_alibi.experiments.length.length_eval` reports, for `evaluate` users.

Load it by path (no Hub access needed, works with HF_HUB_OFFLINE=1):

    import evaluate
    ppl = evaluate.load("metrics/length_perplexity")              # from (logits, labels)
    ppl.compute(predictions=[logits_of_one_sequence], references=[labels_of_one_sequence])
    ppl = evaluate.load("metrics/length_perplexity", "nll")       # from per-token negative log-likelihoods
    ppl.compute(predictions=[[2.3, 1.7, ...], [0.4, ...]])

Standalone on purpose: `evaluate` copies this file into its module cache, so it imports only numpy, datasets and
evaluate.
"""

import datasets
import evaluate
import numpy as np

_CITATION = """\
@inproceedings{press2022train,
  title     = {Train Short, Test Long: Attention with Linear Biases Enables Input Length Extrapolation},
  author    = {Press, Ofir and Smith, Noah A. and Lewis, Mike},
  booktitle = {International Conference on Learning Representations},
  year      = {2022}
}
"""

_DESCRIPTION = """\
Perplexity weighted by tokens: exp(sum of per-token negative log-likelihood / number of scored tokens), summed in
float64 over every example added, never a mean of per-example or per-batch means (which over-weights short
sequences). Two input forms, chosen by the configuration name:

- "default": `predictions` are causal-LM logits of one sequence each, shape (seq, vocab), and `references` the
  labels, shape (seq), in transformers' convention: logits at position i predict labels[i + 1] (the shift happens
  here), and labels equal to `ignore_index` are not scored.
- "nll": `predictions` are lists of per-token negative log-likelihoods (natural log), one list per example.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: logits, one (seq, vocab) array per example ("default"), or per-token NLL lists ("nll").
    references: labels, one (seq,) integer array per example ("default" only).
    ignore_index (`int`, defaults to -100): labels with this value are not scored ("default" only).
Returns:
    perplexity (`float`): exp(nll_sum / tokens).
    mean_nll (`float`): nll_sum / tokens, in nats.
    nll_sum (`float`): summed negative log-likelihood of the scored tokens.
    tokens (`int`): number of scored tokens.
Examples:
    >>> ppl = evaluate.load("metrics/length_perplexity", "nll")
    >>> round(ppl.compute(predictions=[[1.0, 3.0], [2.0]])["perplexity"], 4)
    7.3891
"""

_CONFIGS = ("default", "nll")


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class LengthPerplexity(evaluate.Metric):
    def _info(self):
        if self.config_name not in _CONFIGS:
            raise ValueError(f"config_name must be one of {_CONFIGS}, got {self.config_name!r}")
        if self.config_name == "nll":
            features = datasets.Features({"predictions": datasets.Sequence(datasets.Value("float64"))})
        else:
            features = datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
                    "references": datasets.Sequence(datasets.Value("int64")),
                }
            )
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=features,
            reference_urls=["https://arxiv.org/abs/2108.12409"],
        )

    def _compute(self, predictions, references=None, ignore_index=-100):
        nll_sum, tokens = 0.0, 0
        if self.config_name == "nll":
            for nll in predictions:
                nll = np.asarray(nll, dtype=np.float64)
                nll_sum += float(nll.sum())
                tokens += nll.size
        else:
            for logits, labels in zip(predictions, references):
                logits = np.asarray(logits, dtype=np.float64)  # (seq, vocab)
                labels = np.asarray(labels, dtype=np.int64)  # (seq,)
                if logits.ndim != 2 or logits.shape[0] != labels.shape[0]:
                    raise ValueError(f"logits {logits.shape} must be (seq, vocab), seq = len(labels) {labels.shape}")
                logits, targets = logits[:-1], labels[1:]  # position i predicts label i + 1
                scored = targets != ignore_index
                logits, targets = logits[scored], targets[scored]
                top = logits.max(axis=-1, keepdims=True)  # log-sum-exp, shifted for stability
                log_normaliser = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
                nll_sum += float((log_normaliser - logits[np.arange(len(targets)), targets]).sum())
                tokens += int(scored.sum())
        if tokens == 0:
            raise ValueError("no scored tokens: nothing to compute a perplexity from")
        mean = nll_sum / tokens
        return {"perplexity": float(np.exp(mean)), "mean_nll": mean, "nll_sum": nll_sum, "tokens": tokens}
