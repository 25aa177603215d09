"""Probe (GPU box; python3 tests/perf/probe_bank_pages.py): does the page size of the expert banks limit the CPU
experts' read bandwidth? Qwen3-30B-A3B shape, 12 layers' banks, decode calls (8 experts x 1 token) rotating over
the layers as decode does, banks in (a) cudaHostAlloc pinned memory, as the engine allocates them, (b) anonymous
memory with transparent huge pages, (c) the same registered with cudaHostRegister (pinned for DMA, huge pages kept?).
Usage: python3 tests/perf/probe_bank_pages.py [kinds, default pinned,thp,thp+registered,pinned] [item KiB] [experts per call]
(the item KiB builds the kernel with that work item size instead of ITEM_BYTES, 0: the default; experts per call,
e.g. 8,32,128: one token on each, to separate a call's fixed cost from its streaming)."""
import mmap
import statistics
import sys
import time

import torch

from moedesk.kernels import cpu_experts as ce

KINDS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["pinned", "thp", "thp+registered", "pinned"]
if len(sys.argv) > 2 and int(sys.argv[2]):
    ce.FLAGS = [*ce.FLAGS, f"-DITEM_BYTES=({int(sys.argv[2])} * 1024)"]

E, H, F, L = 128, 2048, 768, 12
PER_CALL = [int(k) for k in sys.argv[3].split(",")] if len(sys.argv) > 3 else [8]
BF16 = torch.bfloat16


def thp_tensor(shape):
    n = 1
    for s in shape:
        n *= s
    mm = mmap.mmap(-1, n * 2 + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    start = (-t.data_ptr()) % (2 << 20)  # 2 MiB aligned
    out = t[start:start + n * 2].view(BF16).view(shape)
    out.fill_(0.01)
    out._keep = mm
    return out


def banks(kind):
    result = []
    for _ in range(L):
        if kind == "pinned":
            gu = torch.empty((E, 2 * F, H), dtype=BF16, pin_memory=True)
            dn = torch.empty((E, H, F), dtype=BF16, pin_memory=True)
            gu.fill_(0.01), dn.fill_(0.01)
        else:
            gu, dn = thp_tensor((E, 2 * F, H)), thp_tensor((E, H, F))
            if kind == "thp+registered":
                for t in (gu, dn):
                    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * 2, 0)
                    assert int(rc) == 0, rc
        result.append((gu, dn))
    return result


def anon_huge_mb():
    for line in open("/proc/meminfo"):
        if line.startswith("AnonHugePages"):
            return int(line.split()[1]) // 1024
    return -1


print("THP:", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(), "| threads", ce.get_num_threads(),
      "| item KiB", sys.argv[2] if len(sys.argv) > 2 else "default")
x = torch.randn(1, H).to(BF16)
gen = torch.Generator().manual_seed(0)
rows = []
for kind in KINDS:
    before = anon_huge_mb()
    bs = banks(kind)
    huge = anon_huge_mb() - before
    for K in PER_CALL:
        xs = x.expand(K, H).contiguous()  # K tokens, one per expert: every chosen expert streamed once
        out = torch.empty(K, H, dtype=BF16)
        index = torch.empty(2 * K + 2 * E + 1, dtype=torch.int64)
        times = []
        for step in range(max(10, 480 // K)):
            for gu, dn in bs:
                ids = torch.randperm(E, generator=gen)[:K].sort().values
                t = time.perf_counter()
                ce.experts_forward_routed(xs, ids, 1, None, gu, dn, out, index)
                times.append(time.perf_counter() - t)
        ms = statistics.median(times[L * 3:]) * 1e3
        rows.append((kind, huge, K, ms, K * 3 * H * F * 2 / ms / 1e6))
    del bs
print(f"{'banks':<18}{'huge MB':>9}{'experts':>9}{'ms/call':>9}{'GB/s':>7}")
for kind, huge, K, ms, gbs in rows:
    print(f"{kind:<18}{huge:>9}{K:>9}{ms:>9.3f}{gbs:>7.1f}")
