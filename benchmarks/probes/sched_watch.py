"""Every 3 s, each `ray::Worker*` process on this machine: its threads' scheduling policies (0 normal,
5 SCHED_IDLE), its state and its CPU ticks, one JSON line each. Run beside a benchmark to see which
workers take CPU and at what priority (the churn trace in docs/benchmarks/churn.md).

    python benchmarks/probes/sched_watch.py OUT.jsonl    (stop it with a signal)
"""
import json
import os
import sys
import time

out = open(sys.argv[1], "a")
while True:
    now = time.time()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")[0].decode(errors="replace")
            if not cmd.startswith("ray::Worker"):
                continue
            tids = os.listdir(f"/proc/{pid}/task")
            pol = {}
            for t in tids:
                try:
                    p = os.sched_getscheduler(int(t))
                except OSError:
                    continue
                pol[p] = pol.get(p, 0) + 1
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            st = fields[0].decode()
            ticks = int(fields[11]) + int(fields[12])
        except OSError:
            continue
        out.write(json.dumps({"t": now, "pid": int(pid), "cmd": cmd[:40], "policies": pol, "state": st,
                              "ticks": ticks}) + "\n")
    out.flush()
    time.sleep(3)
