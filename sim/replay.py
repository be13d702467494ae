"""The fleet replay: a trace through N simulated replicas and the real router, on a virtual clock (sim/).

Each replica is the worker's own engine (`LLMEngine` with the sim runner: the real scheduler with chunked
prefill, the admission watermark and preemption, `KVCacheManager`, `BlockPool`), paced by the sim worker's
`SimCostModel`: a step costs `prefill_us_per_token` per prompt token it computes plus `decode_ms_per_step`
if it decodes. TTFT = arrival to the end of the step that samples the first token; busy time of a replica =
the sum of its steps' costs; load_imbalance = max / mean busy time; busy_min_share = min / mean (a starved
replica shows 0). A request's cached tokens are what its engine found at its first admission (the engine's
figure), prefill tokens = prompt tokens less those.
Token-id traces: the prompt as given, the known answer (when the trace has it) sampled as the output, so a
multi-turn chat's next turn finds the answer's blocks where it was decoded; block hashes are kvroute.hashing's
(model id "replay" unless `model_id`, the request's tenant salt). Mooncake traces: block i of a prompt is 512
tokens made from hash id i (a last partial block from as many tokens as it holds), so equal hash-id prefixes
are equal token prefixes; as in any engine only full blocks are cached and the prompt's last token is always
computed (before this simulator a Mooncake replay counted a hit on the last partial block too).

The router sees each replica through a gateway's real `FleetBook` (sim.gateway). With one gateway, or G
gateways (requests dealt round-robin by arrival) and `shared_view`, every gateway reads one fleet KV index fed
by the block pools' KV events and the replicas' running + waiting, both published at the end of every step,
as through Redis; without it each gateway sees only its own decisions: its own in-flight counts and a
`LearnedKVIndex`. Two yardsticks are printed with every replay: the ideal (one unlimited cache, in arrival
order, no routing: a lower bound) and the bounded oracle (sim.oracle: exact caches, longest prefix under
a request-count bound; a yardstick a good router can beat, not an optimum), which runs with every replay
through one gateway with the exact fleet index.
"""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from gateway.flow_control.config import FlowControlConfig
from gateway.routing.router import POLICY_NAMES, RouteRequest, RoutingPolicy, make_policy
from kvroute.hashing import BlockHash, block_hashes, extend_block_hashes
from kvroute.prefix import common_prefix_length
from sim import FleetConfig, FleetRun, FleetSim, SimRequest, ViewTiming
from sim.oracle import BoundedOracle
from sim.traces import Trace, TraceRequest
from worker.sim_runner import SimCostModel

REPLAY_MODEL_ID = "replay"
ORACLE = BoundedOracle.name
REPLAY_POLICIES = (*POLICY_NAMES, ORACLE)


class ReplayError(ValueError):
    """A configuration or trace the replay cannot run (bad sizes, a request larger than a replica)."""


