#!/usr/bin/env python3
"""Does the shape of a relayed request cost node more? (issue 11,
docs/benchmarks.md, "Re-measured at `872773f`").

The executor does not hand server-everything the requests a client
sends: it rewrites their ids to strings (`"h:59"`, so its own requests
and the harness's never collide) and initializes the server with its own
protocol version (`2025-11-25`), where the bench's direct client sends
integer ids and `2025-06-18`. At 32 in flight node spends more CPU per
call on the proxied path than on the direct one, so this script asks
whether those two differences are the cause: it drives the same server
over its stdio with each combination, 32 requests in flight, and prints
node's own CPU per call (from /proc, user + system) and the calls per
second. The driver is plain asyncio, so calls/s are the driver's more
than node's; the CPU per call is the figure to compare.

    scripts/mcp-node-ids.py            # 3 rounds of the 4 combinations
    scripts/mcp-node-ids.py --rounds 1 --calls 20000
"""

import argparse
import asyncio
import json
import os
import time

SERVER = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "tests",
    "peers",
    "node_modules",
    ".bin",
    "mcp-server-everything",
)
CALL_DEADLINE_S = 30


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(string_ids, protocol, calls, in_flight, warmup):
    proc = await asyncio.create_subprocess_exec(
        SERVER,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        limit=1 << 20,
    )
    waiting = {}
    loop = asyncio.get_running_loop()

    async def read_answers():
        while True:
            line = await proc.stdout.readline()
            if not line:
                return
            try:
                message = json.loads(line)
            except ValueError:
                continue
            future = waiting.pop(message.get("id"), None)
            if future is not None:
                future.set_result(None)

    reader = asyncio.create_task(read_answers())

    async def call(rid, method, params):
        future = loop.create_future()
        waiting[rid] = future
        line = json.dumps(
            {"jsonrpc": "2.0", "id": rid, "method": method, "params": params},
            separators=(",", ":"),
        )
        proc.stdin.write(line.encode() + b"\n")
        await asyncio.wait_for(future, CALL_DEADLINE_S)

    try:
        await call(
            "bmx:init" if string_ids else 0,
            "initialize",
            {
                "protocolVersion": protocol,
                "capabilities": {},
                "clientInfo": {"name": "mcp-node-ids", "version": "1"},
            },
        )
        proc.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
        counter = [0]

        def next_id():
            counter[0] += 1
            return f"h:{counter[0]}" if string_ids else counter[0]

        async def worker(n):
            for _ in range(n):
                await call(
                    next_id(),
                    "tools/call",
                    {"name": "echo", "arguments": {"message": "bench"}},
                )

        # node compiles its hot path only after thousands of calls.
        await asyncio.gather(*[worker(warmup // in_flight) for _ in range(in_flight)])
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        await asyncio.gather(*[worker(calls // in_flight) for _ in range(in_flight)])
        cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
        done = (calls // in_flight) * in_flight
        return (cpu1 - cpu0) * 1e6 / done, done / (t1 - t0)
    finally:
        reader.cancel()
        proc.kill()
        await proc.wait()


async def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=40000)
    parser.add_argument("--warmup", type=int, default=10000)
    parser.add_argument("--in-flight", type=int, default=32)
    args = parser.parse_args()
    print("round  ids      protocol    node CPU/call  calls/s")
    for r in range(1, args.rounds + 1):
        for string_ids in (False, True):
            for protocol in ("2025-06-18", "2025-11-25"):
                us, rate = await one(
                    string_ids, protocol, args.calls, args.in_flight, args.warmup
                )
                kind = "string" if string_ids else "integer"
                print(f"{r:5}  {kind:7}  {protocol}  {us:10.1f} us  {rate:7.0f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
