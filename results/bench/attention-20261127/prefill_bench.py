import time, sys, os, torch
torch.ops.load_library(sys.argv[1]); OPS = torch.ops.llm_serve
torch.manual_seed(0)
H, HKV, D, LAYERS = 9, 3, 64, 30
seqs, n = int(sys.argv[2]), int(sys.argv[3])  # seqs prompts of n tokens
SLOTS, BS = 65536, 16
pools = torch.randn(LAYERS, 2, SLOTS, HKV, D).to(torch.bfloat16)
blocks = torch.randperm(SLOTS // BS)
per = (n + BS - 1) // BS
key_slots = torch.stack([(blocks[b*per:(b+1)*per][:, None] * BS + torch.arange(BS)).reshape(-1)[:n] for b in range(seqs)]).contiguous()
T = seqs * n
q = torch.randn(1, T, H, D).transpose(1, 2)
query_seq = torch.arange(seqs).repeat_interleave(n)
query_keys = torch.arange(1, n + 1).repeat(seqs)
def step():
    for layer in range(LAYERS):
        OPS.prefill_attention(q, pools[layer, 0], pools[layer, 1], key_slots, query_seq, query_keys, D ** -0.5)
step()
ts = []
for _ in range(5):
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
ts.sort(); print(f"prefill {seqs}x{n}: {ts[2]*1000:.1f} ms (min {ts[0]*1000:.1f})")
