#!/usr/bin/env python3
"""Where one MCP call's time goes at one in flight: `bmx bench mcp`'s
proxied and direct rows split into wake-ups and work along the critical
path, from the scheduler's own record (docs/benchmarks.md, issue 11).

    perf sched record -o sched.data -- \
        ./target/release/bmx bench mcp --worker-threads 1 --in-flight 1
    perf sched timehist -i sched.data -w > timehist.txt
    scripts/mcp-critical-path.py timehist.txt

One worker thread, so that the harness's and the executor's work is one
thread's and each hand-off between them is visible as work, not as a
wake-up. The rows' calls are strictly serial at one in flight, so each
call is the chain

    client --wakes--> worker --wakes--> node --wakes--> worker --wakes--> client

(the direct row: client --> node --> client) and each link splits into
the wake-up latency (woken until running, what an idle virtual CPU's halt
costs) and the work until the next wake-up in the chain. The script
prints the median of each over the calls in which every link woke its
thread, how many calls found a thread already awake, and the median
period of all calls. It reads the last rows of the record as the
one-in-flight rows: record a run with `--in-flight 1` only.
"""

import bisect
import re
import statistics
import sys

# Rows are apart by at least this (µs): the rows between them (harness-only,
# bare HTTP) or the next row's set-up; perf's own pauses are shorter.
GAP = 50_000

LINE = re.compile(
    r"^\s*(\d+\.\d+)\s+\[(\d+)\]\s+(\S+)\s+"
    r"(?:awakened:\s+(\S+)|(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+))"
)


def kind(task):
    """worker / client / node pid, or None for everything else."""
    if task.startswith("tokio-rt-worker"):
        return "worker"
    if task.startswith("bench-client"):
        return "client"
    m = re.match(r"node\[(\d+)\]$", task)
    if m:
        return "node:" + m.group(1)
    return None


