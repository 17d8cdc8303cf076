import importlib, os, sys, tempfile, time, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent)); sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers as bp
from ssdsl.runtime.launch import launch

def worker(model, plan):
    import torch, torch.distributed as dist, ssdsl
    from ssdsl.runtime.dist import distributed
    from ssdsl.trace.model_file import load_model_file
    import ssdsl.lower.build as B
    torch.set_num_threads(1)
    mf = load_model_file(model)
    with distributed():
        pms = {}
        for flag in (False, True):
            B.SPLIT_ALL = flag; B.DEFER_W = False
            pms[flag] = ssdsl.parallelize(model, plan, optimizer="sgd", lr=bp.LR, verify=False)
        out = {}
        import cProfile, pstats, io
        B.DEFER_W = False
        for flag in (False, True, False, True):
            pm = pms[flag]
            for s in range(5):
                i, t = mf.get_batch(s, mf.batch_size); pm.train_step(i, t)
            dist.barrier()
            pr = cProfile.Profile(); pr.enable()
            for s in range(10):
                i, t = mf.get_batch(s, mf.batch_size); pm.train_step(i, t)
            pr.disable()
            st = pstats.Stats(pr)
            tab = {}
            for (f, l, n), (cc, nc, tt, ct, _) in st.stats.items():
                tab[f"{f.split('/')[-1]}:{l}:{n}"] = (tt / 10 * 1e3, nc / 10)
            out[str(flag)] = tab
        return out

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "peers_gpt.py"
        model.write_text(bp.MODEL.format(layers=4, width=128, heads=4, seq=64, vocab=512, batch=16))
        plan = Path(tmp) / "p.ssp"; plan.write_text(bp.pipeline_plan("1f1b", 2, 4, 4))
        per = launch("_split_prof:worker", nproc=2, args=(str(model), str(plan)), timeout_s=900)
    r1 = per[1]
    a, b = r1["False"], r1["True"]
    keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]))
    print("total self ms/step", sum(v[0] for v in a.values()), sum(v[0] for v in b.values()))
    for k in keys[:30]:
        print(f"{k[:60]:60s} {a.get(k,(0,0))[0]:8.3f} {b.get(k,(0,0))[0]:8.3f}  n {a.get(k,(0,0))[1]:6.1f} {b.get(k,(0,0))[1]:6.1f}")
