import time, sys, torch
import torch; torch.ops.load_library(sys.argv[2]); OPS = torch.ops.llm_serve
torch.manual_seed(0)
import os; H, HKV, D, LAYERS = map(int, os.environ.get("LAYOUT", "9,3,64,30").split(",")); B = int(os.environ.get("SEQS", 32)); L = int(sys.argv[1])
BS, SLOTS = 16, 40960
pools = torch.randn(LAYERS, 2, SLOTS, HKV, D).to(getattr(torch, os.environ.get("KVDT", "bfloat16")))
# each sequence gets blocks of 16 slots, blocks shuffled over the pool
blocks = torch.randperm(SLOTS // BS)
per_seq = (L + BS - 1) // BS
key_slots = torch.zeros(B, per_seq * BS, dtype=torch.long)
for b in range(B):
    bl = blocks[b * per_seq:(b + 1) * per_seq]
    key_slots[b] = (bl[:, None] * BS + torch.arange(BS)[None]).reshape(-1)
key_slots = key_slots[:, :L].contiguous()
counts = torch.full((B,), L, dtype=torch.long)
new_slots = key_slots[:, L - 1].contiguous()
q = torch.randn(1, B, H, D).transpose(1, 2)  # [1,H,B,D] non-contiguous like the model's
k = torch.randn(1, B, HKV, D).transpose(1, 2)
v = torch.randn(1, B, HKV, D).transpose(1, 2)
scale = D ** -0.5
def step():
    for layer in range(LAYERS):
        OPS.decode_attention(q, k, v, pools[layer, 0], pools[layer, 1], new_slots, key_slots, counts, scale)
flush = torch.empty(64 * 2**20 // 4)
for _ in range(3): step()
ts = []
for _ in range(10):
    flush.add_(1)  # evict
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
ts.sort()
print(f"ctx {L}: all layers {ts[len(ts)//2]*1000:.2f} ms (min {ts[0]*1000:.2f}); KV bytes {B*L*LAYERS*HKV*D*2*2/1e6:.0f} MB -> {B*L*LAYERS*HKV*D*2*2/ts[len(ts)//2]/1e9:.1f} GB/s")
# hot: one layer repeated
t = time.perf_counter()
for _ in range(30): OPS.decode_attention(q, k, v, pools[0, 0], pools[0, 1], new_slots, key_slots, counts, scale)

if os.environ.get("HOT"):
    for _ in range(3): OPS.decode_attention(q, k, v, pools[0, 0], pools[0, 1], new_slots, key_slots, counts, scale)
    t = time.perf_counter()
    for _ in range(LAYERS): OPS.decode_attention(q, k, v, pools[0, 0], pools[0, 1], new_slots, key_slots, counts, scale)
    print(f"hot one layer x{LAYERS}: {(time.perf_counter()-t)*1000:.2f} ms")
