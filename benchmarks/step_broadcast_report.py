"""The text of ``bench_step_broadcast.py``'s results: the gloo vs shm tables, one per
follower count, and the notes that read them (what was timed, how the shm channel
synchronizes, and what this machine's cores and load do to the figures)."""

from __future__ import annotations

from typing import Any

from shm_step_channel import HEADER_WORDS


def table_lines(data: dict[str, Any]) -> list[str]:
    """Per follower count, a markdown table: per step size, both channels' latency
    (median, p90), their ratio and the leader's send cost, in µs."""
    lines = []
    for nf in data["followers"]:
        lines += [f"### 1 leader + {nf} follower{'s' if nf > 1 else ''}", "",
                  "| step | payload KiB | gloo median | gloo p90 | shm median | shm p90 "
                  "| shm/gloo (median) | gloo send | shm send |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for s in data["shapes"]:
            g = data["runs"][f"gloo x{nf}"][s["name"]]
            m = data["runs"][f"shm x{nf}"][s["name"]]
            kib = (s["payload_words"] + HEADER_WORDS) * 8 / 1024
            lines.append(
                f"| {s['name']} | {kib:.1f} | {g['median_us']:.0f} | {g['p90_us']:.0f} "
                f"| {m['median_us']:.0f} | {m['p90_us']:.0f} "
                f"| **{m['median_us'] / g['median_us']:.2f}** "
                f"| {g['send_median_us']:.0f} | {m['send_median_us']:.0f} |")
        lines.append("")
    return lines


def notes(data: dict[str, Any]) -> list[str]:
    """The .md's reading of the tables: the ratio ranges, then what they depend on."""
    lines = []
    for nf in data["followers"]:
        r = [data["runs"][f"shm x{nf}"][s["name"]]["median_us"]
             / data["runs"][f"gloo x{nf}"][s["name"]]["median_us"] for s in data["shapes"]]
        lines.append(f"- 1 + {nf}: shm/gloo median latency {min(r):.2f} to {max(r):.2f} "
                     f"over the {len(r)} step sizes.")
    cpus, world = data["cpus"], 1 + max(data["followers"])
    lines += [
        "",
        "Latency: from the leader's stamp just before it starts sending to the stamp of "
        "the last follower holding the rebuilt `LaunchBatch` (one CLOCK_MONOTONIC for all "
        "processes), median and p90 over the timed steps, in µs. Send: the leader's own "
        "call (gloo: `StepChannel.send_step`, one `dist.broadcast` when the step fits "
        "64 KiB, two past it; shm: header + payload write + counter store; the wait "
        "for the previous step's acks is not in it). "
        "Steps run in lockstep: the next starts once every follower acknowledged the "
        "previous one, after checking it against the leader's tensors (every step "
        "checked, values and dtypes; none differed).",
        "",
        "shm synchronization: the leader waits until every follower's ack counter equals "
        "its step counter (the segment is free), writes the 10-word header and the int64 "
        "payload (StepChannel's layout) into the segment, then stores step counter + 1. "
        "Followers spin-poll the counter with `os.sched_yield()` between polls, copy the "
        "header and payload out, rebuild the `LaunchBatch` as `StepChannel.recv` does, "
        "and store the counter into their own ack line (one 64-byte line per follower). "
        "Plain aligned int64 stores from numpy: ordered on x86-64 (TSO); a weakly ordered "
        "CPU (aarch64) would need fences around the counters (a C helper or atomics).",
        "",
        f"Caveats of this machine: {cpus} cores for {world} processes at 1 + "
        f"{max(data['followers'])}. The shm followers never block: each spins "
        "(yielding) and competes with the leader for the cores, so with 3 followers on "
        f"{cpus} cores the leader can be preempted while it writes (its send column is "
        "higher than with 1 follower) and the shm figures are pessimistic and noisy; "
        "gloo's followers block in the kernel instead, but every broadcast hops through "
        "gloo's worker and transport threads, each hop a wake-up that waits for a free "
        "core (the multi-ms p90s are such waits). Other jobs shared the machine too: "
        f"1-minute load average {data['loadavg_start'][0]:.1f} before the run, "
        f"{data['loadavg_end'][0]:.1f} after (this run's own spinning ranks included). "
        "GPU nodes have many cores (one or more per rank to spare), "
        "where a spinning follower has a core to itself: there both channels' figures "
        "should be far lower and steadier, and the shm wake-up is one cache-line "
        "transfer rather than a scheduler wake-up.",
    ]
    return lines
