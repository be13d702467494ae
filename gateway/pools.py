"""Several models behind one gateway: a fleet is a set of pools, one per served model (docs/gateway.md).

A pool is one `gateway.request_path.RequestPath`: its model, tokenizer, block size, fleet state, policy and
workers, so each is routed on its own KV index and its own hashes. `Pools` holds them by served model name and
answers the front doors as one request path does (`pool(model)`, `pools()`, `generate`, readiness, the
drain), picking the pool by the request's `model`:

    model given, a pool serves it    that pool
    model given, no pool serves it   ModelNotFound (404), the name quoted (gateway.errors.quoted)
    no model, one pool               that pool
    no model, several pools          InvalidRequestError (400) naming `model`

What the pools share is built once and handed to each: the Authenticator (one set of keys and tenants) and
the tenants' concurrency (a tenant's limit counts its requests to every model). Each pool's metrics are its
view of the gateway's one registry (`GatewayMetrics.for_model`: the series vLLM labels with `model_name` carry
the pool's name); `metrics` here is the first pool's, where the front doors count what they refuse before a
pool is known. `kvroute gateway` and `kvroute epp` build the pools from `--routing-config`
(gateway.cli_gateway.pool_configs).

Readiness: ready while any pool has a routable worker, so a model whose workers are all gone answers 503 for
its own requests and takes no other model down with it (a load balancer would otherwise eject the gateway).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

from gateway.admission.auth import Authenticator
from gateway.errors import InvalidRequestError, ModelNotFound, quoted
from gateway.fleet.fleet_state import FleetIdentity, WorkerMember
from gateway.metrics import GatewayMetrics
from gateway.request import GatewayRequest, Generation, TokenizeResult
from gateway.request_path import RequestPath
from gateway.worker_spec import WorkerSpec

Resolver = Callable[[str, int], set[tuple[str, int]]]


class Pools:
    """The pools of one gateway by served model name, behind the front doors' interface.

    Contract: every pool was built with this gateway's one Authenticator and one TenantConcurrency, and served
    model names are distinct (ValueError otherwise). `auth` set here is set on every pool (a SIGHUP reload)."""

    def __init__(self, pools: Sequence[RequestPath]) -> None:
        if not pools:
            raise ValueError("a gateway needs at least one pool")
        self._pools: dict[str, RequestPath] = {}  # by each served name, aliases included
        for path in pools:
            for name in path.served_model_names:
                if name in self._pools:
                    raise ValueError(f"two pools serve the model {quoted(name)}")
                self._pools[name] = path
            if path.auth is not pools[0].auth or path.concurrency is not pools[0].concurrency:
                raise ValueError("the pools of one gateway share one Authenticator and one TenantConcurrency")
        self._paths = list(pools)
        self.metrics: GatewayMetrics = pools[0].metrics

    # -- picking a pool -------------------------------------------------------------------------------------

    def pool(self, model: str | None) -> RequestPath:
        """The pool serving `model`; raises ModelNotFound (404), or InvalidRequestError (400) when no model is
        named and several are served."""
        if model is None:
            if len(self._paths) == 1:
                return self._paths[0]
            names = ", ".join(sorted(path.served_model_name for path in self._paths))
            raise InvalidRequestError(f"is required: this gateway serves several models ({names})", param="model")
        path = self._pools.get(model)
        if path is None:
            raise ModelNotFound(f"the model {quoted(model)} does not exist", param="model")
        return path

    def pools(self) -> list[RequestPath]:
        return list(self._paths)

    async def generate(self, request: GatewayRequest) -> Generation:
        return await self.pool(request.model).generate(request)

    async def tokenize(self, request: GatewayRequest) -> TokenizeResult:
        return await self.pool(request.model).tokenize(request)

    async def detokenize(self, api_key: str | None, model: str | None, token_ids: list[int]) -> str:
        return await self.pool(model).detokenize(api_key, model, token_ids)

    # -- what one request path would answer, for the only pool ----------------------------------------------

    @property
    def served_model_name(self) -> str:
        return ", ".join(path.served_model_name for path in self._paths)

    @property
    def auth(self) -> Authenticator:
        return self.pools()[0].auth

    @auth.setter
    def auth(self, auth: Authenticator) -> None:
        for path in self._paths:
            path.auth = auth

    @property
    def identity(self) -> FleetIdentity:
        return self.pool(None).identity

    @property
    def vocab_size(self) -> int:
        return self.pool(None).vocab_size

    @property
    def active(self) -> int:
        return sum(path.active for path in self._paths)

    # -- health and shutdown --------------------------------------------------------------------------------

    def routable_workers(self) -> int:
        return sum(path.routable_workers() for path in self._paths)

    def ready(self) -> bool:
        """Any pool has a routable worker (see the module docstring)."""
        return any(path.ready() for path in self._paths)

    def members(self) -> list[WorkerMember]:
        return [member for path in self._paths for member in path.members()]

    def start_draining(self) -> None:
        for path in self._paths:
            path.start_draining()

    async def wait_drained(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        drained = True
        for path in self._paths:
            drained = await path.wait_drained(max(0.0, deadline - time.monotonic())) and drained
        return drained

    def end_streams(self, message: str) -> int:
        return sum(path.end_streams(message) for path in self._paths)

    async def close(self) -> None:
        for path in self._paths:
            await path.close()


def resolved_endpoints(host: str, port: int) -> set[tuple[str, int]]:
    """Every (address, port) `host:port` reaches over TCP; a host that does not resolve is its own spelling."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return {(host.lower(), port)}
    return {(str(info[4][0]), port) for info in infos}


def check_one_worker_once(pools: Sequence[Sequence[WorkerSpec]], resolve: Resolver = resolved_endpoints) -> None:
    """Refuse a worker listed twice, in one pool or in two, however its address is spelled: two specs are one
    worker when their hosts resolve to a common address on the same port (`127.0.0.1:P` and `localhost:P`).
    A worker in two pools would serve both models' requests and be scored on both indexes. Raises ValueError
    naming both spellings and the address they share."""
    seen: dict[tuple[str, int], tuple[int, WorkerSpec]] = {}
    for number, specs in enumerate(pools, 1):
        for spec in specs:
            for endpoint in sorted(resolve(spec.host, spec.port)):
                other = seen.setdefault(endpoint, (number, spec))
                if other == (number, spec):
                    continue
                where = f"in pool {other[0]} and pool {number}" if other[0] != number else "twice in one pool"
                raise ValueError(
                    f"worker {other[1].engine}://{other[1].address} and {spec.engine}://{spec.address} are one "
                    f"worker (both reach {endpoint[0]}:{endpoint[1]}), {where}: list each worker once"
                )
