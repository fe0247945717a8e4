"""The contestants: same width, depth, heads and vocabulary, randomly initialised from configs, every dropout 0.

GPT-2's default attention dropout (0.1) pushes SDPA off its fused causal path in training, and BLOOM/MPT/hf_alibi
apply theirs differently, so every contestant gets 0 everywhere: the benchmark compares attention, not dropout.

| name                   | model                                           | attention                                  |
|------------------------|-------------------------------------------------|--------------------------------------------|
| `gpt2-sdpa`            | `GPT2LMHeadModel`, learned positions            | SDPA, no bias (the default reference)      |
| `gpt2-flash`           | `GPT2LMHeadModel`, CUDA + flash-attn only       | FlashAttention-2, no bias (GPU reference)  |
| `bloom-eager`          | `BloomForCausalLM`                              | HF's ALiBi, eager (BLOOM has no other)     |
| `mpt-eager`            | `MptForCausalLM`, `alibi=True`                  | HF's ALiBi, eager (MPT has no other)       |
| `alibi-sdpa`           | `AlibiGPT2LMHeadModel` (the default backend)    | SDPA: CPU split, else bias-bank chunks     |
| `alibi-sdpa-gpt2-gelu` | `alibi-sdpa` with GPT-2's unfused GELU          | as `alibi-sdpa` (attention-only ratio)     |
| `alibi-eager`          | `AlibiGPT2LMHeadModel`                          | the fp32 reference                         |
| `alibi-flex`           | `AlibiGPT2LMHeadModel`                          | FlexAttention, analytic `score_mod`        |
| `alibi-flex-compiled`  | `torch.compile` of `alibi-flex`, inference only | compiled FlexAttention (slow to compile)   |
| `alibi-flash`          | `AlibiGPT2LMHeadModel`, CUDA + flash-attn only  | FlashAttention-2 `alibi_slopes`            |
| `alibi-flash-gpt2-gelu`| `alibi-flash` with GPT-2's unfused GELU         | as `alibi-flash` (attention-only ratio)    |
| `alibi-flex-skip`      | `alibi-flex`, `alibi_skip_eps=1e-7`, inference  | per-head block masks (fused on CUDA)       |
| `alibi-from-bloom`     | `bloom-eager`'s weights imported (`convert`)     | SDPA; logits checked equal to BLOOM's first|
| `jais-eager`           | `benchmarks.jais_eager`: their code's forward   | their eager ALiBi, capped at n_positions   |
| `alibi-from-jais`      | `jais-eager`'s weights imported (`convert`)     | SDPA; logits checked equal to theirs first |
| `baichuan-eager`       | `benchmarks.baichuan_eager`: their code's forward | their eager `(B, H, L, L)` ALiBi mask   |
| `alibi-from-baichuan`  | `baichuan-eager`'s weights imported (`convert`) | SDPA; logits checked equal to theirs first |
| `bert-sdpa`            | `BertModel`, absolute positions, MLP 3072       | SDPA, no bias (the encoder reference)      |
| `bert-sdpa-mlp4608`    | `bert-sdpa` with MLP width 4608                 | as `bert-sdpa`: the GLU's MLP FLOPs        |
| `jina-eager`           | `benchmarks.jina_eager`: their code's forward   | their eager `(1, H, L, L)` ALiBi tensor    |
| `alibi-bert-sdpa`      | `AlibiBertModel`, geglu, `jina-eager`'s weights | SDPA (the default): the split, no L x L    |

`alibi-from-bloom` is your BLOOM, imported: the same random BLOOM as `bloom-eager` (same seed), imported exactly
into hf_alibi, so the two time one function. Its worker refuses to start if the imported logits differ. The same for
`alibi-from-jais` and `jais-eager`, a faithful re-implementation of the Jais / BTLM remote code's forward (their code
cannot ship here): SwiGLU MLP `4 * n_embd` wide, jais-13b's muP multipliers, its n_positions cap of 2048 (longer
inputs raise, as in their code), forward and train suites only (no cache). Likewise `alibi-from-baichuan` and
`baichuan-eager`, Baichuan2-13B's remote code forward (RMSNorm, `W_pack`, SiLU-gated MLP `107/40 * n_embd` wide as
13696 is of 5120, NormHead, its `(B, H, L, L)` mask with no length cap; `--preset baichuan-13b`); its logits are
checked against the import's first. The imported contestants are built in `benchmarks.imported`.

The model as shipped against GPT-2 as shipped, and the attention-only ratio beside it: hf_alibi's MLP runs the tanh
GELU as torch's fused kernel (`hf_alibi/models/alibi/activations.py`), GPT-2's as transformers'
`NewGELUActivation` (8 elementwise ops). `alibi-sdpa` / `alibi-flash` are the models as users get them; their
`-gpt2-gelu` twins put GPT-2's `NewGELUActivation` back into every MLP (`ATTENTION_ONLY`), so that everything but
attention and positions runs GPT-2's very kernels and their ratio to the reference is what ALiBi's attention costs,
not hidden by the faster GELU (nor the GELU by it). Both are whole models in the same cells, processes and protocol,
so the two columns differ by the GELU kernel alone; timing the attention call alone (`bench_attention_call`) would
leave out what ALiBi changes around it (the plan, no position table) and gives a ratio of a part, not of the model.

The encoder contestants run the `encode` suite alone (and only they do): a jina-embeddings-v2-base-shaped encoder
(`--preset jina-base`: hidden 768, 12 heads, GLU intermediate 3072, `max_position_embeddings` 8192) against
transformers' `BertModel` with SDPA and absolute positions (the cost floor; its table covers the run's longest
length). BERT's MLP of width `4 * n_embd` (3072) costs 2/3 of the GLU's (`2 * 3072` wide in, 3072 out), so
`bert-sdpa-mlp4608` (width `6 * n_embd`) is the FLOP-matched floor. `alibi-bert-sdpa` holds `jina-eager`'s very
weights and refuses to start if its hidden states differ from theirs.

Every ratio is against one reference, a GPT-2 without any bias (`REFERENCES`): `gpt2-sdpa` by default, `gpt2-flash`
on a GPU to hold `alibi-flash` against the same FlashAttention-2 kernel without `alibi_slopes` (the parity targets),
or a source's own eager code (`baichuan-eager`, ...) when an import's figure of merit is the code it replaces.
"""

