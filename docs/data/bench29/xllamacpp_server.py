"""Issue 29 survey harness (evidence for docs/BENCHMARKS.md): xllamacpp 2026.10.11549 server throughput on
the engine's workload: 4 prompts x 8 completions, 32 new tokens (EOS ignored), T = 1, one thread, bf16
weights, the prompts of raw_decode_loop.py (/tmp/bench/prompts.json).
usage: PYTHONPATH=<xllamacpp install dir> python xllamacpp_server.py MODEL.gguf REPEATS
Measured: wall/CPU s per 1024 tokens 51.3/20.96, 30.8/14.49, 22.4/13.54; the source build's bare loop
right after: CPU 7.57 and 7.83 s."""
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
import xllamacpp as x
P = json.load(open("/tmp/bench/prompts.json"))
p = x.CommonParams()
p.model.path = sys.argv[1]
p.n_parallel = 32
p.n_ctx = 32 * 128
p.kv_unified = True
p.cpuparams.n_threads = 1
p.cpuparams_batch.n_threads = 1
p.n_batch = p.n_ubatch = 2048
p.warmup = False
s = x.Server(p)
def one(args):
    ids, seed = args
    r = s.handle_completions({"prompt": ids, "n_predict": 32, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                              "min_p": 0.0, "seed": seed, "cache_prompt": True, "ignore_eos": True, "n_probs": 1})
    return r["usage"]["completion_tokens"] if isinstance(r, dict) and "usage" in r else r
out = []
for rep in range(int(sys.argv[2])):
    prompts = P["prompts"][(4 * rep) % 16:(4 * rep) % 16 + 4]
    jobs = [(ids, 1000 * rep + g) for ids in prompts for g in range(8)]
    t, c = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(32) as ex:
        res = list(ex.map(one, jobs))
    out.append({"wall": time.perf_counter() - t, "cpu": time.process_time() - c,
                "tokens": sum(r if isinstance(r, int) else 0 for r in res)})
    if rep == 0 and not isinstance(res[0], int):
        print(str(res[0])[:500], file=sys.stderr)
print(json.dumps(out))