@dataclass(frozen=True)
class ReplayConfig:
    replicas: int = 4
    policies: tuple[str, ...] = ("round_robin", "prefix", "kv_aware")
    capacity_blocks: int = 10_000
    gateways: int = 1
    shared_view: bool = False
    prefill_us_per_token: float = 32.0
    decode_ms_per_step: float = 20.0
    epsilon: float = 0.5
    min_in_flight: int = 3
    seed: int = 0
    progress: bool = False
    # The replicas' names (default replica-0, replica-1, ...): a live fleet's worker ids put the replay's
    # hash ring where the gateway's is, so a session's key has the same owner in both.
    replica_names: tuple[str, ...] | None = None
    # The model id block hashes are computed with: a live fleet's (e.g. "sim-v1") gives the gateway's very
    # hashes, hence its ring keys; a salt is the trace request's, as the gateway would compute it.
    model_id: str = REPLAY_MODEL_ID
    # Seconds between a gateway's reads of the replicas' KV events and load (sim.gateway.ViewTiming.poll_s):
    # 0 reads them at the end of every step; a live embedded gateway polls each worker every 0.1 s.
    view_poll_s: float = 0.0
    # How a live embedded gateway's polls go (sim.gateway.ViewTiming.poll_each, poll_draw, seed): one poller
    # per worker, each interval drawn from the gateway's measured histogram.
    view_poll_each: bool = False
    view_poll_draw: tuple[tuple[float, float, float], ...] = ()
    view_seed: int = 0
    jobs: int = 1  # runs (policy, one-gateway, oracle) simulated at once, one process each
    # Time each replica step takes beyond the cost model (a live fleet's measured step period less the model's).
    step_overhead_ms: float = 0.0
    # Each replica's host KV tier (worker/host_kv_tier.py), in blocks (0: none), and a block's copy either way.
    host_kv_blocks: int = 0
    host_copy_us_per_block: float = 67.0
    # The gateways' flow control (the gateway's `--flow-control on`): requests wait in the gateway, by band and
    # tenant (the trace's), until a replica can admit them, as `flow_settings` says.
    flow_control: bool = False
    # The routing config's `flow_control`: the queue's settings when it is on, each band's SLO either way.
    flow_settings: FlowControlConfig = field(default_factory=FlowControlConfig)

    def __post_init__(self) -> None:
        for name in ("replicas", "capacity_blocks", "gateways", "min_in_flight", "jobs"):
            if getattr(self, name) < 1:
                raise ReplayError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replica_names is not None and (
            len(self.replica_names) != self.replicas or len(set(self.replica_names)) != self.replicas
        ):
            raise ReplayError(f"replica_names must be {self.replicas} distinct names, got {list(self.replica_names)}")
        names = ("prefill_us_per_token", "decode_ms_per_step", "epsilon", "view_poll_s", "step_overhead_ms")
        for name in (*names, "host_kv_blocks", "host_copy_us_per_block"):
            if getattr(self, name) < 0:
                raise ReplayError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.policies:
            raise ReplayError("no policies given")
        for policy in self.policies:
            if policy not in REPLAY_POLICIES:
                raise ReplayError(f"unknown policy {policy!r}; choose from {', '.join(REPLAY_POLICIES)}")

    @property
    def policy_options(self) -> dict[str, float | int]:
        return {"epsilon": self.epsilon, "min_in_flight": self.min_in_flight, "seed": self.seed}


def make_replay_policy(name: str, config: ReplayConfig) -> RoutingPolicy:
    """A fresh policy: the router's by name, or the replay's bounded oracle."""
    if name == ORACLE:
        return BoundedOracle()
    return make_policy(name, **config.policy_options)


@dataclass
class PolicyResult:
    policy: str
    prefill_tokens: int
    hit_rate: float
    load_imbalance: float  # busy time, max / mean
    busy_min_share: float  # busy time, min / mean
    ttft_ms: dict[str, float]
    per_replica_requests: list[int]
    per_replica_busy_s: list[float]
    reasons: dict[str, int]
    cached_tokens: list[int] = field(repr=False)  # per request, in trace order
    replica_of: list[int] = field(repr=False)  # per request: the replica's index
    reason_of: list[str] = field(repr=False)  # per request: the routing decision's reason
    matched_of: list[int] = field(repr=False)  # per request: the blocks the pick found on its replica
    ttft_samples_ms: list[float] = field(repr=False)
    queue_samples_ms: list[float] = field(repr=False)  # per request: at the engine to first scheduled
    prefill_samples_ms: list[float] = field(repr=False)  # per request: first scheduled to first token
    # per request of 2 or more output tokens (None for the others): the time per output token after the first
    tpot_samples_ms: list[float | None] = field(repr=False)
    steps: int = 0  # engine steps, all replicas
    preemptions: int = 0  # all replicas
    vs_one_gateway: float | None = None  # relative hit-rate loss against one gateway (G > 1 only)
    bands: dict[int, BandResult] = field(default_factory=dict)  # per band (priority), most urgent first
    shed_of: list[str] = field(default_factory=list, repr=False)  # per request: why flow control shed it, or ""
    status_of: list[int] = field(default_factory=list, repr=False)  # per request: the HTTP status of a shed one
    gateway_wait_samples_ms: list[float] = field(default_factory=list, repr=False)  # per request: in the queue
    e2e_samples_ms: list[float] = field(default_factory=list, repr=False)  # per request: arrival to finish (NaN: shed)

    def to_json(self) -> dict:
        out = {
            "prefill_tokens": self.prefill_tokens,
            "hit_rate": round(self.hit_rate, 6),
            "load_imbalance": round(self.load_imbalance, 4),
            "busy_min_share": round(self.busy_min_share, 4),
            "ttft_ms": {k: round(v, 3) for k, v in self.ttft_ms.items()},
            "per_replica_requests": self.per_replica_requests,
            "per_replica_busy_s": [round(b, 3) for b in self.per_replica_busy_s],
            "reasons": self.reasons,
        }
        if self.vs_one_gateway is not None:
            out["vs_one_gateway"] = round(self.vs_one_gateway, 6)
        out["bands"] = {str(band): figures.to_json() for band, figures in self.bands.items()}
        return out


