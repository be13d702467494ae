"""Exercise 02: how many prefill tokens does prefix-aware routing save across 4 replicas?

Multi-turn chats (a 1,000-token system prompt, 100-token questions, 300-token answers) go through 4
simulated replicas, each a real block manager, once behind round-robin and once behind prefix-aware
routing. Round-robin sends each turn of a chat to another replica, so 3 turns in 4 recompute the
chat's history; the prefix ring keeps a chat on one replica.

    .venv/bin/python exercises/02_prefill_tokens.py
"""

from sim.replay import ReplayConfig, replay
from sim.workloads import generate

trace = generate("multiturn", requests=120, seed=0)
result = replay(trace, ReplayConfig(replicas=4, policies=("round_robin", "prefix", "kv_aware")))

print(f"{trace.name}: {len(trace.requests)} requests, {trace.input_tokens:,} prompt tokens, 4 replicas")
for name, policy in result.policies.items():
    print(f"  {name:<12} {policy.prefill_tokens:>9,} prefill tokens  (hit rate {policy.hit_rate:.1%})")
print(f"  {'ideal':<12} {result.ideal_prefill_tokens:>9,} prefill tokens  (one unlimited cache)")
saved = result.policies["round_robin"].prefill_tokens - result.policies["prefix"].prefill_tokens
print(f"prefix routing saves {saved:,} prefill tokens against round-robin")
