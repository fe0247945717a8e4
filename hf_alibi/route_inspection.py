"""Which attention route a forward takes, and why, without running it: `attention_route(model, **inputs)`.

Every forward of an ALiBi model plans its attention once (`models/alibi/attention_alibi.plan_alibi_attention`):
`choose_path` picks one route of `models/alibi/attention_routes.ROUTES` from the inputs' facts and says why. This
module asks the model for that same planning call with the inputs a forward would get, stopping at the route (no
payload is built, no layer runs: only the embeddings, for the inputs' shape and compute dtype), so the answer is the
route the forward takes.
"""

from dataclasses import dataclass

import torch

from .models.alibi.attention_routes import ROUTES

__all__ = ["AttentionRouteReport", "attention_route"]


@dataclass(frozen=True)
class AttentionRouteReport:
    """The route a forward takes and the facts it was chosen from."""

    name: str  # the route (a key of `hf_alibi.models.alibi.attention_routes.ROUTES`), e.g. "sdpa_split"
    reason: str  # why `choose_path` chose it
    description: str  # when the route is chosen, from the registry
    implementation: str  # the model's attn_implementation the route was chosen for
    batch: int
    query_length: int  # new tokens per row
    key_length: int  # keys each layer reads (cached + new)
    cached_tokens: int | None  # tokens already in the cache (None: a static cache's count inside compilation)
    padded: bool  # the attention mask hides padding
    packed: bool  # packed rows (restarting position_ids or cu_seq_lens_q): each document attends to itself
    causal: bool  # False: an encoder's bidirectional attention
    skip_eps: float  # the eps certified key skipping runs with on this route (0.0: dense)
    document_routes: dict[int, str] | None = None  # sdpa_packed: each document length's own route


def attention_route(
    model,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
    output_attentions: bool | None = None,
    **kwargs,
) -> AttentionRouteReport:
    """Which attention route `model(input_ids, attention_mask=..., ...)` would take, and why.

    `model` is an ALiBi GPT-2 or ALiBi BERT model (any head class, or one loaded with `trust_remote_code`), in the
    state (training or eval, `attn_implementation`, config switches) the forward would run in. The arguments are
    the forward's: `past_key_values` (or `cache=`) a transformers `Cache` as the forward would get it (its length is
    read, nothing written), and flash-attention style `cu_seq_lens_q` (or continuous batching's paged arguments) in
    `kwargs`. The model's layers do not run.
    """
    base = getattr(model, model.base_model_prefix, model)
    if not hasattr(base, "attention_route_plan"):
        raise TypeError(f"{type(model).__name__} is not an ALiBi model of hf_alibi (no attention_route_plan)")
    if "cache" in kwargs:
        past_key_values = kwargs.pop("cache")
    inputs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        output_attentions=output_attentions,
        **kwargs,
    )
    if past_key_values is not None:
        inputs["cache"] = past_key_values
    return _report(base, base.attention_route_plan(**inputs))


def _report(base, plan) -> AttentionRouteReport:
    offset = plan.query_offset
    cached = int(offset) if not isinstance(offset, torch.Tensor) or not torch.compiler.is_compiling() else None
    parts = getattr(plan.payload, "parts", None)  # sdpa_packed: (row, start, end, the document's route-only plan)
    document_routes = None if parts is None else {end - start: part.path for _, start, end, part in parts}
    return AttentionRouteReport(
        name=plan.path,
        reason=plan.route.reason,
        description=ROUTES[plan.path].when,
        implementation=base.config._attn_implementation or "sdpa",
        batch=plan.batch,
        query_length=plan.query_length,
        key_length=int(plan.key_length),
        cached_tokens=cached,
        padded=plan.key_padding is not None,
        packed=plan.documents is not None,
        causal=plan.causal,
        skip_eps=plan.route.eps,
        document_routes=document_routes,
    )