@dataclass
class BandResult:
    """One band's requests as its clients saw them: how many, how many were served and met the band's SLO (the
    routing config's `flow_control` slo; a shed request does not; with no SLO, every served one does), its TTFT
    and its time queued in the gateway (percentiles over the served; ms), and flow control's sheds and dispatches
    by reason."""

    requests: int
    served: int
    goodput: float
    ttft_ms: dict[str, float]
    gateway_wait_ms: dict[str, float]
    sheds: dict[str, int]
    dispatches: dict[str, int]

    def to_json(self) -> dict:
        return {
            "requests": self.requests,
            "served": self.served,
            "goodput": round(self.goodput, 6),
            "ttft_ms": {k: round(v, 3) for k, v in self.ttft_ms.items()},
            "gateway_wait_ms": {k: round(v, 3) for k, v in self.gateway_wait_ms.items()},
            "sheds": self.sheds,
            "dispatches": self.dispatches,
        }


@dataclass(frozen=True)
class Divergence:
    """Where each request first differs from the previous request of its session (or app)."""

    unit: str  # "tokens" or "blocks"
    first_of_session: int
    buckets: dict[str, int]  # "lo-hi" (inclusive) -> requests

    def to_json(self) -> dict:
        return {"unit": self.unit, "first_of_session": self.first_of_session, "buckets": self.buckets}


@dataclass
class ReplayResult:
    trace: str
    requests: int
    input_tokens: int
    config: ReplayConfig
    ideal_prefill_tokens: int
    policies: dict[str, PolicyResult]
    divergence: Divergence

    @property
    def ideal_hit_rate(self) -> float:
        return 1 - self.ideal_prefill_tokens / self.input_tokens

    @property
    def oracle_prefill_tokens(self) -> int:
        return self.policies[ORACLE].prefill_tokens

    def to_json(self) -> dict:
        return {
            "trace": self.trace,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "replicas": self.config.replicas,
            "capacity_blocks": self.config.capacity_blocks,
            "gateways": self.config.gateways,
            "shared_view": self.config.shared_view,
            "prefill_us_per_token": self.config.prefill_us_per_token,
            "decode_ms_per_step": self.config.decode_ms_per_step,
            "host_kv_blocks": self.config.host_kv_blocks,
            "host_copy_us_per_block": self.config.host_copy_us_per_block,
            "flow_control": self.config.flow_control,
            "ideal": {"prefill_tokens": self.ideal_prefill_tokens, "hit_rate": round(self.ideal_hit_rate, 6)},
            "policies": {name: result.to_json() for name, result in self.policies.items()},
            "first_divergence": self.divergence.to_json(),
        }


# -- the trace, prepared once for every policy --------------------------------------------------


