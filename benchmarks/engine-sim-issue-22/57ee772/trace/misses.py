# Misses by visit kind and rule, and by popularity rank, from a bench log of a build with
# placement-trace.patch applied (RUST_LOG=s51place=debug,s51learn=debug; requests after the first 8 s).
# Usage: python3 misses.py LOG...
import sys,re,collections,datetime
def ts(l): 
    t=l[11:26]; h,m,s=t.split(':'); return int(h)*3600+int(m)*60+float(s)
for f in sys.argv[1:]:
    lines=open(f).read().splitlines()
    t0=None; pend=collections.defaultdict(list); ev=[]
    for l in lines:
        if 's51place' in l:
            t=ts(l); t0=t0 or t
            d=dict(re.findall(r'(\w+)=(\S+)',l.split('s51place:')[1]))
            pend[d['placed']].append((t,d))
        elif 's51learn' in l:
            d=dict(re.findall(r'(\w+)=(\S+)',l.split('s51learn:')[1]))
            if pend[d['placed']]:
                t,p=pend[d['placed']].pop(0); p['miss']=int(d['cached'])<int(d['prompt'])/2; ev.append((t,p))
    meas=[p for t,p in ev if t>t0+8]
    n=len(meas); miss=[p for p in meas if p['miss']]
    inst=collections.defaultdict(set); reqs=collections.Counter()
    for p in meas: inst[p['key']].add(p['instance']); reqs[p['key']]+=1
    cat=collections.Counter((p['visit'],p['rule']) for p in miss)
    print(f, 'n',n,'miss %.4f'%(len(miss)/n), 'routers',len(set(p['router'] for p in meas)))
    print('  misses by visit,rule:', ', '.join('%s/%s %d'%(a,b,c) for (a,b),c in cat.most_common()))
    # misses by key popularity rank
    ranked=[k for k,_ in reqs.most_common()]
    rank={k:i for i,k in enumerate(ranked)}
    buckets=collections.Counter(); bre=collections.Counter()
    for p in meas:
        b=min(rank[p['key']]//10,7); bre[b]+=1
        if p['miss']: buckets[b]+=1
    print('  miss by rank/10:', ' '.join('%d:%d/%d(%s)'%(b,buckets[b],bre[b], sorted(collections.Counter(len(inst[k]) for k in ranked if min(rank[k]//10,7)==b).items())) for b in sorted(bre)))
    # rank 10-19 keys: per key, per router instance->count and rules
    for k in ranked[10:20]:
        per=collections.defaultdict(collections.Counter); rules=collections.Counter()
        for p in meas:
            if p['key']==k: per[p['router']][p['instance']]+=1; rules[p['rule']]+=1
        print('   key',k,'reqs',reqs[k],'misses',sum(1 for p in miss if p['key']==k), dict(rules), {r:dict(c) for r,c in per.items()})
