"""What the Ray Serve path costs over plain `mmkit serve` on one machine.

Starts each server as a user does (`mmkit serve ...`, then `... --ray-serve`), on the embedded
model, and times, in the same run: `GET /v1/models` (the path's own cost: no engine work;
median of 20), one chat request at a time (median latency of 10) and
`--requests` concurrent chats (half with an image; wall time, `--runs` times per start), each
configuration started `--rounds` times in alternating order. Prints the medians and their
ratio to plain `mmkit serve`.

    OMP_WAIT_POLICY=PASSIVE nice -n 5 python benchmarks/serve_ray.py --requests 40 --runs 3 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from serve_utils import RED_CIRCLE, data_uri, image_message  # noqa: E402

_READY = re.compile(r"ready at (http://\S+)/v1")


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "mmkit", "serve", "--port", "0", "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    found: list[str] = []
    ready = threading.Event()

    def drain():
        for line in proc.stdout:
            match = _READY.search(line)
            if match and not ready.is_set():
                found.append(match.group(1))
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(600):
        proc.kill()
        raise RuntimeError(f"{args}: did not start")
    return proc, found[0]


def conversations(n: int) -> list[list[dict]]:
    red = data_uri(RED_CIRCLE)
    return [image_message(red, f"Question {i}: what is in the image?") if i % 2 == 0 else
            [{"role": "user", "content": f"Question {i}: tell me about the sea."}] for i in range(n)]


async def chat(client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int) -> None:
    await client.chat.completions.create(model="default-model", messages=messages, max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True})


async def measure(url: str, requests: int, runs: int, max_tokens: int
                  ) -> tuple[list[float], list[float], list[float]]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        convs = conversations(requests)
        await asyncio.gather(*(chat(client, m, max_tokens) for m in convs[:4]))  # warm-up
        hops = []  # GET /v1/models: the path's own cost, no engine work
        for _ in range(20):
            t = time.perf_counter()
            await client.models.list()
            hops.append(time.perf_counter() - t)
        single = []
        for i in range(10):
            t = time.perf_counter()
            await chat(client, convs[i % 2], max_tokens)
            single.append(time.perf_counter() - t)
        walls = []
        for _ in range(runs):
            t = time.perf_counter()
            await asyncio.gather(*(chat(client, m, max_tokens) for m in convs))
            walls.append(time.perf_counter() - t)
    return hops, single, walls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="passes over the configurations (even: ABC CBA)")
    args = p.parse_args()
    configs = {"mmkit serve --threads 2": ["--threads", "2"],
               "--ray-serve, 1 replica x 2 threads": ["--ray-serve", "--num-cpus-per-replica", "2"],
               "--ray-serve, 2 replicas x 1 thread": ["--ray-serve", "--num-replicas", "2"]}
    # Rounds in order, then reversed (ABC CBA ...): a machine whose load drifts during the run
    # weighs on every configuration alike. Each number: the median over all its runs.
    hops: dict[str, list[float]] = {name: [] for name in configs}
    singles: dict[str, list[float]] = {name: [] for name in configs}
    walls: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name in (list(configs) if round_ % 2 == 0 else list(configs)[::-1]):
            proc, url = start(configs[name])
            try:
                hop, single, wall = asyncio.run(measure(url, args.requests, args.runs, args.max_tokens))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
            hops[name] += hop
            singles[name] += single
            walls[name] += wall
            print(f"round {round_ + 1}, {name}: GET /v1/models {statistics.median(hop) * 1000:.1f} ms; one chat "
                  f"{statistics.median(single) * 1000:.0f} ms; {args.requests} concurrent chats "
                  f"{statistics.median(wall):.2f} s", flush=True)
    med = {name: (statistics.median(hops[name]), statistics.median(singles[name]), statistics.median(walls[name]))
           for name in configs}
    base = med["mmkit serve --threads 2"]
    print(f"\n| server | GET /v1/models (ms) | one chat, {args.max_tokens} tokens (ms) | {args.requests} concurrent "
          "chats (s) | x plain (chats) |\n| --- | --- | --- | --- | --- |")
    for name, (hop, single, wall) in med.items():
        print(f"| {name} | {hop * 1000:.1f} | {single * 1000:.0f} | {wall:.2f} | {wall / base[2]:.2f} |")

if __name__ == "__main__":
    main()
