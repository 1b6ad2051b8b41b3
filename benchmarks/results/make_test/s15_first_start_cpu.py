import time, os, resource
t=time.time()
def cpu():
    r=resource.getrusage(resource.RUSAGE_SELF); c=resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime+r.ru_stime, c.ru_utime+c.ru_stime
import nnvllm as nv
print("import nnvllm", round(time.time()-t,1), cpu())
m=nv.load()
print("load", round(time.time()-t,1), cpu())
r=nv.generate(m,"The capital of France is",max_tokens=3)
print("gen", round(time.time()-t,1), cpu(), r.text)
m.close()
print("close", round(time.time()-t,1), cpu())
