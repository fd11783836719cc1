#!/usr/bin/env python3
"""Small JSON/text helpers of the compose fault tests (tests/compose/lib.sh).

  cvtool.py job JOB FIELD...        stdin: `converge --json jobs --all`; prints the fields of
                                    JOB's status ('hosts' = agents of its placement, 'placed'
                                    = host:rank list), '-' for missing; nothing if no status
  cvtool.py phases                  stdin: jobs JSON; prints 'job phase generation step' lines
  cvtool.py fresh-hosts SECONDS     stdin: `converge --json hosts`; hosts heard within SECONDS
  cvtool.py ages                    stdin: hosts JSON; 'host seconds' since each heartbeat
  cvtool.py pids JOB                stdin: hosts JSON; 'host gen rank pid' of JOB's live workers
  cvtool.py metric NAME [LABELS]    stdin: Prometheus text; the sum of NAME's samples (whose
                                    labels contain LABELS, e.g. 'policy="true"'); '-' if none
  cvtool.py gens LOGDIR JOB         worker logs of JOB: per generation and rank 0, the first
                                    and last progress step, the resume step and the log mtime
  cvtool.py logtimes REGEX           stdin: `docker logs -t`; UNIX time of each matching line
  cvtool.py lost LOGDIR JOB GEN     progress lost when generation GEN started: last progress
                                    step of the generations before it, minus GEN's resume step
  cvtool.py jsz                     stdin: nats-server /jsz?accounts=true&streams=true&config=true;
                                    'meta LEADER SIZE', then per stream 'stream NAME REPLICAS
                                    LEADER CURRENT MESSAGES' (CURRENT: replicas up to date,
                                    leader included)
  cvtool.py connz                   stdin: nats-server /connz; 'NAME START' per client
                                    connection (START: UNIX time the server accepted it)
  cvtool.py progress-lines LOGDIR JOB...  valid CONVERGE_PROGRESS lines the workers of JOBs
                                    printed (all generations and ranks)
"""
import glob, json, os, re, sys, time


def job_status(job):
    for j in json.load(sys.stdin):
        s = j.get("status") or {}
        if s.get("job") == job:
            return s
    return None


def gens(logdir, job):
    out = {}
    for path in glob.glob(os.path.join(logdir, job, "gen*-rank*.log")):
        m = re.search(r"gen(\d+)-rank(\d+)\.log$", path)
        g, r = int(m.group(1)), int(m.group(2))
        first = last = resumed = None
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("CONVERGE_PROGRESS "):
                    try:
                        step = json.loads(line[len("CONVERGE_PROGRESS "):])["step"]
                    except Exception:
                        continue
                    first = step if first is None else first
                    last = step
                mm = re.search(r"resumed from checkpoint at step (\d+)", line)
                if mm:
                    resumed = int(mm.group(1))
                elif "starting at step 0" in line:
                    resumed = 0
        e = out.setdefault(g, {"ranks": 0, "first": None, "last": None, "resumed": None, "mtime": 0.0})
        e["ranks"] += 1
        e["mtime"] = max(e["mtime"], os.path.getmtime(path))
        if last is not None:
            e["last"] = last if e["last"] is None else max(e["last"], last)
            e["first"] = first if e["first"] is None else min(e["first"], first)
        if resumed is not None and (r == 0 or e["resumed"] is None):
            e["resumed"] = resumed
    return out


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "job":
        s = job_status(args[0])
        if s is None:
            return
        vals = dict(s)
        vals["hosts"] = len({p["host"] for p in s.get("placement", [])})
        vals["placed"] = ",".join(f"{p['host']}:{p['rank']}" for p in sorted(s.get("placement", []), key=lambda p: p["rank"])) or "-"
        print(" ".join("-" if vals.get(f) is None else str(vals.get(f)) for f in args[1:]))
    elif cmd == "phases":
        for j in json.load(sys.stdin):
            s = j.get("status") or {}
            if s:
                print(s["job"], s["phase"], s["generation"], s.get("step", 0))
    elif cmd == "ages":
        for h in json.load(sys.stdin):
            print(h["host"], "%.1f" % (time.time() - h["time"]))
    elif cmd == "fresh-hosts":
        limit = float(args[0])
        hs = [h["host"] for h in json.load(sys.stdin) if time.time() - h["time"] < limit]
        print(" ".join(sorted(hs)))
    elif cmd == "pids":
        for h in sorted(json.load(sys.stdin), key=lambda h: h["host"]):
            for w in sorted(h.get("workers", []), key=lambda w: w["rank"]):
                if w["job"] == args[0] and w["phase"] in ("running", "stopping") and w.get("pid"):
                    print(h["host"], w["generation"], w["rank"], w["pid"])
    elif cmd == "metric":
        total, seen = 0.0, False
        for line in sys.stdin:
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
            if m and m.group(1) == args[0] and (len(args) < 2 or args[1] in (m.group(2) or "")):
                total += float(m.group(3)); seen = True
        print(("%g" % total) if seen else "-")
    elif cmd == "gens":
        for g, e in sorted(gens(args[0], args[1]).items()):
            print(g, e["ranks"], e["first"], e["last"], e["resumed"], "%.3f" % e["mtime"])
    elif cmd == "logtimes":
        import datetime
        rx = re.compile(args[0])
        for line in sys.stdin:
            if rx.search(line):
                ts = line.split(" ", 1)[0]
                d, _, frac = ts.rstrip("Z").partition(".")
                t = datetime.datetime.strptime(d, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc).timestamp()
                print("%.3f" % (t + float("0." + (frac or "0"))))
    elif cmd == "lost":
        gs = gens(args[0], args[1]); g = int(args[2])
        before = [e["last"] for k, e in gs.items() if k < g and e["last"] is not None]
        last = max(before) if before else 0
        resumed = (gs.get(g) or {}).get("resumed")
        if resumed is None:
            print("- - -"); return
        print(last, resumed, max(0, last - resumed))
    elif cmd == "jsz":
        j = json.load(sys.stdin)
        meta = j.get("meta_cluster") or {}
        print("meta", meta.get("leader") or "-", meta.get("cluster_size") or "-")
        for acc in j.get("account_details") or []:
            for st in acc.get("stream_detail") or []:
                cl = st.get("cluster") or {}
                current = (1 if cl.get("leader") else 0) + sum(
                    1 for r in cl.get("replicas") or [] if r.get("current") and not r.get("offline"))
                print("stream", st["name"], (st.get("config") or {}).get("num_replicas", "-"),
                      cl.get("leader") or "-", current, (st.get("state") or {}).get("messages", 0))
    elif cmd == "connz":
        import datetime
        for c in json.load(sys.stdin).get("connections") or []:
            d, _, frac = c["start"].rstrip("Z").partition(".")
            tz = datetime.timezone.utc
            if "+" in frac or "-" in frac:  # a local offset: the server's clock is UTC here
                frac = re.split(r"[+-]", frac)[0]
            t = datetime.datetime.strptime(d, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=tz).timestamp()
            print(c.get("name") or "-", "%.3f" % (t + float("0." + (frac or "0"))))
    elif cmd == "progress-lines":
        n = 0
        for job in args[1:]:
            for path in glob.glob(os.path.join(args[0], job, "gen*-rank*.log")):
                with open(path, errors="replace") as f:
                    for line in f:
                        if line.startswith("CONVERGE_PROGRESS "):
                            try:
                                json.loads(line[len("CONVERGE_PROGRESS "):])["step"]
                            except Exception:
                                continue
                            n += 1
        print(n)
    else:
        sys.exit(f"cvtool.py: unknown command {cmd}")


if __name__ == "__main__":
    main()
