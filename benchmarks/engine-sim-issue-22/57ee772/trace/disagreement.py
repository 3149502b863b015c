# Per-key placement disagreement between routers, from a bench log of a build with
# placement-trace.patch applied (RUST_LOG=s51place=debug,s51learn=debug): for each key that no
# router spread as a hot replica, whether the routers sent most of its requests (after the first
# 8 s) to different instances. Usage: python3 disagreement.py LOG...
import sys,re,collections
def ts(l):
    t=l[11:26]; h,m,s=t.split(':'); return int(h)*3600+int(m)*60+float(s)
for f in sys.argv[1:]:
    t0=None; per=collections.defaultdict(lambda: collections.defaultdict(collections.Counter)); rules=collections.defaultdict(collections.Counter)
    for l in open(f):
        if 's51place' not in l: continue
        t=ts(l); t0=t0 or t
        if t < t0+8: continue
        d=dict(re.findall(r'(\w+)=(\S+)',l.split('s51place:')[1]))
        per[d['key']][d['router']][d['instance']]+=1; rules[d['key']][d['rule']]+=1
    dis=0; disreq=0; tot=0
    for k,rs in per.items():
        if rules[k]['HotReplica']>0: continue
        tops=set(c.most_common(1)[0][0] for c in rs.values())
        n=sum(sum(c.values()) for c in rs.values()); tot+=n
        if len(tops)>1: dis+=1; disreq+=n
    print(f, 'non-hot keys', sum(1 for k in per if rules[k]['HotReplica']==0), 'disagreed', dis, 'their req share %.3f'%(disreq/tot))
