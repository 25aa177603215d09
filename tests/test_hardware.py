"""Hardware detection: /proc/cpuinfo parsing on sample text, GPUs through a faked torch.cuda, fingerprints."""
import dataclasses

import torch

from moedesk.engine import hardware
from moedesk.engine.hardware import (
    CpuFeatures, GpuInfo, HardwareInfo, detect_hardware, features_from_torch_capability, format_hardware,
    machine_fingerprint, parse_cpu_flags, parse_cpu_model,
)

GiB = 2**30

_SPR_FLAGS = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss "
              "ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid pni pclmulqdq ssse3 fma cx16 "
              "pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch "
              "fsgsbase bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb "
              "avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat "
              "avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
              "avx512_vpopcntdq rdpid cldemote movdiri movdir64b md_clear serialize tsxldtrk amx_bf16 avx512_fp16 "
              "amx_tile amx_int8 flush_l1d arch_capabilities")


def x86_processor(index: int, name: str, flags: str) -> str:
    # The numeric `model` line comes before `model name`, as in real /proc/cpuinfo.
    return (f"processor\t: {index}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
            f"model name\t: {name}\nstepping\t: 8\ncpu MHz\t\t: 2000.000\nflags\t\t: {flags}\n"
            f"vmx flags\t: vnmi preemption_timer\nbugs\t\t: spectre_v1 spectre_v2\n\n")


SAPPHIRE_RAPIDS = "".join(x86_processor(i, "Intel(R) Xeon(R) Platinum 8480+", _SPR_FLAGS) for i in range(2))
ZEN2 = x86_processor(0, "AMD Ryzen 9 3900X 12-Core Processor",
                     "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2 sha_ni clzero")
RASPBERRY_PI = ("processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n"
                "CPU implementer\t: 0x41\nCPU part\t: 0xd08\n\nHardware\t: BCM2835\nRevision\t: c03111\n"
                "Model\t\t: Raspberry Pi 4 Model B Rev 1.1\n")


def test_sapphire_rapids_has_every_feature():
    assert parse_cpu_flags(SAPPHIRE_RAPIDS) == CpuFeatures(True, True, True, True, True, True)
    assert parse_cpu_model(SAPPHIRE_RAPIDS) == "Intel(R) Xeon(R) Platinum 8480+"


def test_zen2_has_avx2_only():
    features = parse_cpu_flags(ZEN2)
    assert features.names() == ["avx2"]
    assert parse_cpu_model(ZEN2) == "AMD Ryzen 9 3900X 12-Core Processor"


def test_only_features_of_every_processor_count():
    # A core without AVX-512 (hybrid parts, odd VMs) rules out AVX-512 kernels for the whole pool.
    mixed = SAPPHIRE_RAPIDS + x86_processor(2, "Intel(R) Xeon(R) Platinum 8480+", "fpu sse avx avx2 amx_bf16")
    assert parse_cpu_flags(mixed).names() == ["avx2", "amx_bf16"]


def test_similar_flag_names_do_not_count():
    # avx512_fp16 is not avx512f, amx_tile is not amx_int8, avx_vnni is not avx512_vnni.
    assert parse_cpu_flags(x86_processor(0, "x", "avx512_fp16 amx_tile avx_vnni avx512bw")).names() == []


def test_arm_and_empty_text():
    assert parse_cpu_flags(RASPBERRY_PI).names() == []
    assert parse_cpu_model(RASPBERRY_PI) == "Raspberry Pi 4 Model B Rev 1.1"
    assert parse_cpu_flags("") == CpuFeatures() and parse_cpu_model("") == ""
    assert parse_cpu_model("model\t\t: 143\n") == ""  # a model number is not a name


def test_torch_capability_fallback():
    assert features_from_torch_capability("AVX512").names() == ["avx2", "avx512f"]
    assert features_from_torch_capability("AVX2").names() == ["avx2"]
    assert features_from_torch_capability("DEFAULT").names() == []
    assert features_from_torch_capability("SVE256").names() == []


def test_detect_without_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(ZEN2)
    info = detect_hardware(cpuinfo)
    assert info.gpus == () and not info.has_gpu
    assert info.cpu_model == "AMD Ryzen 9 3900X 12-Core Processor" and info.cpu_features.names() == ["avx2"]
    assert info.ram_total_bytes >= info.ram_available_bytes > 0
    assert 1 <= info.physical_cores <= info.logical_cores


def test_detect_with_faked_gpus(monkeypatch):
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4060"]
    memory = [(70 * GiB, 79 * GiB), (7 * GiB, 8 * GiB)]  # (free, total), as mem_get_info returns
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: memory[i])
    info = detect_hardware()
    assert info.gpus == (GpuInfo(0, names[0], 79 * GiB, 70 * GiB), GpuInfo(1, names[1], 8 * GiB, 7 * GiB))


def test_without_cpuinfo_torch_decides(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "_torch_capability", lambda: "AVX2")
    info = detect_hardware(tmp_path / "missing")
    assert info.cpu_features.names() == ["avx2"] and info.torch_cpu_capability == "AVX2"
    assert info.cpu_model  # platform's name, or "unknown CPU"


def sample_info(**changes) -> HardwareInfo:
    info = HardwareInfo(cpu_model="Intel(R) Xeon(R) Platinum 8480+", physical_cores=16, logical_cores=32,
                        cpu_features=parse_cpu_flags(SAPPHIRE_RAPIDS), ram_total_bytes=125 * GiB + 12345,
                        ram_available_bytes=100 * GiB, gpus=(GpuInfo(0, "NVIDIA H100 80GB HBM3", 79 * GiB, 70 * GiB),),
                        torch_cpu_capability="AVX512")
    return dataclasses.replace(info, **changes)


def test_fingerprint_is_short_and_stable():
    fp = machine_fingerprint(sample_info())
    assert len(fp) == 16 and fp == machine_fingerprint(sample_info())
    # What moves between runs does not change it.
    assert fp == machine_fingerprint(sample_info(ram_available_bytes=3 * GiB, ram_total_bytes=125 * GiB + 999,
                                                 gpus=(GpuInfo(0, "NVIDIA H100 80GB HBM3", 79 * GiB, 1 * GiB),)))
    # What the profile depends on does.
    others = [sample_info(cpu_model="AMD EPYC 9654"), sample_info(physical_cores=8), sample_info(gpus=()),
              sample_info(ram_total_bytes=64 * GiB),
              sample_info(gpus=(GpuInfo(0, "NVIDIA H100 80GB HBM3", 94 * GiB, 70 * GiB),)),
              sample_info(gpus=(GpuInfo(0, "NVIDIA GeForce RTX 4090", 79 * GiB, 70 * GiB),))]
    prints = {machine_fingerprint(o) for o in others}
    assert fp not in prints and len(prints) == len(others)


def test_fingerprint_of_this_machine():
    assert machine_fingerprint() == machine_fingerprint()


def test_format_hardware():
    text = format_hardware(sample_info())
    assert "Xeon" in text and "16 cores / 32 threads" in text and "AMX_BF16" in text
    assert "GPU 0" in text and "NVIDIA H100 80GB HBM3, 79.0 GiB total, 70.0 GiB free" in text
    assert "125.0 GiB total" in text
    bare = format_hardware(sample_info(gpus=(), cpu_features=CpuFeatures()))
    assert "no CUDA GPU" in bare and "GPU 0" not in bare
    assert len(text.splitlines()) == 4
