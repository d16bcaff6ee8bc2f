#!/usr/bin/env python3
"""Two or more builds of one workload, side by side: A/B of a change to tagalloc.

usage: python3 compare/ab.py ROUNDS WORKLOAD [workload options] -- BIN1 BIN2 ...

Each BIN is a `workload` binary (`cargo build --release -p compare --bin workload
--features alloc-<name>`, copied aside before the next build). Every round runs WORKLOAD
once with each binary, in an order shuffled per round (seeded by the round); the report
gives each binary's median wall and CPU (user + system) seconds and the median of its
per-round ratios to BIN1 (paired: a round's ratios share the machine's state of the
moment, which on a shared machine moves more than most changes do).
"""
import sys,subprocess,random,statistics,resource,time,os
args=sys.argv[1:]
rounds=int(args[0]); wl=args[1]
i=args.index('--'); extra=args[2:i]; bins=args[i+1:]
res={b:[] for b in bins}
for r in range(rounds):
    order=bins[:]; random.Random(r).shuffle(order)
    for b in order:
        t0=time.perf_counter()
        ru0=resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([b,wl]+extra,stdout=subprocess.DEVNULL,check=True)
        ru1=resource.getrusage(resource.RUSAGE_CHILDREN)
        w=time.perf_counter()-t0
        cpu=(ru1.ru_utime-ru0.ru_utime)+(ru1.ru_stime-ru0.ru_stime)
        res[b].append((w,cpu))
base=bins[0]
for b in bins:
    ws=[x[0] for x in res[b]]; cs=[x[1] for x in res[b]]
    rw=[res[b][k][0]/res[base][k][0] for k in range(rounds)]
    rc=[res[b][k][1]/res[base][k][1] for k in range(rounds)]
    print(f"{os.path.basename(b):24} wall {statistics.median(ws):.3f} cpu {statistics.median(cs):.3f}  paired/first wall {statistics.median(rw):.3f} cpu {statistics.median(rc):.3f}")
