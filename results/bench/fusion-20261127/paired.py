import sys, time, torch, statistics
from app.bench.load import LoadSpec, make_prompts
from app.config import EngineConfig, ModelConfig
from app.engine import LLMEngine, Request, SamplingParams
from app.models import load_model
import app.cpu.decoder as dec
import app.cpu.linear as lin
from app.cpu.linear import GatedMLPForward
src = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else None
loaded = load_model(ModelConfig(dtype="auto", **({"source": src} if src else {})))
prompts = [loaded.tokenizer.encode(p) for p in make_prompts(LoadSpec(num_requests=32, prompt_words=56))]
engine = LLMEngine(loaded, EngineConfig(max_num_seqs=32, enable_prefix_caching=False))
mlps = [m.__dict__["forward"] for m in loaded.model.modules() if isinstance(m.__dict__.get("forward"), GatedMLPForward)]
layers = [m.__dict__["forward"] for m in loaded.model.modules() if isinstance(m.__dict__.get("forward"), dec.DecoderLayerForward)]
print(len(mlps), "mlps", len(layers), "layers", mlps[0].silu_lanes)
lanes = mlps[0].silu_lanes
real_linear_add = dec.linear_add
def plain_add(p, x, r): return r + p(x)
def setmode(new):
    for m in mlps: m.silu_lanes = lanes if new else None
    dec.linear_add = real_linear_add if new else plain_add
    for l in layers: l.mlp_add = l.layer.mlp.__dict__["forward"].add if new else None
params = SamplingParams(max_tokens=400, min_tokens=400, temperature=0, ignore_eos=True)
engine.add_requests([Request(f"p{i}", p, params) for i, p in enumerate(prompts)])
for _ in range(10): engine.step()
res = {True: [], False: []}
for trial in range(12):
    for new in ((True, False) if trial % 2 == 0 else (False, True)):
        setmode(new)
        t = time.perf_counter()
        for _ in range(10): engine.step()
        res[new].append((time.perf_counter() - t) / 10 * 1000)
print("decode32 new", [round(x,1) for x in res[True]])
print("decode32 old", [round(x,1) for x in res[False]])
print("medians new %.2f old %.2f  ratio %.3f" % (statistics.median(res[True]), statistics.median(res[False]), statistics.median(res[True])/statistics.median(res[False])))
# prefill pairs
for r in prompts: pass
pre = {True: [], False: []}
engine2 = engine
for trial in range(4):
    for new in ((True, False) if trial % 2 == 0 else (False, True)):
        setmode(new)
        for i in range(32): engine.abort_request(f"p{i}") if trial == 0 and new else None
        while engine.has_unfinished_requests(): engine.step()
        ps = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        engine.add_requests([Request(f"q{trial}{new}-{i}", p, ps) for i, p in enumerate(prompts)])
        t = time.perf_counter(); engine.step(); pre[new].append((time.perf_counter() - t) * 1000)
        while engine.has_unfinished_requests(): engine.step()
print("prefill new", [round(x) for x in pre[True]], "old", [round(x) for x in pre[False]])