@dataclass(frozen=True)
class _Prepared:
    index: int
    arrival_ms: float
    input_length: int
    output_length: int
    route: RouteRequest
    usable_blocks: int  # how many leading blocks a cache hit may cover
    kv_tokens: int  # prompt + max_tokens: what the engine requires a replica's cache to hold
    finish_keys: Sequence  # keys of every full block at finish (prompt + known answer)
    session: str
    band: int
    # The gateway's hashes of the prompt's tokens (Mooncake: of the tokens made from its hash ids, not the ids),
    # hashed once here rather than once per policy run.
    prompt_hashes: Sequence[BlockHash]


def _prepare(trace: Trace, model_id: str = REPLAY_MODEL_ID) -> list[_Prepared]:
    out = []
    for i, req in enumerate(trace.requests):
        if trace.kind == "mooncake":
            keys: Sequence = req.hash_ids
            usable = len(keys)
            finish_keys = keys
            kv_tokens = req.input_length + max(req.output_length, 1)
            session = str(keys[min(1, len(keys) - 1)])
            prompt = _mooncake_prompt(req.hash_ids, req.input_length, trace.block_size)()
            prompt_hashes = block_hashes(prompt, model_id=model_id, block_size=trace.block_size)
        else:
            keys = block_hashes(
                req.token_ids, model_id=model_id, cache_salt=req.cache_salt, block_size=trace.block_size
            )
            usable = (req.input_length - 1) // trace.block_size
            finish_keys = keys + _answer_hashes(req, keys, trace.block_size, model_id)
            kv_tokens = req.input_length + max(req.output_length, 1)
            session = req.session_id if req.session_id is not None else f"request-{i}"
            prompt_hashes = keys
        route = RouteRequest(f"req-{i}", keys, req.input_length, req.session_id)
        out.append(
            _Prepared(
                i,
                req.arrival_ms,
                req.input_length,
                req.output_length,
                route,
                usable,
                kv_tokens,
                finish_keys,
                session,
                req.band,
                prompt_hashes,
            )
        )
    return out


def _answer_hashes(req: TraceRequest, prompt_keys: list, block_size: int, model_id: str) -> list:
    if not req.output_token_ids:
        return []
    # Only the answer's first output_length - 1 tokens get KV (the last sampled token is never fed back).
    kv_tokens = (req.token_ids + req.output_token_ids)[: req.input_length + max(req.output_length - 1, 0)]
    parent = prompt_keys[-1] if prompt_keys else None
    tail = kv_tokens[len(prompt_keys) * block_size :]
    if parent is None:
        return block_hashes(tail, model_id=model_id, cache_salt=req.cache_salt, block_size=block_size)
    return extend_block_hashes(parent, tail, block_size)


def _cached_tokens(prepared: _Prepared, matched_blocks: int, block_size: int) -> int:
    return min(matched_blocks * block_size, prepared.input_length)


def ideal_prefill_tokens(trace: Trace, model_id: str = REPLAY_MODEL_ID) -> int:
    """Prefill tokens of `trace` with one unlimited cache, requests in arrival order, no routing (the ideal)."""
    return _ideal_prefill_tokens(_prepare(trace, model_id), trace.block_size)


def _ideal_prefill_tokens(prepared: Sequence[_Prepared], block_size: int) -> int:
    seen: set = set()
    total = 0
    for p in prepared:
        depth = 0
        keys = p.route.block_hashes
        while depth < p.usable_blocks and keys[depth] in seen:
            depth += 1
        total += p.input_length - _cached_tokens(p, depth, block_size)
        seen.update(p.finish_keys)
    return total


# -- the simulated fleet --------------------------------------------------------------------------


def _mooncake_prompt(hash_ids: Sequence[int], num_tokens: int, block_size: int) -> Callable[[], list[int]]:
    def prompt() -> list[int]:
        tokens = [0] * (len(hash_ids) * block_size)
        tokens[::block_size] = [h % 2**31 for h in hash_ids]
        del tokens[num_tokens:]
        return tokens

    return prompt