import importlib.util
from dataclasses import asdict, dataclass

from .imported import imported_baichuan, imported_bloom, imported_jais

CONTESTANTS = (
    "gpt2-sdpa",
    "gpt2-flash",
    "bloom-eager",
    "mpt-eager",
    "alibi-sdpa",
    "alibi-eager",
    "alibi-flex",
    "alibi-flex-compiled",
    "alibi-flash",
    "alibi-sdpa-gpt2-gelu",
    "alibi-flash-gpt2-gelu",
    "alibi-from-bloom",
    "alibi-flex-skip",
    "jais-eager",
    "alibi-from-jais",
    "baichuan-eager",
    "alibi-from-baichuan",
    "bert-sdpa",
    "bert-sdpa-mlp4608",
    "jina-eager",
    "alibi-bert-sdpa",
)
# The encoders (the `encode` suite's contestants): their MLP width in units of n_embd where it is BERT's
ENCODERS = {"bert-sdpa": 4, "bert-sdpa-mlp4608": 6, "jina-eager": None, "alibi-bert-sdpa": None}
REFERENCE = "gpt2-sdpa"  # the default reference of every ratio
# The GPT-2s without any bias (plain causal attention: what ALiBi is held against) and their attention backends
GPT2_BACKENDS = {"gpt2-sdpa": "sdpa", "gpt2-flash": "flash_attention_2"}
# ... or the source's own code, to hold an import against what its users run today (its ratios are against that code)
REFERENCES = (*GPT2_BACKENDS, "bert-sdpa", "bloom-eager", "jais-eager", "baichuan-eager")
ALIBI_BACKENDS = {
    "alibi-sdpa": "sdpa",
    "alibi-eager": "eager",
    "alibi-flex": "flex_attention",
    "alibi-flex-compiled": "flex_attention",
    "alibi-flash": "flash_attention_2",
    "alibi-from-bloom": "sdpa",
    "alibi-flex-skip": "flex_attention",
    "alibi-sdpa-gpt2-gelu": "sdpa",
    "alibi-flash-gpt2-gelu": "flash_attention_2",
    "alibi-from-jais": "sdpa",
    "alibi-from-baichuan": "sdpa",
    "alibi-bert-sdpa": "sdpa",
}
# hf_alibi with GPT-2's unfused GELU (transformers' NewGELUActivation) -> the contestant it is, as shipped
ATTENTION_ONLY = {"alibi-sdpa-gpt2-gelu": "alibi-sdpa", "alibi-flash-gpt2-gelu": "alibi-flash"}
SUITES = ("train", "forward", "generate", "encode")


@dataclass(frozen=True)
class Shape:
    """The architecture every contestant shares (MLP width `4 * n_embd` for all of them)."""

    n_embd: int
    n_layer: int
    n_head: int
    vocab_size: int

    def __post_init__(self):
        for name, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.vocab_size < 8:
            raise ValueError(f"vocab_size must be >= 8 (ids 0-2 are reserved for pad/bos/eos), got {self.vocab_size}")


