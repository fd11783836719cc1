#!/usr/bin/env python3
"""Submits job specs to a running netns cluster (deploy/netns-cluster.sh --up --env-file ENV),
follows them with `converge --json jobs --all` once a second until every one has finished,
and writes per job: its placement (hosts and ranks per host), the observed seconds per step
while it ran (the allocator's `step_time_s`, rank 0's reports), its completion time (JCT:
finished - submitted) and phase, as JSON.

  jct_run.py --env ENV --out FILE [--spacing 2] [--timeout 900] SPEC...
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns_common import read_env  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--spacing", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("specs", nargs="+")
    args = ap.parse_args()
    cfg = read_env(args.env)

    def converge(*cmd, parse=True):
        out = subprocess.run(
            ["ip", "netns", "exec", cfg["NETNS_CTL"], "env", "CONVERGE_NATS_URL=nats://127.0.0.1:4222",
             cfg["NETNS_BIN"] + "/converge", *(["--json"] if parse else []), *cmd],
            check=True, capture_output=True, text=True).stdout
        return json.loads(out) if parse else out

    ids = []
    for i, spec in enumerate(args.specs):
        if i:
            time.sleep(args.spacing)
        ids.append(converge("submit", spec)["id"])
    seen = {}
    deadline = time.time() + args.timeout
    while time.time() < deadline:
        rows = {r["spec"]["id"]: r["status"] for r in converge("jobs", "--all") if r["spec"]["id"] in ids}
        for job, st in rows.items():
            if not st:
                continue
            entry = seen.setdefault(job, {"job": job, "steps": []})
            entry["status"] = st
            if st["phase"] == "running" and st.get("step_time_s"):
                hosts = {}
                for r in st["placement"]:
                    hosts[r["host"]] = hosts.get(r["host"], 0) + 1
                entry["placement"] = hosts
                entry["generation"] = st["generation"]
                entry["steps"].append(st["step_time_s"])
        done = [j for j in ids if seen.get(j, {}).get("status", {}).get("phase") in ("completed", "failed", "cancelled")]
        print(f"\r{len(done)}/{len(ids)} finished", end="", file=sys.stderr, flush=True)
        if len(done) == len(ids):
            break
        time.sleep(1)
    print(file=sys.stderr)
    result = []
    for job in ids:
        e = seen.get(job, {"job": job, "status": {}})
        st = e.get("status") or {}
        jct = (st["finished_at"] - st["submitted_at"]) if st.get("finished_at") else None
        steps = e.get("steps", [])
        result.append({
            "job": job,
            "phase": st.get("phase"),
            "jct_s": jct,
            "placement": e.get("placement"),
            "generations": st.get("generation"),
            # The last observed step time of its (last) running generation.
            "step_time_s": steps[-1] if steps else None,
            "final_step": st.get("step"),
        })
    json.dump(result, open(args.out, "w"), indent=1)
    if any(r["jct_s"] is None for r in result):
        sys.exit("some jobs did not finish: " + ", ".join(r["job"] for r in result if r["jct_s"] is None))


if __name__ == "__main__":
    main()
