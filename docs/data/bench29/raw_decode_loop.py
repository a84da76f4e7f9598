"""Issue 29 survey harness (evidence for docs/BENCHMARKS.md, not product code): the llama engine's bare decode
loop (no token draw) per binding, each in its own process: prefill I prompts once, copy each to G sequences,
decode all G*I rows for max_new steps (greedy for parity, fixed length for speed). Bindings: source
(llama-cpp-python), ik (ik-llama-cpp-python), cyllama 0.2.18 (its logits API needs a workaround).
Inputs: /tmp/bench/prompts.json (cpu-learn prompt ids) and GGUF files written with gguf_export.write_model.
The figures were taken with an earlier copy that declared the same calls itself (identical settings: flash
attention off for ik, unified KV cache for source).
usage: PYTHONPATH=<repo>:<binding's install dir> python raw_decode_loop.py source|ik|cyllama MODEL.gguf THREADS REPEATS
output: one JSON line (raw-decode-loop.jsonl: 3 repeats x 2 runs per binding and weight type, one thread)"""
import json
import sys
import time

import numpy as np

backend, path, threads, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
P = json.load(open("/tmp/bench/prompts.json"))
I, G, MAXNEW = 4, 8, P["max_new"]


class Binding:
    """The node's own binding classes (node/learn/engines/llama_api.py): source = SourceApi, ik = WheelApi."""

    def __init__(self, which):
        from node.learn.engines import llama_api

        self.api = llama_api.binding(which)

    def load(self, path):
        t = time.perf_counter()
        self.model = self.api.load_model(path)
        self.nv = self.api.n_vocab(self.model)
        return time.perf_counter() - t

    def context(self, n_ctx, n_seq):
        self.ctx = self.api.new_context(self.model, n_ctx, n_seq, threads)
        self.batch = self.api.batch_init(n_ctx)

    def clear(self):
        self.api.clear(self.ctx)

    def seq_cp(self, a, b):
        self.api.seq_cp(self.ctx, a, b)

    def decode(self, entries):
        return self.api.decode(self.ctx, self.batch, entries, self.nv)


class Cy:  # cyllama 0.2.18
    def __init__(self):
        import cyllama.llama.llama_cpp as c
        self.c = c
        c.disable_logging()

    def load(self, path):
        c = self.c

        class M(c.LlamaModel):
            n_vocab = 49152
        t = time.perf_counter()
        self.model = M(path, c.LlamaModelParams())
        self.nv = 49152
        return time.perf_counter() - t

    def context(self, n_ctx, n_seq):
        c = self.c
        p = c.LlamaContextParams()
        p.n_ctx = p.n_batch = p.n_ubatch = n_ctx
        p.n_seq_max = n_seq
        p.kv_unified = True
        p.n_threads = p.n_threads_batch = threads
        self.ctx = c.LlamaContext(self.model, p)
        self.n_ctx = n_ctx

    def clear(self):
        self.ctx.kv_cache_clear()

    def seq_cp(self, a, b):
        self.ctx.memory_seq_cp(a, b, -1, -1)

    def decode(self, entries):
        b = self.c.LlamaBatch(n_tokens=self.n_ctx, embd=0, n_seq_max=1)
        for tok, pos, seq, want in entries:
            b.add(tok, pos, [seq], want)
        self.ctx.decode(b)
        return np.array([self.ctx.get_logits_ith(i) for i, e in enumerate(entries) if e[3]], dtype=np.float32)


def run(api, prompts, greedy):
    api.clear()
    rows = len(prompts) * G
    ents = [(t, pos, p * G, pos == len(ids) - 1) for p, ids in enumerate(prompts) for pos, t in enumerate(ids)]
    logits = np.repeat(api.decode(ents), G, axis=0)
    for p in range(len(prompts)):
        for g in range(1, G):
            api.seq_cp(p * G, p * G + g)
    comps = [[] for _ in range(rows)]
    active = list(range(rows))
    ntok = 0
    for step in range(MAXNEW):
        toks = logits.argmax(axis=1)
        still = []
        for i, r in enumerate(active):
            comps[r].append(int(toks[i]))
            ntok += 1
            if not greedy or toks[i] != P["eos"]:
                still.append(r)
        active = still
        if not active or step == MAXNEW - 1:
            break
        ents = [(comps[r][-1], len(prompts[r // G]) + len(comps[r]) - 1, r, True) for r in active]
        logits = api.decode(ents)
    return comps, ntok


api = Cy() if backend == "cyllama" else Binding({"source": "source", "ik": "wheel"}[backend])
load_s = api.load(path)
api.context(4096, I * G)
# greedy parity on 16 prompts (4 calls), then speed: fixed-length decode, `repeats` times
greedy = []
for s in range(0, 16, I):
    comps, _ = run(api, P["prompts"][s:s + I], True)
    greedy += [comps[p * G] for p in range(I)]
walls, cpus, toks = [], [], []
for r in range(repeats):
    t, c = time.perf_counter(), time.process_time()
    _, n = run(api, P["prompts"][(4 * r) % 16:(4 * r) % 16 + I], False)
    walls.append(time.perf_counter() - t)
    cpus.append(time.process_time() - c)
    toks.append(n)
print(json.dumps({"backend": backend, "model": path, "load_s": load_s, "wall": walls, "cpu": cpus, "tokens": toks,
                  "greedy": greedy}))
