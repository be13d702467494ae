"""The README's main job (`make run`): a local fleet of SmolLM2 workers behind the gateway answers a chat
request in real words, says where it routed it, finds the prompt cached on a repeat, and stops.

    python -m launch.demo [--workers 2] [--model smollm2]

Step by step, what a user would do by hand:
  1. `kvroute up --workers 2 --model smollm2` starts the workers and the gateway (one process group);
  2. POST /v1/chat/completions to the gateway, twice with the same question: the answer, the worker
     (`x-kvroute-worker`), the routing decision (`x-kvroute-route`) and the prompt tokens served from the
     worker's prefix cache (`usage.prompt_tokens_details.cached_tokens`);
  3. Ctrl-C (SIGINT) to `kvroute up`, which stops every child.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import httpx

from launch.fleet import free_port, kvroute_argv

QUESTION = "What is the capital of France? Answer in one sentence."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args(argv)

    port = free_port()
    print(f"$ kvroute up --workers {args.workers} --model {args.model} --http-port {port}", flush=True)
    up = subprocess.Popen(
        kvroute_argv("up", "--workers", str(args.workers), "--model", args.model, "--http-port", str(port),
                     "--grpc-port", "0"),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in up.stdout:  # type: ignore[union-attr]
            print(f"  {line}", end="", flush=True)
            if "Ctrl-C stops them all" in line:
                break
        else:
            print("kvroute up exited before the fleet was ready", file=sys.stderr)
            return 1
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=300) as client:
            for attempt in ("first", "repeat"):
                response = client.post(
                    "/chat/completions",
                    json={
                        "model": args.model,
                        "messages": [{"role": "user", "content": QUESTION}],
                        "max_tokens": 48,
                        "temperature": 0,
                    },
                )
                response.raise_for_status()
                body = response.json()
                usage = body["usage"]
                print(f"\n{attempt} request: {QUESTION!r}")
                print(f"  answer:        {body['choices'][0]['message']['content'].strip()!r}")
                print(f"  routed to:     {response.headers['x-kvroute-worker']}")
                print(f"  route:         {response.headers['x-kvroute-route']}")
                print(
                    f"  prompt tokens: {usage['prompt_tokens']}, of them cached: "
                    f"{usage['prompt_tokens_details']['cached_tokens']}",
                    flush=True,
                )
    finally:
        print("\n$ kill -INT <kvroute up>   # Ctrl-C", flush=True)
        up.send_signal(signal.SIGINT)
        for line in up.stdout:  # type: ignore[union-attr]
            print(f"  {line}", end="")
        up.wait()
    print(f"kvroute up exited with status {up.returncode}; no worker is left running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
