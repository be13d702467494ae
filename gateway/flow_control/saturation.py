"""Whether a worker can admit a request now, from its own signals in the fleet view (gateway.routing.fleet_view
ReplicaLoad): a kvroute worker's waiting count, block count and KV usage (GetStats or its Redis record); a vLLM
or SGLang engine's `num_requests_waiting` and KV-cache usage (gateway.fleet.engine_fleet).

A worker is dispatchable for a request when
  1. it is idle (its last report showed nothing in it, and nothing was granted to it since): it takes anything,
     so no request is too big to ever start;
  2. or fewer than `max_worker_waiting` requests wait in it (reported, plus those granted to it and not yet
     sent), and
       - fewer than `max_worker_staged` (1) wait in it or are on their way (reported waiting, plus this gateway's
         grants without a first token): the request is staged there, to start the moment room frees, not a
         report later (the report's delay was most of flow control's cost at light load; one staged request
         per worker bounds what its wait can lose);
       - or
       - with a block count: its free blocks (not held by a running request: cached ones are reusable), less
         the blocks of this gateway's grants its report cannot show yet (`pending_blocks`), cover the request's
         need: its prompt blocks the worker does not hold plus a decode reserve (min(max_tokens,
         decode_reserve_tokens) tokens);
       - without one (an HTTP engine): its KV-cache usage is under `max_kv_usage`.
A worker that schedules by priority (`--scheduling-policy priority`: it reports `priorities`, ReplicaLoad) puts a
request of priority p ahead of its less urgent waiting requests and admits it by preempting less urgent running
ones; so for such a request (`priority` given) the waiting count is of the requests at p or more urgent, and the
free blocks include those its less urgent running requests hold (what preempting them frees, as it reports).
A grant's blocks count until the second report after its first token (the worker had admitted it by then), so a
burst between two reports cannot overfill a worker; what finished since is not credited until the next report
(the worker's word), nor is a worker idle before its report says so: room a gateway frees by its own request's
end is then offered to every gateway at once, not refilled by that gateway alone (which starved the others'
queues: tests/test_flow_control_gateway.py, two gateways).
"""

from __future__ import annotations

import math

from gateway.flow_control.config import FlowControlConfig
from gateway.routing.fleet_view import ReplicaLoad


def blocks_needed(prompt_blocks: int, matched_blocks: int, max_tokens: int, block_size: int, reserve: int) -> int:
    """The request's prompt blocks the worker does not hold, plus its decode reserve."""
    return prompt_blocks - matched_blocks + math.ceil(min(max_tokens, reserve) / block_size)


def dispatchable(
    load: ReplicaLoad,
    unsent: int,
    pending_blocks: int,
    unstarted: int,
    needed_blocks: int,
    config: FlowControlConfig,
    priority: int | None = None,
) -> bool:
    """The module docstring's rule for one worker and one request needing `needed_blocks` blocks there; `unsent`:
    requests granted to it and not sent yet; `unstarted`: granted to it and without a first token yet;
    `priority`: the request's (None: counted as on a fcfs worker)."""
    if load.busy_reported == 0 and unsent == 0:
        return True
    behind = [share for share in load.priorities if share.priority > priority] if priority is not None else []
    waiting_ahead = max(load.queued - sum(share.waiting for share in behind), 0)
    if waiting_ahead + unsent >= config.max_worker_waiting:
        return False
    if waiting_ahead + unstarted < config.max_worker_staged:
        return True
    if load.num_blocks:
        used = round(load.num_blocks * load.kv_usage)  # usage is used / total as the worker computed it
        reclaimable = sum(share.running_blocks for share in behind)
        return needed_blocks <= load.num_blocks - used - pending_blocks + reclaimable
    return load.kv_usage < config.max_kv_usage
