"""Real vLLM 0.25.1 objects built on the CPU, for the tests of the vLLM hooks.

Import this only after `pytest.importorskip("vllm")`: it imports vLLM at the top. The objects are vLLM's
own (Request, SchedulerOutput, NewRequestData, CachedRequestData), filled the way the scheduler fills them
for one step, so a hook under test reads exactly the fields and types the engine hands it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request


def make_request(req_id: str, prompt_len: int, max_tokens: int = 16, *,
                 trace_headers: Mapping[str, str] | None = None,
                 arrival_time: float | None = None) -> Request:
    """A generative request of `prompt_len` prompt tokens, as the engine core builds it from a client's."""
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len must be a positive int, got {prompt_len!r}")
    return Request(
        request_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        arrival_time=arrival_time,
        trace_headers=dict(trace_headers) if trace_headers is not None else None,
    )


def make_scheduler_output(num_scheduled_tokens: Mapping[str, int], finished: Iterable[str] = (), *,
                          new_requests: Iterable[Request] = ()) -> SchedulerOutput:
    """One step's SchedulerOutput: `num_scheduled_tokens` {req_id: tokens this step}, `finished` the ids
    finished since the last step. Requests in `new_requests` are scheduled for the first time
    (scheduled_new_reqs, built by vLLM's NewRequestData.from_request); every other id is a running one
    (scheduled_cached_reqs)."""
    tokens = dict(num_scheduled_tokens)
    for req_id, n in tokens.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"tokens for {req_id!r} must be a non-negative int, got {n!r}")
    new = list(new_requests)
    new_ids = {r.request_id for r in new}
    unknown = new_ids - tokens.keys()
    if unknown:
        raise ValueError(f"new requests with no scheduled tokens: {sorted(unknown)}")
    running = [req_id for req_id in tokens if req_id not in new_ids]
    cached = _fields_of(
        CachedRequestData,
        req_ids=running,
        resumed_req_ids=set(),              # gone in 0.34
        new_token_ids=[],
        all_token_ids={},                   # gone in 0.34
        new_block_ids=[None] * len(running),
        num_computed_tokens=[0] * len(running),
        num_output_tokens=[0] * len(running),
    )
    return _fields_of(
        SchedulerOutput,
        scheduled_new_reqs=[_new_request_data(r) for r in new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[],        # gone in 0.34
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
    )


def _fields_of(cls, **fields):
    """cls(**fields) with only the fields this vLLM's dataclass has (later releases dropped some)."""
    return cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})


def _new_request_data(request: Request) -> NewRequestData:
    """NewRequestData.from_request as the scheduler calls it: prefill_token_ids is optional up to 0.30 (None
    from the V1 model runner), required in 0.34 (the request's prefill_token_ids)."""
    import inspect
    if inspect.signature(NewRequestData.from_request).parameters["prefill_token_ids"].default is None:
        return NewRequestData.from_request(request, block_ids=([],))
    return NewRequestData.from_request(request, ([],), request.prefill_token_ids)
