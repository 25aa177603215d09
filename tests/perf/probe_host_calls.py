"""Probe (GPU box; python3 tests/perf/probe_host_calls.py): host time of the CUDA calls a decode step makes per layer."""
import time, torch, statistics
dev = torch.device("cuda")
H, P = 2048, 8
base = torch.empty(1 << 16, dtype=torch.bfloat16, pin_memory=True)
host_y = base[:P * H].view(P, H)
out = torch.empty(P, H, dtype=torch.bfloat16, device=dev)
ev = torch.cuda.Event()
g = torch.cuda.CUDAGraph()
a = torch.zeros(H, device=dev)
torch.cuda.synchronize()
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3): a.add_(1)
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g):
    for _ in range(40): a.add_(1)
torch.cuda.synchronize()
def t(name, f, n=2000):
    xs = []
    for i in range(n):
        t0 = time.perf_counter(); f(); xs.append(time.perf_counter() - t0)
        if i % 50 == 0: torch.cuda.synchronize()
    print(f"{name:40s} median {statistics.median(xs)*1e6:7.1f} us  mean {statistics.mean(xs)*1e6:7.1f}")
t("copy_ pinned view -> device", lambda: out.copy_(host_y, non_blocking=True))
t("copy_ pinned base -> device", lambda: out.view(-1).copy_(base[:P * H], non_blocking=True))
t("event.record", lambda: ev.record())
t("event.record+synchronize", lambda: (ev.record(), ev.synchronize()))
t("graph.replay (40 kernels)", lambda: g.replay(), 500)
t("torch.tensor([[1]]).to(dev)", lambda: torch.tensor([[1]]).to(dev))