def add_shape_arguments(
    parser,
    n_embd: int,
    n_head: int,
    n_layer: int,
    vocab: int,
    threads: int,
    threads_help: str = "torch threads in each process",
) -> None:
    """The model-shape and thread flags every standalone benchmark takes, with that benchmark's defaults."""
    parser.add_argument("--n-embd", type=int, default=n_embd)
    parser.add_argument("--n-head", type=int, default=n_head)
    parser.add_argument("--n-layer", type=int, default=n_layer)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--threads", type=int, default=threads, help=threads_help)


def shape_fields(args) -> dict:
    """The GPT-2 config fields that the shape flags of `add_shape_arguments` set."""
    return {"n_embd": args.n_embd, "n_head": args.n_head, "n_layer": args.n_layer, "vocab_size": args.vocab}


def default_contestants(device: str) -> list[str]:
    """Every contestant that runs on `device` without a compile step."""
    names = ["gpt2-sdpa", "bloom-eager", "mpt-eager", "alibi-sdpa", "alibi-sdpa-gpt2-gelu", "alibi-eager", "alibi-flex"]
    if device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        names += ["alibi-flash", "alibi-flash-gpt2-gelu"]
    return names


def unsupported_reason(name: str, suite: str, device: str) -> str | None:
    """Why `name` cannot run `suite` on `device`, or None when it can. Decided before any worker starts."""
    if (name in ENCODERS) != (suite == "encode"):
        return "encoders run the encode suite, the causal LMs every other suite"
    if name in ("alibi-flash", "alibi-flash-gpt2-gelu", "gpt2-flash"):
        if device != "cuda":
            return "FlashAttention-2 needs CUDA"
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed"
    if name == "alibi-flex" and suite == "train" and device == "cpu":
        return "FlexAttention has no CPU backward in this torch version"
    if name == "alibi-flex-skip" and (suite == "train" or device != "cuda"):
        return "skipping is measured in training on the split (bench_skip --train); on CPU FlexAttention is unfused"
    if name in ("jais-eager", "baichuan-eager") and suite == "generate":
        return "the re-implementation of their eager code has no KV cache (forward and train only)"
    if name == "alibi-flex-compiled" and suite != "forward":
        return "compiled contestant is inference-forward only (compiling costs ~30 s+ per shape)"
    return None


TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # every contestant's special tokens
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def exact_generation_config(new_tokens: int, **options):
    """Greedy generation of exactly `new_tokens` tokens, with the contestants' pad id; `options` are further
    `GenerationConfig` fields (a cache, a compile config)."""
    from transformers import GenerationConfig

    tokens = {**TOKEN_IDS, "bos_token_id": None, "eos_token_id": None}  # no eos can stop a contestant early
    return GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True, **tokens, **options
    )


def build_model(name: str, shape: Shape, max_length: int):
    """A randomly initialised causal LM for contestant `name`, fp32 on CPU, covering `max_length` positions.

    Returns `(model, forward)` where `forward` is the callable to time: the model itself, or its `torch.compile`.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel

    if name not in CONTESTANTS:
        raise ValueError(f"unknown contestant {name!r}; valid names are {list(CONTESTANTS)}")
    torch.manual_seed(0)
    gpt2_shape = {
        "vocab_size": shape.vocab_size,
        "n_embd": shape.n_embd,
        "n_layer": shape.n_layer,
        "n_head": shape.n_head,
    }
    if name in GPT2_BACKENDS:
        # n_positions covers the longest length of the run (learned table; rows past training are just untrained).
        config = GPT2Config(n_positions=max_length, **gpt2_shape, **NO_DROPOUT, **TOKEN_IDS)
        model = GPT2LMHeadModel._from_config(config, attn_implementation=GPT2_BACKENDS[name])
    elif name in ("bloom-eager", "alibi-from-bloom"):
        model = bloom_model(shape)
        if name == "alibi-from-bloom":
            model = imported_bloom(model)
    elif name == "mpt-eager":
        model = mpt_model(shape, max_length)
    elif name in ENCODERS:
        model = encoder_model(name, shape, max_length)
    elif name in ("jais-eager", "alibi-from-jais"):
        from .jais_eager import JaisEager

        model = JaisEager(shape.vocab_size, shape.n_embd, shape.n_layer, shape.n_head)
        if name == "alibi-from-jais":
            model = imported_jais(model)
    elif name in ("baichuan-eager", "alibi-from-baichuan"):
        from .baichuan_eager import BaichuanEager

        model = BaichuanEager(shape.vocab_size, shape.n_embd, shape.n_layer, shape.n_head)
        if name == "alibi-from-baichuan":
            model = imported_baichuan(model)
    else:
        # Dense unless the name says skip: "auto"'s gain depends on the weights, and these are random (bench_skip
        # measures skipping on trained checkpoints); `-skip` contestants say so with their figures
        skip = {"alibi_skip_eps": 1e-7 if name.endswith("-skip") else 0.0}
        config = AlibiGPT2Config(
            n_positions=max_length, **gpt2_shape, **NO_DROPOUT, classifier_dropout=0.0, **TOKEN_IDS, **skip
        )
        model = AlibiGPT2LMHeadModel._from_config(config, attn_implementation=ALIBI_BACKENDS[name])
        if name in ATTENTION_ONLY:
            with_gpt2_gelu(model)
    forward = torch.compile(model) if name == "alibi-flex-compiled" else model
    return model, forward


def bloom_model(shape: Shape):
    """transformers' `BloomForCausalLM` of `shape`, eager attention, no dropout."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.n_embd,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **TOKEN_IDS,
    )
    return BloomForCausalLM._from_config(config, attn_implementation="eager")


