"""GPU time of a call, for the gpu-marked tests that bound a kernel against a copy of the same bytes."""
import torch


def median_ms(fn, repeat: int = 20) -> float:
    """The median of `repeat` timed calls, in ms, after a warm-up (the kernel's compile)."""
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
