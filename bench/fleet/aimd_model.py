#!/usr/bin/env python3
"""A model of DESIGN §18 `learn_rate = "aimd"` against fleet.py's per-second rule
with a foreign consumer (docs/benchmarks.md, "The rate learned from 429s"): one
PolyGate bucket of one request (burst = 60 s / rpm) whose rate is the limit × a
factor cut ×d on a 429 (at most once per D s, not while blocked) and raised +a per
second without one; the upstream admits rpm/60 per fixed 1-second window; the
foreign consumer sends SHARE of the limit evenly paced and retries its 429s at the
next window. Prints, per setting, PolyGate's 429 share and its use of what the
foreign consumer left (mean of 4 seeds). `refund=True` models a 429 that gives the
request back (the next grant at the block's end). Usage: aimd_model.py RPM

`aimd_model.py RPM --fixed` is the bound behind it: no learning at all, the bucket's
rate held at a fixed share of the limit, swept in steps of 1/800 of the limit up to
the half the foreign consumer leaves, each from 8 start phases, a 429 blocking the
source to its window's end; `refund=True` (a 429 gives its request back, so the
next grant is at the block's end: the bucket re-anchored on the free window) and
False. It prints the band of rates that meet issue 29's goal (<= 5 % 429s, >= 80 %
of what is left) from every phase: at 600 RPM 0.41-0.50 of the limit either way; at
60 RPM none without the refund, and 0.489-0.500 with it — a band 2 % of the limit
wide just under the share left, above which the 429s jump to a third. A rate that
is learned (cut on a 429, raised without one) crosses that band and cannot stay in it.
"""
import random, sys
def run(rpm=60, d=0.7, D=1.0, a=0.01, P=1.0, floor=0.05, refund=False, secs=90, seed=1, share=0.5):
    random.seed(seed)
    L=rpm/60.0; lim=L
    f=1.0; last_dec=-1e9; last_429=-1e9; last_inc=0.0
    full_at=0.0; bu=0.0; win={}
    iv=1.0/(L*share)
    foreign=[iv*k+0.001 for k in range(1,int(secs/iv)+2)]
    ok=r429=0; fi=0; fok=0; cur=0.0
    pend=[]
    def flush(upto):
        nonlocal fi,fok
        while fi<len(foreign) and foreign[fi] < upto:
            w=int(foreign[fi])
            if win.get(w,0)<L: win[w]=win.get(w,0)+1; fok+=1; fi+=1
            else: foreign[fi]=w+1.0001  # retry after
    while True:
        rate=lim*f
        g=max(full_at, bu, cur)
        if g>secs: break
        arr=g+random.uniform(0.001,0.01)
        flush(arr)
        full_at=max(full_at,g)+1.0/rate
        w=int(arr)
        if win.get(w,0)>=L:
            r429+=1; rep=arr+0.002
            unpred = rep>=bu
            bu=max(bu, w+1.0)
            if refund: full_at=min(full_at, bu)
            if unpred and rep-last_dec>=D:
                f=max(floor, f*d); last_dec=rep
            last_429=rep
        else:
            win[w]=win.get(w,0)+1; ok+=1
        cur=g+1e-6
        nxt=max(full_at,bu,cur)
        base=max(last_429,last_inc)
        if nxt-base>=P:
            k=int((nxt-base)/P); f=min(1.0,f+a*k); last_inc=base+k*P
    allowed=L*secs
    return r429/max(1,ok+r429), ok/max(1,allowed-fok), f
def fixed(rpm, f, phase, secs=90, refund=False):
    """run()'s upstream and foreign consumer against a bucket held at f x the limit,
    its first grant at `phase` s: (429 share, use of what was left). `refund`: a 429
    gives its request back, so the next grant is at the block's end (re-anchored)."""
    L=rpm/60.0; iv=1.0/(L*0.5)
    foreign=[iv*k+0.001 for k in range(1,int(secs/iv)+2)]
    win={}; fi=0; fok=0; ok=r429=0
    full_at=phase; bu=0.0; cur=0.0
    def flush(upto):
        nonlocal fi,fok
        while fi<len(foreign) and foreign[fi] < upto:
            w=int(foreign[fi])
            if win.get(w,0)<L: win[w]=win.get(w,0)+1; fok+=1; fi+=1
            else: foreign[fi]=w+1.0001
    rnd=random.Random(int(phase*1000)+int(f*1e6))
    while True:
        g=max(full_at,bu,cur)
        if g>secs: break
        arr=g+rnd.uniform(0.001,0.01)
        flush(arr)
        full_at=max(full_at,g)+1.0/(L*f)
        w=int(arr)
        if win.get(w,0)>=L:
            r429+=1; bu=max(bu,w+1.0)
            if refund: full_at=min(full_at,bu)
        else:
            win[w]=win.get(w,0)+1; ok+=1
        cur=g+1e-6
    return r429/max(1,ok+r429), ok/max(1,L*secs-fok)
import itertools
rpm=int(sys.argv[1])
if "--fixed" in sys.argv:
    steps=400
    for refund in (False, True):
        met=[]
        for i in range(1, steps+1):
            f=0.5*i/steps  # the rate as a share of the limit (what is left: 0.5)
            res=[fixed(rpm,f,ph/8.0,refund=refund) for ph in range(8)]
            if max(r[0] for r in res)<=0.05 and min(r[1] for r in res)>=0.8:
                met.append(f)
        what="refund=%s:"%refund
        if not met:
            print("rpm=%d %s no fixed rate meets the goal at every phase"%(rpm,what))
        else:
            print("rpm=%d %s fixed rates meeting the goal at every phase: %.4f..%.4f of the limit "
                  "(%d of %d tried; what is left: 0.5)"%(rpm,what,min(met),max(met),len(met),steps))
    sys.exit(0)
for refund in (False,True):
  for d in (0.5,0.7,0.9):
    for a in (0.002,0.005,0.01,0.02):
        for D in (1.0,5.0):
          res=[run(rpm=rpm,d=d,D=D,a=a,refund=refund,seed=s) for s in range(4)]
          print(refund,d,a,D, "429%%=%.1f left=%.1f f=%.2f"%(100*sum(r[0] for r in res)/4, 100*sum(r[1] for r in res)/4, res[0][2]))
