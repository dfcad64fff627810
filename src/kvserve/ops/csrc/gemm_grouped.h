// Plain-data arguments of gemm_amx.cpp's LoRA entry points, shared with decoder_bf16.cpp (which
// is compiled without AVX-512 headers).
#pragma once
#include <stdint.h>

// One product of gemm_bf16_amx_grouped: gemm_bf16_amx's arguments (y = epilogue(x W^T), W
// packed), and y's row stride (0: N). Several small products (a LoRA step's shrinks, one per
// segment of rows sharing an adapter) in one call share the cores, where each alone would pay a
// parallel region and leave a core idle.
struct GemmProblem {
    const uint16_t* x;
    int64_t M, K;
    const void* packed;
    int64_t N;
    uint16_t* y;
    int kind;  // gemm_epilogue.h's
    const uint16_t* cos;
    const uint16_t* sin_signed;
    int64_t head_dim, rope_cols;
    int64_t ldy;
};

typedef void (*GemmGroupedFn)(const GemmProblem* problems, int n);

// A LoRA expand inside a projection's product (gemm_*_amx_lora): y = epilogue(x W^T + s B_j^T)
// for each row, with B_j its adapter's (slot j's) up-projection, so the delta is added before the
// rotary or SiLU epilogue as PEFT adds it, in the same pass over y. s holds each row's shrink
// (x A_j^T) in slot j's block of columns and zeros in the other slots' blocks, so a 32-row chunk
// of rows with several adapters takes one k-step per adapter (and rank step) over its rows.
struct LoRAExt {
    const uint16_t* s;  // [M, ld_s]
    int64_t ld_s;  // elements per row of s: slots x block
    int64_t block;  // s columns per slot: each part's (q, k, v; gate, up) rank, rounded up to 32
    const int32_t* row_slot;  // [M] the row's slot, -1 for the base model; ascending over adapter rows
    const uint16_t* b;  // slot j's B at b + j * b_slot_stride: 16-column panels of `rank` k each
    int64_t b_slot_stride;
    int64_t rank;  // k of B per panel (even); a k-step reads 32, the rest multiplied by s's zeros
    const int32_t* panel_koff;  // [N / 16] the panel's part's first column in a slot's block of s
};
