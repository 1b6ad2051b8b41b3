import gc, time, traceback, sys
T={}
rec=[]
def cb(phase, info):
    if phase=="start":
        T['t']=time.perf_counter()
        if info['generation']==2:
            st=traceback.extract_stack()[:-1]
            T['w']=" <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in st[-3:][::-1])
    else:
        if info['generation']==2:
            rec.append((time.perf_counter()-T['t'], info['collected'], T['w']))
gc.callbacks.append(cb)
t=time.time()
import nnvllm as nv
m=nv.load()
print("load", time.time()-t)
print("full collections during import+load:", len(rec), "sum s", round(sum(r[0] for r in rec),2))
for r in rec: print("  %.3f s collected %d  %s" % r)
