"""`memstep replay` and `memstep inspect` of a router's log (`serve --data-parallel-size`)."""

from __future__ import annotations

import argparse
import json

from memstep.replay.text_table import render
from memstep.router.replay import load_router_log, replay_router, summarize


def replay(args: argparse.Namespace) -> int:
    """Exit 0 when every decision is reproduced, 1 at the first that is not."""
    log = load_router_log(args.log)
    checked, diverged = replay_router(log)
    report = {
        "decisions": checked,
        "identical": diverged is None,
        "divergence": str(diverged) if diverged else None,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    elif diverged is None:
        print(f"router log: {checked} routing and migration decisions replayed, all identical")
    else:
        print(f"router log: diverged at {diverged}")
    return 0 if diverged is None else 1


def inspect(args: argparse.Namespace) -> int:
    s = summarize(load_router_log(args.log))
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    print(f"router log: policy {s['policy']}, {len(s['replicas'])} replicas")
    for i, endpoint in enumerate(s["replicas"]):
        print(f"  replica {i}: {endpoint}")
    rows = [key.split(":") + [n] for key, n in s["routed"].items()]
    print("routings\n" + render(["replica", "reason", "requests"], rows, left=2))
    for lost in s["lost"]:
        print(
            f"replica {lost['replica']} lost at decision {lost['seq']}: {lost['reason']} "
            f"({lost['num_unfinished']} unfinished)"
        )
    for back in s["returned"]:
        print(f"replica {back['replica']} back at decision {back['seq']}")
    rows = [
        [m["seq"], m["request_id"], m["from_replica"], m["replica"], m["tokens_carried"]]
        for m in s["migrations"]
    ]
    head = ["decision", "request", "from", "to", "tokens carried"]
    print(f"migrations: {len(rows)}" + ("\n" + render(head, rows, left=2) if rows else ""))
    print("ended: " + ", ".join(f"{k} {v}" for k, v in sorted(s["ended"].items())))
    pauses = s["migrated_pause_s"]
    if pauses:
        print(
            f"migrated requests' pause: max {max(pauses):.3f} s, "
            f"mean {sum(pauses) / len(pauses):.3f} s"
        )
    return 0
