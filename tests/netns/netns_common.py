"""Shared by the netns cluster's measurement scripts (ring_grid.py, scaling.py, jct_run.py)."""
import json
import os
import shlex
import subprocess
import threading
import time


def read_env(path):
    """The KEY=VALUE lines of deploy/netns-cluster.sh's --env-file as a dict."""
    env = {}
    for line in open(path):
        key, _, value = line.strip().partition("=")
        if key:
            env[key] = shlex.split(value)[0] if value else ""
    return env


def start_rank(cfg, host, rank, world, port, job_id, args, lines, extra_env=None, extra_args=()):
    """Starts rank `rank` of a `world`-rank converge-trainer job (MNIST MLP, the sizes of
    `args`) in the namespace `host` with the worker contract's environment (rendezvous on the
    first host's address at `port`). Rank 0's progress lines are appended to `lines` as
    (monotonic time, report) as they arrive; other ranks' output is drained."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0",
        "MASTER_ADDR": cfg["NETNS_ADDRS"].split()[0],
        "MASTER_PORT": str(port),
        "CONVERGE_JOB_ID": job_id,
        "CONVERGE_GENERATION": "1",
        **(extra_env or {}),
    }
    cmd = [
        "ip", "netns", "exec", host, "env", "-i",
        *[f"{k}={v}" for k, v in env.items()],
        os.path.join(cfg["NETNS_BIN"], "converge-trainer"), "--dataset", "mnist", "--model", "mlp",
        "--hidden", str(args.hidden), "--batch-size", str(args.batch),
        "--step-delay-ms", str(args.delay_ms), "--no-grad-stats",
        "--log-every", str(args.log_every), "--eval-every", "0",
        "--max-steps", str(args.steps), "--epochs", "100000", *extra_args,
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if rank == 0:
        def reader():
            for line in p.stdout:
                if line.startswith("CONVERGE_PROGRESS "):
                    lines.append((time.monotonic(), json.loads(line.split(" ", 1)[1])))
        threading.Thread(target=reader, daemon=True).start()
    else:
        threading.Thread(target=p.stdout.read, daemon=True).start()
    return p