def _sim_requests(trace: Trace, prepared: list[_Prepared]) -> list[SimRequest]:
    out = []
    for p, req in zip(prepared, trace.requests, strict=True):
        if trace.kind == "mooncake":
            prompt = _mooncake_prompt(req.hash_ids, req.input_length, trace.block_size)
            out.append(
                SimRequest(
                    p.arrival_ms / 1e3, prompt, p.input_length, p.output_length,
                    block_hashes=p.prompt_hashes, tenant=req.tenant, weight=req.weight, band=req.band,
                )
            )  # fmt: skip
        else:
            ids = req.token_ids
            out.append(
                SimRequest(
                    p.arrival_ms / 1e3, functools.partial(list, ids), p.input_length, p.output_length,
                    answer=req.output_token_ids or (), cache_salt=req.cache_salt, session_id=req.session_id,
                    block_hashes=p.prompt_hashes, tenant=req.tenant, weight=req.weight, band=req.band,
                )
            )  # fmt: skip
    return out


def replica_names(config: ReplayConfig) -> tuple[str, ...]:
    width = len(str(config.replicas - 1))
    return config.replica_names or tuple(f"replica-{i:0{width}d}" for i in range(config.replicas))


def fleet_config(trace: Trace, config: ReplayConfig, timing: ViewTiming) -> FleetConfig:
    return FleetConfig(
        replicas=replica_names(config),
        capacity_blocks=config.capacity_blocks,
        block_size=trace.block_size,
        model_id=config.model_id,
        cost=SimCostModel(config.prefill_us_per_token, config.decode_ms_per_step, config.host_copy_us_per_block),
        timing=timing,
        step_overhead_s=config.step_overhead_ms * 1e-3,
        host_kv_blocks=config.host_kv_blocks,
        flow_control=config.flow_settings if config.flow_control else None,
    )


class Simulation(NamedTuple):
    """One policy's finished run: the fleet (its replicas' engines and gateways' books stay readable) and what
    it recorded."""

    fleet: FleetSim
    run: FleetRun


def _simulate(
    trace: Trace, prepared: list[_Prepared], policy: str, gateways: int, shared: bool, config: ReplayConfig, tick
) -> Simulation:
    if shared or gateways == 1:
        # One index read by every gateway as the replicas publish; with a poll interval each gateway's own books.
        index = "books" if config.view_poll_s > 0 else "shared"
        timing = ViewTiming(
            index=index, load="reported", poll_s=config.view_poll_s, poll_each=config.view_poll_each,
            poll_draw=config.view_poll_draw, seed=config.view_seed,
        )  # fmt: skip
    else:
        timing = ViewTiming(index="private", load="own")
    fleet = FleetSim(fleet_config(trace, config, timing), [make_replay_policy(policy, config) for _ in range(gateways)])
    # The replicas are sorted by name (a FleetView's order); the results keep the configured order.
    return Simulation(fleet, fleet.run(_sim_requests(trace, prepared), tick))


