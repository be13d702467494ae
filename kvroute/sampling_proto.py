"""SamplingParams <-> the wire's `kvroute.v1.SamplingParams`: one conversion for the worker (what it receives), the
gateway's gRPC front door (what a client sends) and the request path (what it forwards)."""

from __future__ import annotations

from kvroute.sampling import SamplingParams, StructuredOutput
from proto import worker_pb2

_DEFAULT = SamplingParams()


def sampling_from_proto(msg: worker_pb2.SamplingParams, default_max_tokens: int | None = None) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults (max_tokens: `default_max_tokens` when given);
    values are not checked here (`validate()` does, naming the field)."""
    if msg.HasField("max_tokens"):
        max_tokens = msg.max_tokens
    else:
        max_tokens = _DEFAULT.max_tokens if default_max_tokens is None else default_max_tokens
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else _DEFAULT.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else _DEFAULT.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        structured=structured_from_proto(msg.structured) if msg.HasField("structured") else None,
    )


def structured_from_proto(msg: worker_pb2.StructuredOutput) -> StructuredOutput | None:
    """None when no kind is set (an empty message constrains nothing)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    return StructuredOutput(kind, getattr(msg, kind))


def structured_to_proto(structured: StructuredOutput) -> worker_pb2.StructuredOutput:
    if structured.kind == "json_object":
        return worker_pb2.StructuredOutput(json_object=True)
    if structured.kind == "json_schema":
        return worker_pb2.StructuredOutput(json_schema=structured.spec)
    return worker_pb2.StructuredOutput(structural_tag=structured.spec)


def sampling_to_proto(params: SamplingParams) -> worker_pb2.SamplingParams:
    """Every field set explicitly (a seed of None stays unset), so `sampling_from_proto` gives `params` back."""
    return worker_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        structured=None if params.structured is None else structured_to_proto(params.structured),
    )