def mpt_model(shape: Shape, max_length: int):
    """transformers' `MptForCausalLM` of `shape`, eager attention, no dropout, its bias built for `max_length`.

    MPT builds its ALiBi tensor for `max_seq_len` keys and slices it, so it must cover the longest length.
    `attn_pdrop` is typed `int` in MptAttentionConfig (strict validation rejects 0.0).
    """
    from transformers import MptConfig, MptForCausalLM

    config = MptConfig(
        d_model=shape.n_embd,
        n_heads=shape.n_head,
        n_layers=shape.n_layer,
        expansion_ratio=4,
        max_seq_len=max_length,
        vocab_size=shape.vocab_size,
        resid_pdrop=0.0,
        emb_pdrop=0.0,
        attn_config={"attn_pdrop": 0, "alibi": True},
        use_cache=True,
        **TOKEN_IDS,
    )
    return MptForCausalLM._from_config(config, attn_implementation="eager")


def with_gpt2_gelu(model):
    """`model` (hf_alibi) with transformers' own class for its activation's name in every MLP: for the default
    `gelu_new`, GPT-2's unfused `NewGELUActivation` in place of the fused kernel the model picks (`mlp_activation`)."""
    from transformers.activations import ACT2FN

    for block in model.transformer.h:
        block.mlp.act = ACT2FN[model.config.activation_function]
    return model


def encoder_model(name: str, shape: Shape, max_length: int, check_length: int = 64):
    """The encoder contestant `name` (see `ENCODERS`), randomly initialised, every dropout 0.

    `alibi-bert-sdpa` is `jina-eager`'s model (same seed) copied key for key into `AlibiBertModel` (dense: no
    certified skipping on random weights), after checking that both give the same hidden states on one input (that
    copy's ALiBi tensor built for the check's length only, so its process never holds theirs).
    """
    import torch
    from transformers import BertConfig, BertModel

    from hf_alibi import AlibiBertConfig, AlibiBertModel

    from .jina_eager import JinaEager

    if ENCODERS[name] is not None:  # BERT: absolute positions covering the run's longest input
        width = ENCODERS[name] * shape.n_embd
        config = BertConfig(
            vocab_size=shape.vocab_size,
            hidden_size=shape.n_embd,
            num_hidden_layers=shape.n_layer,
            num_attention_heads=shape.n_head,
            intermediate_size=width,
            max_position_embeddings=max(max_length, 512),
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return BertModel._from_config(config, attn_implementation="sdpa", add_pooling_layer=False)
    config = AlibiBertConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.n_embd,
        num_hidden_layers=shape.n_layer,
        num_attention_heads=shape.n_head,
        intermediate_size=4 * shape.n_embd,
        hidden_dropout_prob=0.0,
        max_position_embeddings=8192,  # jina-embeddings-v2's: the size of their prebuilt ALiBi tensor
        alibi_skip_eps=0.0,  # dense: what skipping gains depends on trained weights (bench_skip measures it)
    )
    torch.manual_seed(0)
    jina = JinaEager(config, None if name == "jina-eager" else check_length).eval()
    for module in jina.modules():  # BERT's initialisation, as AlibiBertModel's
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=config.initializer_range)
    if name == "jina-eager":
        return jina
    model = AlibiBertModel._from_config(config, attn_implementation="sdpa", add_pooling_layer=False).eval()
    model.load_state_dict(jina.state_dict(), strict=True)
    ids = torch.randint(3, shape.vocab_size, (1, check_length), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        error = (model(ids).last_hidden_state - jina(ids)).abs().max().item()  # (1, L, C) each
    if not error < 1e-4:
        raise RuntimeError(f"AlibiBertModel's hidden states differ from jina-eager's by {error:.2e}")
    return model