def _result(policy: str, prepared: list[_Prepared], sim: Simulation, config: ReplayConfig) -> PolicyResult:
    run = sim.run
    order = [run.replicas.index(name) for name in replica_names(config)]
    position = {r: i for i, r in enumerate(order)}
    input_tokens = sum(p.input_length for p in prepared)
    cached = sum(run.cached_tokens)
    busy = [run.busy_s[r] for r in order]
    mean_busy = sum(busy) / len(busy)
    ttft_ms = [t * 1e3 for t in run.ttft_s]  # NaN for a request flow control shed
    served_ttft_ms = [t for t, shed in zip(ttft_ms, run.shed, strict=True) if not shed]
    tpot_ms = [
        (finish - p.arrival_ms / 1e3 - ttft) * 1e3 / (p.output_length - 1) if p.output_length > 1 and not shed else None
        for p, ttft, finish, shed in zip(prepared, run.ttft_s, run.finish_s, run.shed, strict=True)
    ]
    return PolicyResult(
        policy=policy,
        prefill_tokens=input_tokens - cached,
        hit_rate=cached / input_tokens,
        load_imbalance=max(busy) / mean_busy if mean_busy > 0 else 1.0,
        busy_min_share=min(busy) / mean_busy if mean_busy > 0 else 1.0,
        ttft_ms=_percentiles(served_ttft_ms, (50, 90, 99)),
        per_replica_requests=[run.requests_per_replica[r] for r in order],
        per_replica_busy_s=busy,
        reasons=run.reason_counts,
        cached_tokens=run.cached_tokens,
        replica_of=[position[r] for r in run.replica_of],
        reason_of=run.reasons,
        matched_of=run.matched_blocks,
        ttft_samples_ms=ttft_ms,
        queue_samples_ms=[t * 1e3 for t in run.queue_s],
        prefill_samples_ms=[t * 1e3 for t in run.prefill_s],
        tpot_samples_ms=tpot_ms,
        steps=sum(run.steps),
        preemptions=sum(run.preemptions),
        bands=_bands(prepared, run, ttft_ms, tpot_ms, config.flow_settings),
        shed_of=run.shed,
        status_of=run.status,
        gateway_wait_samples_ms=[t * 1e3 for t in run.gateway_wait_s],
        e2e_samples_ms=[(f - p.arrival_ms / 1e3) * 1e3 for p, f in zip(prepared, run.finish_s, strict=True)],
    )


def _percentiles(samples: Sequence[float], qs: Sequence[int]) -> dict[str, float]:
    """`numpy.percentile` of each q (NaN with no samples: every request of a band shed)."""
    return {f"p{q}": float(np.percentile(samples, q)) if samples else float("nan") for q in qs}


def _bands(
    prepared: list[_Prepared],
    run: FleetRun,
    ttft_ms: list[float],
    tpot_ms: list[float | None],
    settings: FlowControlConfig,
) -> dict[int, BandResult]:
    """Per band: BandResult's figures, each request judged by its band's SLO in `settings`."""
    out = {}
    for band in sorted({p.band for p in prepared}):
        mine = [i for i, p in enumerate(prepared) if p.band == band]
        served = [i for i in mine if not run.shed[i]]
        slo = settings.band(band).slo
        met = 0
        for i in served:
            tpot = tpot_ms[i]
            e2e_s = run.finish_s[i] - prepared[i].arrival_ms / 1e3
            met += slo.met(ttft_ms[i] / 1e3, None if tpot is None else tpot / 1e3, e2e_s)
        dispatched = Counter(run.dispatch_reasons[i] for i in served if run.dispatch_reasons[i])
        out[band] = BandResult(
            requests=len(mine),
            served=len(served),
            goodput=met / len(mine),
            ttft_ms=_percentiles([ttft_ms[i] for i in served], (50, 99)),
            gateway_wait_ms=_percentiles([run.gateway_wait_s[i] * 1e3 for i in served], (50, 99)),
            sheds=dict(sorted(Counter(run.shed[i] for i in mine if run.shed[i]).items())),
            dispatches=dict(sorted(dispatched.items())),
        )
    return out


# -- the public API -------------------------------------------------------------------------------


