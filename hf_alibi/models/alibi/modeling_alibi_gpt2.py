"""GPT-2 with ALiBi instead of position embeddings (Press et al., 2022, "Train Short, Test Long").

Parameter names and shapes are those of transformers' GPT-2 minus `transformer.wpe.weight`, so GPT-2 weights drop
straight in. Classes in transformers' order: attention, MLP, block, pretrained base, model, heads.
"""

import math

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from torch.nn import functional as F
from transformers import Cache, DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.utils import logging

from .activations import mlp_activation
from .alibi_bias import slopes_from_config
from .attention_alibi import AlibiAttentionBackends, alibi_attention, paged_attention, plan_alibi_attention
from .attention_key_norms import KeyNormSummaries, RunningKeyNorms
from .attention_paged import PAGED_KWARGS, is_paged_cache
from .attention_plan import AlibiAttentionPlan, PlanOptions
from .configuration_alibi_gpt2 import AlibiGPT2Config, train_seq_len
from .normalization import AlibiRMSNorm, norm_layer
from .tensor_parallel_alibi_gpt2 import check_sharding_request  # importing it registers the TP plan's styles
from .transformers_compat import (
    Conv1D,
    GradientCheckpointingLayer,
    OutputRecorder,
    TiedHeadLoading,
    cache_key_length,
    can_return_tuple,
    check_continuous_batching,
    generate_mask_arguments,
    init,
    model_inputs,
    output_cache,
    runs_unobserved,
    takes_past_key_values,
    update_cache,
    with_cache,
)

# isort: split
# transformers before 5.10 copies into its module cache only the files a remote-code entry file imports itself, not
# what those import in turn: the attention core's other modules are named here, so that a saved folder loads on 4.57-5.9
# too (tests/models/alibi/test_hub.py checks that this file imports its whole closure directly).
from .attention_certified import skipping_pays  # noqa: F401
from .attention_eager import FullBias  # noqa: F401
from .attention_flash import FlashVarlen  # noqa: F401
from .attention_flex import FlexBlocks  # noqa: F401
from .attention_packed import PackedDocuments  # noqa: F401
from .attention_routes import ROUTES  # noqa: F401
from .attention_sdpa import BiasBank  # noqa: F401
from .attention_sdpa_split import split_plan  # noqa: F401
from .attention_sdpa_split_calls import SplitCall  # noqa: F401
from .attention_sdpa_split_floor import bias_floors  # noqa: F401
from .attention_skip import KeyRanges  # noqa: F401
from .attention_skip_terms import _grouped_starts  # noqa: F401
from .cpu_flash_kernels import split_kernels_work  # noqa: F401
from .packed_documents import packed_documents  # noqa: F401

logger = logging.get_logger(__name__)

# Inference (no autograd, not traced) over more rows than this computes each block's q|k|v and output projections,
# norm and MLP, which act on each position alone, this many rows at a time: the same numbers, but the widest
# temporaries (c_attn's 3x-wide output, the MLP's 4x-wide one and its activation's) are this many rows instead of the
# whole input, so they stay in the heap glibc reuses instead of being mapped and page-faulted afresh at each call (its
# mmap threshold tops out at 32 MiB), and c_proj writes back into the attention's output instead of a tensor of its
# own. With certified skipping's near keys (`attention_certified.near_widths`), on the demo checkpoint at 256k tokens
# the MLP in rows took the forward's working memory from 1,670 to 1,035 MiB and its time from 16.4 to 12.5 s, and
# q|k|v in rows (c_attn's (L, 3C) output was 48 MiB at 32k) the 32k forward from 1.259 to 1.137 s, the 16k -> 32k
# doubling from x2.16 to x2.04 (`python -m benchmarks.bench_length_scaling`; BENCHMARKS.md, "Length").
INFERENCE_ROWS = 2048


def rows_at_a_time(hidden_states: torch.Tensor) -> bool:
    """Whether this forward runs the per-position layers `INFERENCE_ROWS` rows at a time: inference (no autograd),
    not traced or compiled, over more rows than that."""
    length = hidden_states.shape[1]  # an int, or a symbol while torch.export traces a dynamic length
    traced = torch.compiler.is_compiling() or not isinstance(length, int)
    return not (torch.is_grad_enabled() or traced or length <= INFERENCE_ROWS)  # (no guard on a traced length)


