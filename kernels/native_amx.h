/*
 * AMX tiles for the native CPU kernels: the tile configuration's layout, the tile instructions every AMX kernel
 * needs (ldtilecfg, tilerelease, tilezero, tileloadd, tilestored) as inline assembly, and the run-time check that the
 * CPU, the OS and Linux's per-process permission allow them. A kernel adds the dot-product instruction it uses
 * (tdpbf16ps in cpu_experts.c) beside these.
 *
 * Built with NATIVE_AMX_EMULATE defined, the instructions are done in C on per-thread state (as the tile
 * registers are per thread), so that the layouts and epilogues built on them are tested on CPUs without AMX;
 * a kernel's emulated dot product reads and writes `emu.t`.
 *
 * cpu_experts.c (AMX-BF16, tdpbf16ps) and cpu_quant.c (AMX-INT8, tdpbssd) include this.
 */
#ifndef MOEDESK_NATIVE_AMX_H
#define MOEDESK_NATIVE_AMX_H

#include <cpuid.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileCfg;

#ifdef NATIVE_AMX_EMULATE
static __thread struct { TileCfg cfg; _Alignas(64) uint8_t t[8][16][64]; } emu;
static inline void emu_zero(int t) { memset(emu.t[t], 0, sizeof emu.t[t]); }
static inline void emu_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < emu.cfg.rows[t]; r++) memcpy(emu.t[t][r], (const uint8_t *)p + r * stride, emu.cfg.colsb[t]);
}
static inline void emu_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < emu.cfg.rows[t]; r++) memcpy((uint8_t *)p + r * stride, emu.t[t][r], emu.cfg.colsb[t]);
}
#define TILE_CONFIG(p) (emu.cfg = *(p))
#define TILE_RELEASE() ((void)0)
#define TILE_ZERO(t) emu_zero(t)
#define TILE_LOAD(t, p, stride, obj) emu_load(t, p, stride)
#define TILE_STORE(t, p, stride, obj) emu_store(t, p, stride)
#else
/* By hand, with the memory each reads or writes as an operand (obj: a C object covering it): GCC 12's
 * _tile_loadd names no memory at all (the stores that fill a buffer only it reads could be dropped or sunk
 * past it), its _tile_stored clobbers all memory, its _tile_loadconfig names 8 of the 64 bytes. */
#define TILE_CONFIG(p) __asm__ volatile("ldtilecfg %0" ::"m"(*(const TileCfg *)(p)))
#define TILE_RELEASE() __asm__ volatile("tilerelease" ::)
#define TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TILE_LOAD(t, p, stride, obj) \
    __asm__ volatile("tileloadd (%1,%2,1), %%tmm" #t ::"m"(obj), "r"((const void *)(p)), "r"((long)(stride)))
#define TILE_STORE(t, p, stride, obj) \
    __asm__ volatile("tilestored %%tmm" #t ", (%1,%2,1)" : "=m"(obj) : "r"((void *)(p)), "r"((long)(stride)))
#endif

/* 0 where the CPU has AMX-TILE and the leaf-7 EDX feature bits `edx_bits` (AMX-BF16: 1 << 22, AMX-INT8: 1 << 25),
 * the OS saves the tile state (XCR0's XTILECFG and XTILEDATA) and Linux lets this process use the tile data
 * (arch_prctl ARCH_REQ_XCOMP_PERM; granted once, it holds for every thread of the process, and asking again is
 * harmless); else why not: -1 the CPU lacks them, -2 the OS does not enable their state, or the errno of Linux's
 * refusal (e.g. ENOSPC: a thread's sigaltstack is too small for the tile state). Callers cache the answer. */
static inline int amx_os_status(unsigned edx_bits) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || (d & edx_bits) != edx_bits) return -1;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return -2; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0x60000u) != 0x60000u) return -2; /* XTILECFG, XTILEDATA */
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return errno;
    return 0;
}

#endif
