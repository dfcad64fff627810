// AMX tile configuration and the process's permission to use the tiles (gemm_amx.cpp and the
// attention kernels' AMX paths).
#pragma once
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

struct alignas(64) TileConfig {  // LDTILECFG's 64-byte operand, palette 1
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Linux hands out AMX tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); torch asks too when oneDNN first uses AMX, so asking again is harmless.
inline bool permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

}  // namespace amx
