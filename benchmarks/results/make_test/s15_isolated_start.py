import sys, time
if __name__ == "__main__":
    import nnvllm as nv
    t = time.time()
    m = nv.load(nv.toy.check(), isolate=True, dtype="float32")
    t1 = time.time()
    run = nv.generate(m, ["The capital of France is"], max_tokens=5)
    print("tokens", run.tokens, "resid", float(run.resid[0].float().abs().sum()))
    print("load", round(t1 - t, 1), "gen", round(time.time() - t1, 1))
    m.close()
