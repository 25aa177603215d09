"""How fast a checkpoint loads with every routed expert in RAM, from the page cache, and what memory it takes.

Usage (repo root):
    python3 tests/perf/load_bench.py CKPT [--device auto] [--dtype bfloat16] [--banks arena,torch]
        [--threads 1,4] [--huge-pages] [--repeat 1] [--json OUT.json]

CKPT is a model folder (e.g. from tests/perf/make_mixtral_checkpoint.py) or a .gguf file. Its files are read
once first, so every run reads from the page cache. Each configuration (banks x threads, --repeat times)
loads in a fresh child process, as `moedesk serve` does up to its "load done" line (the experts into host
banks, the other weights to the device), and reports:

- GB/s: the checkpoint's bytes over the time from opening it to the banks being ready (CUDA's start-up is
  timed apart, as `cuda_init`);
- where that time went: build (the model on the meta device), plain (the other weights to the device),
  experts (the expert tensors copied into the banks), pin wait (page-locking still under way after the last
  tensor), and for the arena banks pin (the registrations' own time, overlapping the copies) and allocate;
  for torch's pinned banks, allocate is cudaHostAlloc's zero-fill and lock;
- RSS after the load over the checkpoint's size (with its RssAnon / RssFile / RssShmem parts) and the
  process's peak RSS (VmHWM: the load is what sets it) over the checkpoint's size;
- on CUDA: whether every bank is pinned, and one layer's experts copied to the GPU with non_blocking=True:
  GB/s, and how long the host took to queue them (far less than the copy when the copies are asynchronous).

banks: `arena` is the engine's (engine.offload.pinned_memory: exact-size anonymous memory per layer, locked
with cudaHostRegister once filled); `torch` is what the engine did before: torch.empty(pin_memory=True) per
stack (cudaHostAlloc, sizes rounded up). threads: expert tensors copied at once (engine.load.loader).
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GB = 1e9


def weight_files(model: Path) -> list[Path]:
    return [model] if model.is_file() else sorted(model.glob("*.safetensors"))


def read_once(files: list[Path]) -> tuple[int, float]:
    """Read every weight file once (into the page cache); (bytes, seconds)."""
    total, started = 0, time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    return total, time.perf_counter() - started


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class TorchPinnedBanks:
    """The engine's banks before engine.offload.pinned_memory: one torch allocation per stack, pinned by torch's
    host allocator when a GPU is there (kept here as the comparison)."""

    def __init__(self, dtype, pinned: bool):
        self.dtype, self.pinned = dtype, pinned
        self.stats = {"allocate_s": 0.0}

    def __call__(self, model, formats):
        from moedesk.kernels.expert_weights import ExpertWeights

        started = time.perf_counter()
        banks = {}
        for moe in model.moe_blocks():
            p = moe.experts
            moe.experts = banks[moe.layer] = ExpertWeights.empty(
                p.num_experts, p.hidden, p.width, dtype=self.dtype, gate_up_format=formats[moe.layer][0],
                down_format=formats[moe.layer][1], pin_memory=self.pinned)
        self.stats["allocate_s"] += time.perf_counter() - started
        return banks


def child(config: dict) -> dict:
    import torch

    from moedesk.engine.load.checkpoint import open_checkpoint
    from moedesk.engine.load.loader import load_model, resolve_device, resolve_dtype
    from moedesk.engine.offload.pinned_memory import HostBanks

    device = resolve_device(config["device"])
    dtype = resolve_dtype(config["dtype"], device)
    cuda = device.type == "cuda"
    result = {"config": config, "device": str(device), "rss_before": status_bytes("VmRSS")}
    if cuda:
        started = time.perf_counter()
        torch.empty(1, device=device)
        torch.cuda.synchronize()
        result["cuda_init_s"] = time.perf_counter() - started
        result["gpu"] = torch.cuda.get_device_name(device)
    warnings: list[str] = []
    if config["banks"] == "arena":
        banks_of = HostBanks(dtype, pinned=cuda, warnings=warnings, huge_pages=config["huge_pages"])
    else:
        banks_of = TorchPinnedBanks(dtype, pinned=cuda)
    timings: dict = {}
    started = time.perf_counter()
    checkpoint = open_checkpoint(config["model"])
    opened = time.perf_counter()
    model, cfg, banks = load_model(checkpoint, dtype, device, 256, None, banks_of, "auto",
                                   threads=config["threads"], timings=timings)
    if cuda:
        torch.cuda.synchronize()
    result["load_s"] = time.perf_counter() - started
    result["parts_s"] = {"open": opened - started, **timings, **{k: v for k, v in banks_of.stats.items()
                                                                 if k.endswith("_s")}}
    result["bank_bytes"] = sum(b.nbytes for b in banks.values())
    result["banks_stats"] = banks_of.stats
    result["warnings"] = warnings
    del checkpoint
    gc.collect()
    result["rss_after"] = status_bytes("VmRSS")
    result["rss_parts"] = {k: status_bytes(k) for k in ("RssAnon", "RssFile", "RssShmem")}
    result["peak_rss"] = status_bytes("VmHWM")
    if cuda and banks:
        result["all_pinned"] = all(b.is_pinned() for b in banks.values())
        first = next(iter(banks.values()))
        staging = first.empty_like(device)
        torch.cuda.synchronize()
        for _ in range(2):  # the second is timed: the first also sets up the copy path
            started = time.perf_counter()
            staging.copy_(first, non_blocking=True)
            queued = time.perf_counter()
            torch.cuda.synchronize()
            ended = time.perf_counter()
        result["copy"] = {"bytes": first.nbytes, "gb_s": first.nbytes / GB / (ended - started),
                          "queue_ms": (queued - started) * 1e3, "total_ms": (ended - started) * 1e3}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--banks", default="arena", help="comma-separated: arena, torch")
    parser.add_argument("--threads", default="", help="comma-separated expert copy threads (default: the engine's)")
    parser.add_argument("--huge-pages", action="store_true", help="arena banks in transparent huge pages")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    files = weight_files(args.model)
    if not files:
        raise SystemExit(f"{args.model}: no .safetensors files (or not a .gguf file)")
    size, seconds = read_once(files)
    print(f"{args.model}: {size / GB:.2f} GB in {len(files)} file(s); read once in {seconds:.1f} s "
          f"({size / GB / seconds:.2f} GB/s)")
    runs = []
    threads = [int(t) for t in args.threads.split(",") if t] or [None]
    for _ in range(args.repeat):
        for banks in args.banks.split(","):
            for t in threads:
                config = {"model": str(args.model), "device": args.device, "dtype": args.dtype, "banks": banks,
                          "threads": t, "huge_pages": args.huge_pages}
                done = subprocess.run([sys.executable, __file__, str(args.model), "--child", json.dumps(config)],
                                      cwd=REPO, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{config}: failed\n{done.stderr[-3000:]}")
                r = json.loads(done.stdout.strip().splitlines()[-1])
                r["checkpoint_bytes"] = size
                runs.append(r)
                report(r, size)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


def report(r: dict, size: int) -> None:
    c = r["config"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in r["parts_s"].items())
    rss = ", ".join(f"{k} {v / GB:.2f}" for k, v in r["rss_parts"].items())
    print(f"\n[{c['banks']}{' huge pages' if c['huge_pages'] else ''}, threads {c['threads'] or 'default'}, "
          f"{r['device']}{', ' + r['gpu'] if 'gpu' in r else ''}]")
    cuda = f" (CUDA start-up {r['cuda_init_s']:.2f} s apart)" if "cuda_init_s" in r else ""
    print(f"  load      {r['load_s']:.2f} s = {size / GB / r['load_s']:.2f} GB/s from page cache{cuda}")
    print(f"  parts (s) {parts}")
    locked = {k.removesuffix("_bytes"): v / GB for k, v in r["banks_stats"].items() if k.endswith("_bytes")}
    locked = "; " + ", ".join(f"{k} {v:.3f} GB" for k, v in locked.items()) if locked else ""
    print(f"  banks     {r['bank_bytes'] / GB:.3f} GB of experts{locked}")
    print(f"  RSS after {r['rss_after'] / GB:.2f} GB = {r['rss_after'] / size:.3f}x the checkpoint ({rss}; "
          f"{r['rss_before'] / GB:.2f} before loading)")
    print(f"  peak RSS  {r['peak_rss'] / GB:.2f} GB = {r['peak_rss'] / size:.3f}x")
    if "copy" in r:
        k = r["copy"]
        print(f"  pinned    {r['all_pinned']}; one layer to the GPU non_blocking: {k['bytes'] / GB:.2f} GB at "
              f"{k['gb_s']:.1f} GB/s, queued in {k['queue_ms']:.2f} ms of {k['total_ms']:.1f} ms")
    for w in r["warnings"]:
        print(f"  warning   {w}")


if __name__ == "__main__":
    main()
