"""One contestant of `bench_skip` in its own fresh process (`--child`): builds its model, warms up, times
`--repeats` calls of its suite and prints one JSON line (`bench_skip`'s docstring says what each suite measures).
"""

import statistics

# `"auto"` against dense, and for a packed row GPT-2 too (transformers' one document mask over the whole row)
AUTO_SUITES = {"cb_decode": ("alibi-dense", "alibi-auto"), "packed_train": ("gpt2-sdpa", "alibi-dense", "alibi-auto")}
REFERENCES = ("gpt2-sdpa", "bert-sdpa")  # transformers' model of the checkpoint's shape: a causal LM's, an encoder's


def is_encoder(checkpoint: str) -> bool:
    """Whether the checkpoint is an ALiBi encoder (`alibi_bert`: bidirectional rows) rather than a causal LM."""
    import json
    from pathlib import Path

    return json.loads((Path(checkpoint) / "config.json").read_text()).get("model_type") == "alibi_bert"


def build(name: str, checkpoint: str, eps: float, length: int):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    import hf_alibi  # noqa: F401  (registers the ALiBi models with the Auto classes)
    from benchmarks.contestants import Shape, build_model

    encoder = is_encoder(checkpoint)
    loader = AutoModelForMaskedLM if encoder else AutoModelForCausalLM
    model = loader.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    if name == "alibi-auto":
        model.config.alibi_skip_eps = "auto"
        return model
    if name in REFERENCES:  # the checkpoint's shape, randomly initialised, every dropout 0 (SDPA's fused path)
        c = model.config
        shape = Shape(c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size)
        return build_model(name, shape, length)[0].eval()
    model.config.alibi_skip_eps = eps if name == "alibi-skip" else 0.0
    return model


def call(model, ids, labels: bool = False):
    """One forward as its callers make it: a causal LM's last logits only (or the loss); an encoder with the all-ones
    mask Trainer and sentence-transformers send (the masked-LM loss over every token with `labels`)."""
    import torch

    if model.config.model_type in ("alibi_bert", "bert"):
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), **({"labels": ids} if labels else {}))
    return model(ids, labels=ids) if labels else model(ids, logits_to_keep=1)


def text_ids(checkpoint: str, length: int):
    from transformers import AutoTokenizer

    import hf_alibi  # noqa: F401  (the checkpoint's config type: no remote-code prompt)
    from benchmarks.measure_kept_fraction import heldout_stream

    return heldout_stream(AutoTokenizer.from_pretrained(checkpoint), length)  # (1, length)


def kept_fractions(model, ids, eps: float) -> list[float]:
    """Kept fraction of causal key work per head (mean over layers): the key ranges the layers really read (the
    certified ones, or wider where a head reads one window per block: `shared_key_windows`), recorded from one more
    (untimed) forward through `certified_split`."""
    import torch

    from benchmarks.skip_research import kept_fraction, recorded_key_ranges
    from hf_alibi.experiments.length.kept_context import bidirectional_kept_fraction

    model.config.alibi_skip_eps = eps
    with recorded_key_ranges() as used, torch.no_grad():
        call(model, ids)
    if not used:  # the forward did not skip ("auto" where it does not pay)
        return []
    length = ids.shape[1]
    kept = [
        kept_fraction(r.first_key, length, r.rows)
        if r.end_key is None
        else bidirectional_kept_fraction(r.first_key, r.end_key, length, r.rows)
        for r in used
    ]
    return torch.stack(kept).mean(0).tolist()  # (H,)


def child(args) -> dict:
    """One process: one contestant, one cell; prints a JSON line."""
    import torch
    from transformers import StaticCache

    from benchmarks.measure import process_peak_bytes, time_call

    if args.threads:
        torch.set_num_threads(args.threads)
    ids = text_ids(args.checkpoint, args.length)
    budget = args.length + args.steps * (args.repeats + 1) + 1  # every decoding step of this process
    model = build(args.contestant, args.checkpoint, args.eps, budget)
    tokens = []
    if args.suite in AUTO_SUITES:
        return (cb_decode if args.suite == "cb_decode" else packed_train)(model, ids, args)
    if args.suite == "train":
        model.train()

        def step():
            model.zero_grad(set_to_none=True)
            call(model, ids, labels=True).loss.backward()

        seconds = time_call(step, repeats=args.repeats)
        return {
            "median_s": statistics.median(seconds),
            "tokens": [],
            "peak_bytes": process_peak_bytes("cpu"),
            "threads": torch.get_num_threads(),
        }
    with torch.no_grad():
        if args.suite == "forward":
            seconds = time_call(lambda: call(model, ids), repeats=args.repeats)
        else:  # one prefill, untimed; then a warm-up call and the timed ones continue it
            cache = StaticCache(config=model.config, max_cache_len=budget)
            token = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)

            def steps():
                nonlocal token
                for _ in range(args.steps):
                    token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    tokens.append(int(token))

            seconds = [s / args.steps for s in time_call(steps, repeats=args.repeats)]
    result = {"median_s": statistics.median(seconds), "tokens": tokens, "threads": torch.get_num_threads()}
    if args.contestant in ("alibi-skip", "alibi-auto") and args.suite == "forward":
        eps = args.eps if args.contestant == "alibi-skip" else "auto"
        result["kept_per_head"] = kept_fractions(model, ids, eps)
    return result


def cb_decode(model, ids, args) -> dict:
    """`generate_batch` of the long context beside a 128-token request; seconds per decoding step of the long one."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    prompts = [ids[0].tolist(), ids[0, :128].tolist()]
    greedy = GenerationConfig(max_new_tokens=args.steps + 1, do_sample=False, eos_token_id=-1, pad_token_id=0)
    paged = ContinuousBatchingConfig(
        page_size=256, num_blocks=(args.length + args.steps) // 256 + 8, max_batch_tokens=4096
    )
    seconds, tokens = [], []
    for _ in range(args.repeats):
        outputs = model.generate_batch(
            inputs=prompts,
            generation_config=greedy,
            continuous_batching_config=paged,
            progress_bar=False,
            record_timestamps=True,
        )
        long = outputs["req_0"]
        if long.error is not None:
            raise RuntimeError(long.error)
        stamps, tokens = long.timestamps, long.generated_tokens  # the first token ends the prefill
        seconds.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {"median_s": statistics.median(seconds), "tokens": tokens}


def packed_train(model, ids, args) -> dict:
    """One training step on one packed row of four documents (positions restarting, first labels -100)."""
    import torch

    from benchmarks.measure import process_peak_bytes, time_call

    length = ids.shape[1]
    lengths = [length // 2, length // 4, length // 8, length - length // 2 - length // 4 - length // 8]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, L)
    labels = ids.masked_fill(positions == 0, -100)  # (1, L)
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, position_ids=positions, labels=labels).loss.backward()

    seconds = time_call(step, repeats=args.repeats)
    return {"median_s": statistics.median(seconds), "tokens": [], "peak_bytes": process_peak_bytes("cpu")}