def replay(trace: Trace, config: ReplayConfig) -> ReplayResult:
    """Replay `trace` once per policy (and, with G > 1 gateways, once more with one gateway), and once
    with the bounded oracle (one gateway) whether or not it is among the policies; it is the last result.
    `config.jobs` > 1 runs them in that many processes at once (the same results)."""
    prepared = _prepare(trace, config.model_id)
    _check_fits(trace, prepared, config)
    policies = [p for p in config.policies if p != ORACLE]
    runs = [(policy, config.gateways, config.shared_view) for policy in policies]
    if config.gateways > 1:
        runs += [(policy, 1, True) for policy in policies]
    runs.append((ORACLE, 1, True))
    with _progress(len(prepared) * len(runs), config.progress) as bar:
        if config.jobs > 1:
            # Each run is independent; a run ticks the bar when done. Spawned, not forked: a fork of a process
            # that holds gRPC's or torch's threads can crash in the child (it did under pytest in CI).
            context = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(min(config.jobs, len(runs)), mp_context=context) as pool:
                futures = [pool.submit(_run, trace, prepared, *run, config, _NoBar()) for run in runs]
                for _ in concurrent.futures.as_completed(futures):
                    bar.update(len(prepared))
                done = [future.result() for future in futures]
        else:
            done = [_run(trace, prepared, *run, config, bar) for run in runs]
    results = dict(zip(policies, done, strict=False))
    for policy, one in zip(
        policies, done[len(policies) : 2 * len(policies)] if config.gateways > 1 else (), strict=False
    ):
        loss = (one.hit_rate - results[policy].hit_rate) / one.hit_rate if one.hit_rate else 0.0
        results[policy].vs_one_gateway = loss
    results[ORACLE] = done[-1]
    return ReplayResult(
        trace=trace.name,
        requests=len(prepared),
        input_tokens=trace.input_tokens,
        config=config,
        ideal_prefill_tokens=_ideal_prefill_tokens(prepared, trace.block_size),
        policies=results,
        divergence=first_divergence(trace),
    )


def _run(
    trace: Trace, prepared: list[_Prepared], policy: str, gateways: int, shared: bool, config: ReplayConfig, bar
) -> PolicyResult:
    sim = _simulate(trace, prepared, policy, gateways, shared, config, bar.update)
    return _result(policy, prepared, sim, config)


def simulate(trace: Trace, policy: str, config: ReplayConfig) -> tuple[Simulation, PolicyResult]:
    """Run one policy through `config.gateways` gateways, each seeing the shared view or only its own decisions
    as `config.shared_view` says (one gateway: always the shared view): the finished simulation and its result.
    Unlike `replay`, no other run (one gateway, the oracle) is added."""
    prepared = _prepare(trace, config.model_id)
    _check_fits(trace, prepared, config)
    sim = _simulate(trace, prepared, policy, config.gateways, config.shared_view, config, lambda: None)
    return sim, _result(policy, prepared, sim, config)


def _check_fits(trace: Trace, prepared: list[_Prepared], config: ReplayConfig) -> None:
    for p in prepared:
        need = -(-p.kv_tokens // trace.block_size)
        if need > config.capacity_blocks:
            raise ReplayError(
                f"request {p.index + 1} needs {need} KV blocks of {trace.block_size} tokens, "
                f"more than --capacity-blocks {config.capacity_blocks}"
            )


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="replay", leave=False, mininterval=0.5, disable=None)


def first_divergence(trace: Trace) -> Divergence:
    """Histogram of the position (tokens, or blocks for Mooncake) where each request first differs
    from the previous request of its session (Mooncake: of its conversation, the first two blocks)."""
    mooncake = trace.kind == "mooncake"
    last: dict[str, tuple[int, ...]] = {}
    buckets: Counter[tuple[int, int]] = Counter()
    first = 0
    for i, req in enumerate(trace.requests):
        seq = req.hash_ids if mooncake else req.token_ids
        if mooncake:
            session = str(seq[min(1, len(seq) - 1)])
        else:
            session = req.session_id if req.session_id is not None else f"request-{i}"
        previous = last.get(session)
        last[session] = seq
        if previous is None:
            first += 1
            continue
        buckets[_bucket(common_prefix_length(previous, seq))] += 1
    labels = {f"{lo}-{hi}": buckets[(lo, hi)] for lo, hi in sorted(buckets)}
    return Divergence("blocks" if mooncake else "tokens", first, labels)


def _bucket(position: int) -> tuple[int, int]:
    if position == 0:
        return (0, 0)
    lo = 1 << (position.bit_length() - 1)
    return (lo, 2 * lo - 1)