class ProjectionBuffers:
    """The q, k and v buffers one forward's layers share when they compute them rows at a time and no cache keeps
    them: each layer overwrites the last one's instead of allocating three more. From 32 MiB on, a fresh tensor is
    mapped from the system and page-faulted as it is written (8.2 ms per 32 MiB here, 1.4 ms to rewrite one): at 64k
    tokens of the demo's width each of q, k and v is 32 MiB, and sharing them took a forward's faulted bytes from
    about 1 GB to 0.75 GB (BENCHMARKS.md, "Length"). Nothing else holds them: hooks see c_attn's rows, the attention
    module's input and output, never these."""

    def __init__(self):
        self.buffers: tuple[torch.Tensor, ...] = ()

    def take(self, like: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """`projection_buffers(like, shape)`: the last ones where shape, dtype and device match."""
        old = self.buffers[-1] if self.buffers else None  # (layers may sit on different devices: device_map)
        if old is None or (old.shape, old.dtype, old.device) != (shape, like.dtype, like.device):
            self.buffers = ()  # the old ones freed before the new ones are allocated
            self.buffers = projection_buffers(like, shape)
        return self.buffers


def projection_buffers(like: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised q, k and v of `shape` (B, H', L, D), with `like`'s dtype and device. k and v are head-major (each
    head's keys contiguous, what the attention calls read by head and a cache keeps); q is laid out (B, L, H', D),
    because the attention kernels lay their output out as their query: a head-major query made the certified split
    copy its diagonal calls' output into a new (B, L, H' D) tensor, 32 MiB at 64k tokens, while this one is the
    output's (B, L, H' D) view itself (`cpu_flash_kernels.attend_diagonals`), which c_proj then overwrites."""
    batch, heads, length, dim = shape
    query = like.new_empty(batch, length, heads, dim).transpose(1, 2)  # (B, H', L, D) seen, (B, L, H', D) in memory
    return query, like.new_empty(shape), like.new_empty(shape)


class AlibiGPT2Conv1D(Conv1D):
    """transformers' `Conv1D` (GPT-2's `(in, out)` weight layout) whose bias may be absent (`bias=False`, MPT)."""

    def __init__(self, nf: int, nx: int, bias: bool = True):
        super().__init__(nf, nx)
        if not bias:
            self.bias = None  # no parameter at all: the state dict has no `.bias` key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The output width is the weight's, not `nf`: a tensor-parallel rank holds only its columns.
        flat = x.reshape(-1, x.shape[-1])  # (N, in)
        out = torch.addmm(self.bias, flat, self.weight) if self.bias is not None else flat @ self.weight  # (N, out')
        return out.view(*x.shape[:-1], out.shape[-1])  # (..., out')


class AlibiGPT2Attention(nn.Module):
    def __init__(self, config: AlibiGPT2Config, layer_idx: int):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        # The global heads this module computes: None = all; a tensor-parallel rank's slice (set by the plan's
        # `alibi_heads` style) picks those heads' slopes, since the paper's order is not monotone in the head index.
        self.heads: slice | None = None
        # GPT-2's 1/sqrt(d) at the default power 0.5; muP's 1/d (Jais, BTLM) at 1.0
        self.scaling = self.head_dim**-config.attn_scale_power if config.scale_attn_weights else 1.0
        self.layer_idx = layer_idx
        self.c_attn = AlibiGPT2Conv1D(3 * self.embed_dim, self.embed_dim, bias=config.bias)
        self.c_proj = AlibiGPT2Conv1D(self.embed_dim, self.embed_dim, bias=config.bias)
        # MPT's clip_qkv; Hardtanh(-c, c) is clamp(-c, c)
        self.clip_qkv = nn.Hardtanh(-config.clip_qkv, config.clip_qkv) if config.clip_qkv is not None else nn.Identity()
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(
        self,
        hidden_states: torch.Tensor,
        plan: AlibiAttentionPlan,
        cache: Cache | None = None,
        output_attentions: bool = False,
        buffers: ProjectionBuffers | None = None,
        norm: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The heads' attention over `hidden_states` (B, q, C) and its output projection: (B, q, C), and the attention
        weights if `output_attentions`. `norm`: the block's norm, applied here to each block of rows just before
        c_attn, when the block runs the layer in rows (`AlibiGPT2Block.forward`); `hidden_states` is then the norm's
        input."""
        batch, length, _ = hidden_states.shape
        buffers = buffers if cache is None else None
        query, key, value = self.projections(hidden_states, buffers, norm)  # 3 x (B, H', q, D)
        if is_paged_cache(cache):  # continuous batching: every scheduled request's keys, outside compiled graphs
            output, weights = paged_attention(cache, query, key, value, plan, self.scaling, self.layer_idx, self.heads)
        else:
            if cache is not None:
                key, value = update_cache(cache, key, value, self.layer_idx, plan.query_offset)  # (B, H', kv, D)
            output, weights = alibi_attention(
                query, key, value, plan, self.scaling, output_attentions, heads=self.heads, layer=self.layer_idx
            )  # (B, q, H', D)
        output = output.reshape(batch, length, -1)  # (B, q, H' D)
        del query, key, value  # freed before c_proj allocates, unless a cache, autograd or the shared buffers keep them
        return self.output_projection(output), weights

    def output_projection(self, output: torch.Tensor) -> torch.Tensor:
        """c_proj (and its dropout) of the heads' output (B, q, H' D). Over a long input at inference, `INFERENCE_ROWS`
        rows at a time, written back into `output` itself: a tensor of this call's own (every attention route returns
        a new one), which becomes the module's output instead of one more tensor as large (the same numbers). A
        tensor-parallel rank's narrower H' D, or autocast's other dtype, gets a new tensor, still filled in rows."""
        if not rows_at_a_time(output):
            return self.resid_dropout(self.c_proj(output))  # (B, q, C)
        batch, length, _ = output.shape
        projected = None
        for start in range(0, length, INFERENCE_ROWS):
            part = self.resid_dropout(self.c_proj(output[:, start : start + INFERENCE_ROWS]))  # (B, r, C)
            if projected is None:
                same = part.shape[-1] == output.shape[-1] and part.dtype == output.dtype
                projected = output if same else part.new_empty(batch, length, part.shape[-1])  # (B, q, C)
            projected[:, start : start + part.shape[1]] = part  # rows this call has read already
        return projected

    def projections(
        self, hidden_states: torch.Tensor, buffers: ProjectionBuffers | None = None, norm: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of this module's heads, each (B, H', q, D): all heads, or a tensor-parallel rank's H' (its c_attn
        holds [q_r|k_r|v_r]). Views of c_attn's output; over a long input at inference, three buffers
        (`projection_buffers`) filled `INFERENCE_ROWS` rows at a time (the same numbers): `buffers`' when given
        (nothing keeps them past this layer's attention), else new ones. `norm`, if given, normalises each block of
        rows first (no (B, q, C) tensor of its output)."""
        batch, length, _ = hidden_states.shape

        def normed(rows):  # (no module built per call: decoding runs this every step)
            return rows if norm is None else norm(rows)

        if not rows_at_a_time(hidden_states):
            qkv = self.clip_qkv(self.c_attn(normed(hidden_states))).chunk(3, dim=2)  # 3 x (B, q, H' D)
            return tuple(t.view(batch, length, -1, self.head_dim).transpose(1, 2) for t in qkv)  # 3 x (B, H', q, D)
        for start in range(0, length, INFERENCE_ROWS):
            part = self.clip_qkv(self.c_attn(normed(hidden_states[:, start : start + INFERENCE_ROWS])))  # (B, r, 3H'D)
            part = part.view(batch, part.shape[1], 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H', r, D)
            if start == 0:  # three buffers, not one: each a third of the size, under the mmap threshold longer
                shape = (batch, part.shape[2], length, self.head_dim)
                heads = buffers.take(part, shape) if buffers is not None else projection_buffers(part, shape)
            for buffer, rows in zip(heads, part):
                buffer[:, :, start : start + rows.shape[2]] = rows
        return tuple(heads)


class AlibiGPT2MLP(nn.Module):
    """GPT-2's MLP, `c_proj(act(c_fc(x)))`; with `gated_mlp`, `c_proj(c_fc(x) * act(c_fc2(x)))`, the gate `c_fc2` as
    wide as `c_fc` (SwiGLU with `silu`: Jais's and BTLM's MLP, whose module names these are)."""

    def __init__(self, intermediate_size: int, config: AlibiGPT2Config):
        super().__init__()
        self.c_fc = AlibiGPT2Conv1D(intermediate_size, config.n_embd, bias=config.bias)
        if config.gated_mlp:
            self.c_fc2 = AlibiGPT2Conv1D(intermediate_size, config.n_embd, bias=config.bias)
        self.c_proj = AlibiGPT2Conv1D(config.n_embd, intermediate_size, bias=config.bias)
        self.act = mlp_activation(config.activation_function)  # the tanh GELU fused (activations.py)
        self.dropout = nn.Dropout(config.resid_pdrop)
        self.gated = config.gated_mlp

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.gated:
            hidden = self.c_fc(hidden_states) * self.act(self.c_fc2(hidden_states))  # (B, q, n_inner')
        else:
            hidden = self.act(self.c_fc(hidden_states))  # (B, q, n_inner')
        return self.dropout(self.c_proj(hidden))


class AlibiGPT2Block(GradientCheckpointingLayer):
    def __init__(self, config: AlibiGPT2Config, layer_idx: int):
        super().__init__()
        inner_dim = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.ln_1 = norm_layer(config)  # LayerNorm, or RMSNorm (`norm_type`)
        self.attn = AlibiGPT2Attention(config, layer_idx)
        self.ln_2 = norm_layer(config)
        self.mlp = AlibiGPT2MLP(inner_dim, config)

    def forward(self, hidden_states, plan, cache=None, output_attentions=False, buffers=None):
        if not rows_at_a_time(hidden_states):
            attn_output, weights = self.attn(self.ln_1(hidden_states), plan, cache, output_attentions, buffers)
            hidden_states = hidden_states + attn_output  # (B, q, C)
            return hidden_states + self.mlp(self.ln_2(hidden_states)), weights
        # Inference over a long input: the layer in rows (`INFERENCE_ROWS`), the same numbers. When nothing observes the
        # norm or the attention module (no hooks, no wrapper: `runs_unobserved`), the norm runs on each block of rows
        # just before c_attn and the attention's output, a tensor of its own, becomes the block's, the residual and the
        # MLP added into it: the layer allocates one (B, q, C) tensor instead of three, and reads none of them back
        # from memory after a pass over the whole input (the first doubling from 16k tokens: BENCHMARKS.md, "Length").
        # Otherwise hooks see what they always do: the norm's whole output, the attention module's own.
        fused = runs_unobserved(self.ln_1) and runs_unobserved(self.attn)
        if fused:
            attn_output, weights = self.attn(hidden_states, plan, cache, output_attentions, buffers, norm=self.ln_1)
        else:
            attn_output, weights = self.attn(self.ln_1(hidden_states), plan, cache, output_attentions, buffers)
        residual = None
        if fused and attn_output.dtype == hidden_states.dtype:  # (autocast's bf16 output: added as below, in fp32)
            hidden_states, residual = attn_output, hidden_states  # (B, q, C) each; the residual added in rows
        else:
            hidden_states = hidden_states + attn_output  # (B, q, C): this block's own tensor
        for start in range(0, hidden_states.shape[1], INFERENCE_ROWS):  # in place, in rows
            rows = hidden_states[:, start : start + INFERENCE_ROWS]  # (B, r, C), a view
            if residual is not None:
                rows += residual[:, start : start + INFERENCE_ROWS]  # attention + residual: the sum above, exactly
            rows += self.mlp(self.ln_2(rows))
        return hidden_states, weights


class AlibiGPT2PreTrainedModel(TiedHeadLoading, AlibiAttentionBackends, PreTrainedModel):
    config_class = AlibiGPT2Config
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AlibiGPT2Block"]
    # transformers' meaning: the forward compiles without graph breaks with a compilable cache (none, dynamic, static;
    # tested). Continuous batching's paged cache breaks every model's graph at its `update`, and ours at the paged
    # planner too (`attention_paged.py`: both `torch.compiler.disable`, host reads kept out of compiled graphs).
    _can_compile_fullgraph = True
    # What `output_hidden_states` / `output_attentions` record (transformers' `capture_outputs` hooks): each block's
    # input and output, each attention module's weights
    _can_record_outputs = {"hidden_states": AlibiGPT2Block, "attentions": OutputRecorder(AlibiGPT2Attention, index=1)}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' `from_pretrained`; asking it for tensor parallelism or FSDP2 (`tp_plan`, `tp_size`,
        `device_mesh`, `distributed_config`) on a transformers older than the plan's styles fails first, in one line
        naming the release they need (`tensor_parallel_alibi_gpt2.check_sharding_request`)."""
        check_sharding_request(kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def _init_weights(self, module):
        """GPT-2's initialisation; refills the fixed slopes (built on the meta device by `from_pretrained`)."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, Conv1D)):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (nn.LayerNorm, AlibiRMSNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        if isinstance(module, (AlibiGPT2Attention, AlibiGPT2MLP)):
            # GPT-2: residual projections scaled by 1 / sqrt(2 * n_layer) (two residual paths per block)
            init.normal_(module.c_proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
        if isinstance(module, AlibiGPT2Model):
            init.copy_(module.alibi_slopes, slopes_from_config(self.config))


class AlibiGPT2Model(AlibiGPT2PreTrainedModel):
    def __init__(self, config: AlibiGPT2Config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # BLOOM's word_embeddings_layernorm; Identity adds no state-dict keys, so older checkpoints load unchanged
        self.ln_embd = norm_layer(config) if config.embedding_layernorm else nn.Identity()
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([AlibiGPT2Block(config, layer_idx=i) for i in range(config.n_layer)])
        self.ln_f = norm_layer(config)
        # Fixed, never trained: a non-persistent buffer (not in checkpoints, not seen by optimizers).
        self.register_buffer("alibi_slopes", slopes_from_config(config), persistent=False)  # (H,)
        # Per cache this model decodes with skipping, the running key-norm summary (attention_certified.py)
        self.key_norms = KeyNormSummaries()
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, new_embeddings):
        self.wte = new_embeddings

    def _apply(self, fn, recurse=True):
        # `model.to(bfloat16)` would round slopes such as 2**-0.5 (0.3 of a logit at distance 4096): keep them fp32.
        super()._apply(fn, recurse)
        if self.alibi_slopes.dtype != torch.float32:
            self.alibi_slopes = slopes_from_config(self.config).to(self.alibi_slopes.device)
        return self

    @model_inputs
    @takes_past_key_values
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, length)`): token ids; with a `cache`, only the new ones.
        cache (`transformers.Cache`, *optional*): keys and values of earlier tokens, dynamic or static
            (`past_key_values` is the deprecated name and warns). Positions come from the cache length.
        attention_mask (`torch.Tensor` of shape `(batch, cached + length)`, *optional*): 1 for real tokens, 0 for
            padding (left or right). Padding is masked out of the keys; distances stay `i - j`.
        token_type_ids (`torch.LongTensor` of shape `(batch, length)`, *optional*): segment ids, embedded with `wte`
            and added to the token embeddings, as in GPT-2.
        position_ids (`torch.LongTensor` of shape `(batch, length)`, *optional*): ALiBi takes distances from token
            order, so positions matter only for packed rows: where they restart (transformers' padding-free
            collators, TRL's `padding_free`), each document attends only to itself. Read without a cache and
            without an `attention_mask`, as transformers' models do; `cu_seq_lens_q` (flash-attention style, one
            flattened row) marks documents too.
        `output_hidden_states`, `output_attentions` and `return_dict` are transformers' (its `capture_outputs` records
        the blocks' outputs and the attention weights); attention weights come from the eager path, planned once.
        """
        kwargs.pop("output_hidden_states", None)  # recorded by capture_outputs' hooks
        output_attentions = kwargs.pop("output_attentions", None)
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        inputs_embeds = self.ln_embd(self._embed(input_ids, inputs_embeds, token_type_ids))  # (B, q, C)
        batch, query_length = inputs_embeds.shape[:2]  # BLOOM normalises passed-in embeddings too
        if is_paged_cache(cache):  # transformers' continuous batching: one flattened row of requests
            if output_attentions:
                raise ValueError("output_attentions is not available under continuous batching (a paged cache)")
        elif use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        arguments = self.attention_plan_arguments(
            inputs_embeds, cache, attention_mask, position_ids, output_attentions, kwargs
        )
        if not is_paged_cache(
            cache
        ):  # the cache's running key-norm summary, told of this forward's keys (before writes)
            offset = arguments["query_offset"]
            arguments["key_norms"] = RunningKeyNorms.for_forward(self.key_norms, cache, offset, query_length)
        plan = plan_alibi_attention(**arguments)  # validated and built once; every layer only reads it

        rank_heads = self.h[0].attn.heads if len(self.h) else None  # every layer of a tensor-parallel rank: the same
        if rank_heads is not None:
            plan = plan.for_heads(rank_heads)  # once per forward, not once per layer

        hidden_states = self.drop(inputs_embeds)
        # A checkpointed block runs twice (forward, then the backward replay): a cache would get its keys twice.
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        buffers = ProjectionBuffers()  # q, k, v over a long input at inference, shared by the layers (no cache)
        for block in self.h:
            hidden_states, _ = block(hidden_states, plan, None if checkpointing else cache, output_attentions, buffers)
        hidden_states = self.ln_f(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **with_cache(cache if use_cache else None))

    def attention_plan_arguments(
        self, inputs_embeds, cache, attention_mask, position_ids, output_attentions, kwargs
    ) -> dict:
        """The arguments of this forward's one `plan_alibi_attention` call (attention_plan.py) but the cache's key-norm
        summary: from its embedded inputs (their shape and compute dtype), its cache (a dynamic or static `Cache`, a
        continuous batch's `PagedAttentionCache` with its `kwargs`, or None) and its other inputs."""
        batch, query_length = inputs_embeds.shape[:2]
        options = PlanOptions(
            dtype=_compute_dtype(inputs_embeds),
            dropout=self.config.attn_pdrop if self.training else 0.0,
            sdpa_split=self.config.alibi_sdpa_split,
            query_chunk=self.config.alibi_sdpa_query_chunk,
            skip_eps=self.config.alibi_skip_eps,
            output_attentions=output_attentions,  # weights: the eager path in every layer, planned once
            train_seq_len=train_seq_len(self.config.alibi_scaling),
        )
        arguments = dict(
            implementation=self.config._attn_implementation or "sdpa",
            slopes=self.alibi_slopes,
            batch=batch,
            query_length=query_length,
            position_ids=position_ids,
            options=options,
        )
        if is_paged_cache(cache):  # one flattened row of requests, described by the continuous-batching kwargs
            return dict(arguments, key_length=query_length, paged_kwargs=kwargs)
        query_offset = cache.get_seq_length() if cache is not None else 0  # a 0-d tensor for static caches
        if isinstance(query_offset, torch.Tensor):
            query_offset = query_offset.clone()  # the cache advances it in place during this forward
        key_length = cache_key_length(cache, query_length, query_offset) if cache is not None else query_length
        return dict(
            arguments,
            key_length=key_length,
            query_offset=query_offset,
            attention_mask=attention_mask,
            cu_seq_lens=kwargs.get("cu_seq_lens_q"),
        )

    @torch.no_grad()
    def attention_route_plan(
        self,
        input_ids=None,
        cache=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        output_attentions=None,
        **kwargs,
    ) -> AlibiAttentionPlan:
        """The route plan (`path`, `reason` and the facts; no payload) a forward with these inputs takes, without
        running its layers: the forward's own planning call with `prepare=False` (`hf_alibi.attention_route`)."""
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        if is_paged_cache(cache) and output_attentions:
            raise ValueError("output_attentions is not available under continuous batching (a paged cache)")
        inputs_embeds = self.ln_embd(self._embed(input_ids, inputs_embeds, token_type_ids))  # (B, q, C)
        arguments = self.attention_plan_arguments(
            inputs_embeds, cache, attention_mask, position_ids, output_attentions, kwargs
        )
        return plan_alibi_attention(**arguments, prepare=False)

    def _embed(self, input_ids, inputs_embeds, token_type_ids) -> torch.Tensor:
        """Token (plus segment) embeddings, after checking the input shapes with errors that name them."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(
                    f"input_ids must be 2-D (batch, length), got shape {tuple(input_ids.shape)}; "
                    "wrap a single sequence as input_ids[None]"
                )
            shape = tuple(input_ids.shape)
        elif inputs_embeds.dim() != 3:
            raise ValueError(f"inputs_embeds must be 3-D (batch, length, n_embd), got {tuple(inputs_embeds.shape)}")
        else:
            shape = tuple(inputs_embeds.shape[:2])
        if shape[1] == 0:
            raise ValueError(f"the input has no tokens (shape {shape}): pass at least one token per row")
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)  # (B, q, C)
        inputs_embeds = scaled(inputs_embeds, self.config.embedding_scale)  # muP's multiplier, before segments
        if token_type_ids is not None:
            if tuple(token_type_ids.shape) != shape:
                raise ValueError(f"token_type_ids has shape {tuple(token_type_ids.shape)}, the input {shape}")
            inputs_embeds = inputs_embeds + self.wte(token_type_ids)  # (B, q, C), GPT-2's segment embedding
        return inputs_embeds


def scaled(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """`tensor * scale` with the scale rounded to the tensor's dtype, as Jais and BTLM multiply (`x *= torch.tensor(
    scale, dtype=x.dtype)`: in bf16, 14.6 is 14.625); the tensor itself when the scale is 1."""
    if scale == 1.0:
        return tensor
    return tensor * torch.tensor(scale, dtype=tensor.dtype, device=tensor.device)


def _compute_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype the layers' projections produce: autocast's when it is on for this device, else the inputs'."""
    device = hidden_states.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden_states.dtype


# Descriptions of one flattened row, for the model: flash-attention style packed rows (transformers'
# DataCollatorWithFlattening) and continuous batching's requests with the paged cache's indices
_FLATTENED_BATCH_KWARGS = PAGED_KWARGS


class AlibiGPT2LMHeadModel(AlibiGPT2PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    # Llama's: the head's columns (vocabulary) split like the tied embedding, logits gathered; FSDP keeps it gathered
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: AlibiGPT2Config):
        super().__init__(config)
        self.transformer = AlibiGPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # transformers guesses the loss from the class name and warns (a graph break under torch.compile) otherwise
        self.loss_type = "ForCausalLM"
        self.post_init()

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching (`generate_batch`, `transformers serve --continuous-batching` start here),
        refused in one line on a transformers whose paged cache the model does not read."""
        check_continuous_batching()
        return super().init_continuous_batching(*args, **kwargs)

    def create_masks_for_generate(self, attention_mask=None, cache=None, inputs_embeds=None, **kwargs):
        """ALiBi builds its masks inside the model from the 2-D mask: keep it 2-D. For a static cache, pad it to the
        cache's length, so every decoding step has the same shapes (one compiled graph)."""
        cache, inputs_embeds = generate_mask_arguments(cache, inputs_embeds, kwargs)
        if attention_mask is None or cache is None or inputs_embeds is None:
            return attention_mask
        key_length = cache_key_length(cache, inputs_embeds.shape[1], cache.get_seq_length())
        if attention_mask.shape[-1] < key_length:  # later positions are hidden by causality, whatever they hold
            attention_mask = F.pad(attention_mask, (0, key_length - attention_mask.shape[-1]), value=1)
        return attention_mask

    @can_return_tuple
    @takes_past_key_values
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        r"""
        labels (`torch.LongTensor` of shape `(batch, length)`, *optional*): targets for the language-modelling loss,
            shifted inside the model (so `labels = input_ids` works); -100 is ignored.
        logits_to_keep (`int` or `torch.Tensor`, *optional*): compute logits only for the last `n` positions (0: all).
        Other arguments as in [`AlibiGPT2Model.forward`].
        """
        flattened = {name: kwargs.pop(name) for name in _FLATTENED_BATCH_KWARGS if name in kwargs}
        outputs = self.transformer(
            input_ids,
            cache=cache,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **flattened,
        )
        hidden_states = outputs.last_hidden_state  # (B, q, C)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = scaled(self.lm_head(hidden_states[:, keep, :]), self.config.logit_scale)  # (B, q', V)
        loss = None
        if labels is not None:
            # `num_items_in_batch` (from Trainer, in kwargs) makes the loss exact under gradient accumulation.
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **with_cache(output_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output


class AlibiGPT2ForSequenceClassification(AlibiGPT2PreTrainedModel):
    """Classifies from the last real (non-padding) token, as GPT-2 does; needs `pad_token_id` for batches > 1."""

    def __init__(self, config: AlibiGPT2Config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = AlibiGPT2Model(config)
        self.score = nn.Linear(config.n_embd, self.num_labels, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, **kwargs):
        outputs = self.transformer(
            input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, return_dict=True, **kwargs
        )  # a model output whatever config.return_dict says (can_return_tuple turns ours into a tuple)
        logits = self.score(outputs.last_hidden_state)  # (B, L, num_labels)
        batch = logits.shape[0]
        if self.config.pad_token_id is None and batch != 1:
            raise ValueError("Cannot classify batches of more than one sequence without config.pad_token_id")
        if self.config.pad_token_id is None or input_ids is None:
            last = torch.full((batch,), logits.shape[1] - 1, device=logits.device)
        else:  # rightmost non-padding token: handles left and right padding
            real = (input_ids != self.config.pad_token_id).int()  # (B, L)
            last = (torch.arange(input_ids.shape[-1], device=logits.device) * real).argmax(-1)  # (B,)
        pooled = logits[torch.arange(batch, device=logits.device), last]  # (B, num_labels)
        loss = None if labels is None else self._loss(pooled, labels)
        output = SequenceClassifierOutputWithPast(
            loss=loss, logits=pooled, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output

    def _loss(self, pooled: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            if self.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        if self.config.problem_type == "regression":
            return MSELoss()(pooled.squeeze(-1), labels.squeeze(-1).to(pooled.dtype))
        if self.config.problem_type == "single_label_classification":
            return CrossEntropyLoss()(pooled.view(-1, self.num_labels), labels.view(-1))
        return BCEWithLogitsLoss()(pooled, labels.to(pooled.dtype))


class AlibiGPT2ForTokenClassification(AlibiGPT2PreTrainedModel):
    def __init__(self, config: AlibiGPT2Config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = AlibiGPT2Model(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.n_embd, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, **kwargs):
        outputs = self.transformer(
            input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, return_dict=True, **kwargs
        )  # a model output whatever config.return_dict says (can_return_tuple turns ours into a tuple)
        logits = self.classifier(self.dropout(outputs.last_hidden_state))  # (B, L, num_labels)
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1))
        output = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output


class AlibiGPT2ForQuestionAnswering(AlibiGPT2PreTrainedModel):
    def __init__(self, config: AlibiGPT2Config):
        super().__init__(config)
        self.transformer = AlibiGPT2Model(config)
        self.qa_outputs = nn.Linear(config.n_embd, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        start_positions=None,
        end_positions=None,
        **kwargs,
    ):
        outputs = self.transformer(
            input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, return_dict=True, **kwargs
        )  # a model output whatever config.return_dict says (can_return_tuple turns ours into a tuple)
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).unbind(-1)  # 2 x (B, L)
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]  # positions outside the input are ignored, as in GPT-2
            loss_fct = CrossEntropyLoss(ignore_index=ignored)
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = (loss_fct(start_logits, start) + loss_fct(end_logits, end)) / 2
        output = QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits.contiguous(),
            end_logits=end_logits.contiguous(),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output


__all__ = [
    "AlibiGPT2PreTrainedModel",
    "AlibiGPT2Model",
    "AlibiGPT2LMHeadModel",
    "AlibiGPT2ForSequenceClassification",
    "AlibiGPT2ForTokenClassification",
    "AlibiGPT2ForQuestionAnswering",
]