def parse(path):
    """Wake events (t, waker, wakee) and, per task, run segments (start,
    end, CPU) in time order; times in µs."""
    wakes, runs = [], {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            t = float(m.group(1)) * 1e6
            who = kind(m.group(3))
            if m.group(4):
                whom = kind(m.group(4))
                if who and whom and who != whom:
                    wakes.append((t, who, whom))
            elif who:
                run = float(m.group(7)) * 1e3
                runs.setdefault(who, []).append((t - run, t, m.group(2)))
    return wakes, runs


def segment(runs, task, t):
    """The run of `task` in progress at `t`, or the first to start after:
    the first to end at or after `t` (a task's runs end in time order)."""
    segs = runs.get(task, [])
    i = bisect.bisect_left(segs, t, key=lambda seg: seg[1])
    return segs[i] if i < len(segs) else None


def between(times, lo, hi):
    """The sorted `times` strictly between `lo` and `hi`."""
    return times[bisect.bisect_right(times, lo) : bisect.bisect_left(times, hi)]


def calls(wakes, pattern):
    """The row's calls, one per wake-up of the second link (the first hop
    away from the client): the last wake-up of the first link since the
    previous call's last link, and the first of each later link after it
    and before the next call's. Wake-ups between the same pairs that are
    not on the chain (the client's read waking the worker with a spurious
    EPOLLOUT, say) are skipped. A link with no wake-up in its place (the
    woken thread was still awake) is None. Consecutive calls closer than
    GAP apart form a row; rows of at least 200 calls are returned, in
    time order."""
    by_pair = {}
    for t, who, whom in wakes:
        by_pair.setdefault((who, whom), []).append(t)
    anchors = by_pair.get(pattern[1], [])
    out, row, prev_end = [], [], float("-inf")
    for i, a in enumerate(anchors):
        bound = anchors[i + 1] if i + 1 < len(anchors) else float("inf")
        first = between(by_pair.get(pattern[0], []), prev_end, a)
        chain, t = [first[-1] if first else None, a], a
        for pair in pattern[2:]:
            later = between(by_pair.get(pair, []), t, bound)
            if later:
                t = later[0]
                chain.append(t)
            else:
                chain.append(None)
        prev_end = max(x for x in chain if x is not None)
        if row and a - row[-1][1] > GAP:
            out.append(row)
            row = []
        row.append(chain)
    if row:
        out.append(row)
    return [r for r in out if len(r) >= 200]


def split(row, pattern, runs):
    """Per call: for each link, (wake-up latency, work until the next
    link's wake-up; the last link's runs to the next call's first,
    whether the woken thread ran on another CPU than its waker's), for
    the calls in which every link woke its thread; and, per link, how
    many calls found that thread awake; and every call's period (from
    its second link to the next call's, always a wake-up)."""
    # The middle 80 %: the row's first and last calls border other rows.
    row = row[len(row) // 10 : len(row) - len(row) // 10]
    out, awake = [], [0] * len(pattern)
    periods = [b[1] - a[1] for a, b in zip(row, row[1:])]
    for k, call in enumerate(row[:-1]):
        for j, t in enumerate(call):
            awake[j] += t is None
        ends = call[1:] + [row[k + 1][0]]
        if None in call or None in ends:
            continue
        link = []
        for t, t_next, (who, whom) in zip(call, ends, pattern):
            seg, waker = segment(runs, whom, t), segment(runs, who, t)
            if seg is None or waker is None:
                break
            start = max(seg[0], t)
            link.append((start - t, t_next - start, seg[2] != waker[2]))
        if len(link) == len(pattern) and all(b >= 0 for _, b, _ in link):
            out.append(link)
    return out, awake, periods


def report(name, pattern, split_rows):
    rows, awake, periods = split_rows
    print(f"{name}: {len(periods)} calls, call period median {statistics.median(periods):.1f} µs")
    for (waker, wakee), n in zip(pattern, awake):
        if n:
            print(f"  {waker} -> {wakee} found {wakee} awake in {n} calls ({100 * n / len(periods):.1f} %)")
    print(f"  the {len(rows)} calls in which every hand-off woke its thread, median µs:")
    total = 0.0
    for j, (waker, wakee) in enumerate(pattern):
        wake = statistics.median(r[j][0] for r in rows)
        work = statistics.median(r[j][1] for r in rows)
        moved = 100 * sum(r[j][2] for r in rows) / len(rows)
        total += wake + work
        print(
            f"  {waker:>10} -> {wakee:<10} wake-up {wake:6.1f} (on the other CPU in {moved:3.0f} %)"
            f"  then {wakee} works {work:6.1f}"
        )
    period = statistics.median(sum(a + b for a, b, _ in r) for r in rows)
    print(f"  call period {period:.1f} (sum of medians {total:.1f})")


def direct(wakes, runs, node):
    """The direct row: node's reply wakes the client once per call; the
    client's request wakes node only if node went to sleep meanwhile.
    When they share a CPU the client preempts node as the reply is
    written and node reads the next request without sleeping: no idle
    CPU is woken at all."""
    replies = [t for t, who, whom in wakes if (who, whom) == (node, "client")]
    requests = [t for t, who, whom in wakes if (who, whom) == ("client", node)]
    rows, row = [], []
    for t in replies:
        if row and t - row[-1] > GAP:
            rows.append(row)
            row = []
        row.append(t)
    rows.append(row)
    # The last row: the one-in-flight row of a `--in-flight 1` record.
    row = [r for r in rows if len(r) >= 200][-1]
    row = row[len(row) // 10 : len(row) - len(row) // 10]
    periods, wake, work, slept = [], [], [], 0
    for a, b in zip(row, row[1:]):
        seg = segment(runs, "client", a)
        if seg is None:
            continue
        start = max(seg[0], a)
        periods.append(b - a)
        wake.append(start - a)
        work.append(seg[1] - start)
        slept += bool(between(requests, a, b))
    print(f"direct: {len(periods)} calls, median µs")
    print(f"  {node} -> client wake-up {statistics.median(wake):6.1f}  then client works {statistics.median(work):6.1f}")
    print(f"  call period {statistics.median(periods):.1f}; node slept (was woken by the request) in {100 * slept / len(periods):.0f} % of calls")


def main():
    wakes, runs = parse(sys.argv[1])
    nodes = {whom for _, who, whom in wakes if who == "worker" and whom.startswith("node:")}
    direct_nodes = {whom for _, who, whom in wakes if who == "client" and whom.startswith("node:")}
    for node in sorted(direct_nodes):
        direct(wakes, runs, node)
    for node in sorted(nodes):
        pattern = [("client", "worker"), ("worker", node), (node, "worker"), ("worker", "client")]
        rows = calls(wakes, pattern)
        # The warm-up's rows first, then the TCP and the Unix socket rows
        # of the one in-flight value a `--in-flight 1` record has.
        for name, row in zip(["proxied (TCP)", "proxied (Unix socket)"], rows[-2:]):
            report(name, pattern, split(row, pattern, runs))


if __name__ == "__main__":
    main()
