// A bf16 Llama decoder stack in one call: every layer's projections, norms, cache write and
// attention, by calling this library's kernels in the order and with the arguments
// LlamaModel.forward passes them one by one from Python (model/llama.py), so the result is
// bit-identical to that forward.
//
// Why: at batch 1 the kernels of a 30-layer step take ~12.5 ms and the Python between them
// (~8 calls a layer: argument checks, views, allocations, ctypes conversions) another ~2.5 ms,
// 15 % of the step. The step's per-sequence arguments (slots, block tables, context lengths,
// shared-prefix groups) are the same for every layer, so Python builds them once and this loop
// walks the layers. It is the CPU's counterpart of replaying a CUDA graph, without the static
// buffers: the loop takes the step's pointers as they are.
#include <stdint.h>
#include <string.h>
#include "gemm_grouped.h"

extern "C" void add_rms_norm_bf16(uint16_t* h, const uint16_t* delta, int64_t delta_stride, const uint16_t* w,
                                  uint16_t* out, int64_t T, int64_t H, float eps);
extern "C" void store_kv_pairs(const uint16_t* k, const uint16_t* v, const int64_t* slots, int64_t T,
                               int64_t k_stride, int64_t v_stride, uint16_t* k_cache, uint16_t* v_cache,
                               int hkv, int dh, int bs);
extern "C" void score_blocks_bf16(const uint16_t* q, int64_t q_stride, int64_t n, int64_t last, int64_t stride,
                                  const uint16_t* k_cache, const int64_t* bt, int64_t seq_len, int hq, int hkv,
                                  int dh, int bs, float scale, float* out);

namespace {

// gemm_bf16 / gemm_bf16_amx over packed bf16 panels, or gemm_q4_1_amx / gemm_q8_0_amx over GGUF
// codes: whichever each Linear layer holds its weight for.
typedef void (*GemmFn)(const uint16_t* x, int64_t M, int64_t K, const void* weight, int64_t N, uint16_t* y,
                       int kind, const uint16_t* cos, const uint16_t* sin_signed, int64_t head_dim,
                       int64_t rope_cols);
// paged_attention_bf16_d{64,128} (paged_attention_bf16.cpp's PA_ENTRY).
typedef int (*AttentionFn)(const void* q, void* out, const int64_t* q_start, const int64_t* q_len, int64_t q_stride,
                           int64_t out_stride, const void* k, const void* v, const int64_t* bt, int64_t bt_stride,
                           const int64_t* seq_lens, int n, int hq, int hkv, int bs, float scale, int64_t window,
                           int ngroups, const int64_t* group_start, const int64_t* group_members,
                           const int64_t* group_prefix);
// gemm_*_amx_lora: GemmFn's arguments and a LoRA expand in the product (gemm_grouped.h).
typedef void (*LoRAGemmFn)(const uint16_t* x, int64_t M, int64_t K, const void* weight, int64_t N, uint16_t* y,
                           int kind, const uint16_t* cos, const uint16_t* sin_signed, int64_t head_dim,
                           int64_t rope_cols, const LoRAExt* lora);

}  // namespace

// One projection: its kernel and the weight operand that kernel reads, and the same kernel with
// a LoRA expand (null where there is none).
struct Projection {
    GemmFn gemm;
    const void* weight;
    LoRAGemmFn lora_gemm;
};

// One layer's weights and KV blocks; field order is cpu_decoder.py's LayerC.
struct DecoderLayer {
    Projection qkv;      // [hidden -> q + 2 kv], rotary epilogue
    Projection o;        // [q -> hidden]
    Projection gate_up;  // [hidden -> 2 inter], SiLU-mul epilogue
    Projection down;     // [inter -> hidden]
    const uint16_t* input_norm;
    const uint16_t* post_attn_norm;
    uint16_t* k_cache;  // this layer's blocks, "pairs" layout
    uint16_t* v_cache;
};

// The LoRA adapter slots, packed (model/lora.py's LoRASlots), fixed at load (cpu_decoder.py's
// LoRAC). For fused projection g (qkv, o, gate_up, down), layer l and slot j: each of its parts'
// A (parts[g] of them) as a packed weight [shrink_rows, in] at a[g] + (l * num_slots + j) *
// a_stride[g] + part * shrink_rows * in, whose product with x is that part's columns of the row's
// block of s (block[g] / parts[g] apart); and B as LoRAExt reads it at b[g] + l * num_slots *
// b_stride[g] (slot stride b_stride[g]).
struct DecoderLoRA {
    GemmGroupedFn shrink;
    const uint16_t* a[4];
    const uint16_t* b[4];
    int64_t a_stride[4], b_stride[4], block[4], parts[4];
    const int32_t* panel_koff[4];
    int64_t rank, shrink_rows;
    int64_t num_slots;
};

// The model's shapes and kernels, fixed at load (cpu_decoder.py's ModelC).
struct DecoderModel {
    AttentionFn attention;
    const DecoderLayer* layers;
    int num_layers;
    const uint16_t* final_norm;
    int64_t hidden, inter;
    int hq, hkv, head_dim;
    int qkv_epilogue, gate_up_epilogue;  // gemm_epilogue.h kinds (rotary, SiLU-mul)
    float eps, scale;
    int64_t window;  // sliding window (0: none)
    const DecoderLoRA* lora;  // null without --enable-lora
};

// One step's rows and per-sequence arguments (cpu_decoder.py's StepC).
struct DecoderStep {
    int64_t T;  // rows (tokens) of the step
    uint16_t* h;  // [T, hidden] residual stream, embedded tokens in, updated in place
    uint16_t* x;  // [T, hidden] out: the final-normed hidden states
    uint16_t* qkv;  // [T, q + 2 kv] scratch
    uint16_t* attn;  // [T, q] scratch
    uint16_t* proj;  // [T, hidden] scratch
    uint16_t* act;  // [T, inter] scratch
    const uint16_t* cos;  // [T, head_dim]
    const uint16_t* sin_signed;
    const int64_t* slots;  // [T]
    int n;  // sequences
    const int64_t* q_start;
    const int64_t* q_len;
    const int64_t* block_tables;
    int64_t bt_stride;
    const int64_t* seq_lens;
    int block_size;
    int ngroups;  // shared-prefix groups (paged_attention_bf16.cpp's cascade)
    const int64_t* group_start;
    const int64_t* group_members;
    const int64_t* group_prefix;
    // Rows whose final hidden states are wanted, strictly ascending (n_out < T), or null: all.
    // The last layer's o projection and MLP run on those rows only: the other rows' outputs feed
    // nothing (their K and V, what later tokens read, come from its q/k/v projection).
    const int64_t* out_rows;
    int64_t n_out;
    // Score-based KV compression (h2o, snapkv): sequences whose attention per block is summed
    // over the layers into scores[k * bt_stride + block] (zeroed by the caller), from the query
    // rows score_rows[2k] (the chunk's last that many) taken every score_rows[2k + 1]-th;
    // the other rows pay nothing.
    int n_score;
    const int64_t* score_seqs;
    const int64_t* score_rows;
    float* scores;
    // Rows that run with an adapter: nseg segments (slot, lo, hi), ascending, base rows outside
    // them; row_slot [T] each row's slot or -1. seg_out and row_slot_out: the same over the rows
    // out_rows keeps, numbered as positions in out_rows.
    int nseg;
    const int64_t* seg;
    const int32_t* row_slot;
    int nseg_out;
    const int64_t* seg_out;
    const int32_t* row_slot_out;
    uint16_t* lora_s[4];  // per projection [T, num_slots * block]: zeros, the shrinks go in here
};

namespace {

// The shrink of projection g's input x [T, K] for every segment (one grouped call), each row's
// into its slot's block of s; returns the LoRAExt with which g's product adds the expand.
LoRAExt lora_shrink(const DecoderModel* m, const DecoderStep* s, int l, int g, const int64_t* seg, int nseg,
                    const int32_t* row_slot, const uint16_t* x, int64_t K) {
    const DecoderLoRA& L = *m->lora;
    const int64_t W = L.block[g], ld = L.num_slots * W, P = L.parts[g], R = L.shrink_rows;
    GemmProblem p[64];
    int n = 0;
    for (int i = 0; i < nseg; ++i) {
        const int64_t* sg = seg + 3 * i;
        const int64_t slot = sg[0], lo = sg[1];
        for (int64_t part = 0; part < P; ++part) {
            p[n++] = {x + lo * K, sg[2] - lo, K, L.a[g] + (l * L.num_slots + slot) * L.a_stride[g] + part * R * K, R,
                      s->lora_s[g] + lo * ld + slot * W + part * (W / P), 0, nullptr, nullptr, 0, 0, ld};
            if (n == 64) {
                L.shrink(p, n);
                n = 0;
            }
        }
    }
    if (n) L.shrink(p, n);
    return {s->lora_s[g], ld, W, row_slot, L.b[g] + l * L.num_slots * L.b_stride[g], L.b_stride[g], L.rank,
            L.panel_koff[g]};
}

}  // namespace

// Returns 0, or the attention kernel's nonzero code (a build or block size it has no instance for).
extern "C" int run_decoder_bf16(const DecoderModel* m, const DecoderStep* s) {
    int64_t T = s->T;
    const int64_t H = m->hidden, D = m->head_dim;
    const int64_t q_size = (int64_t)m->hq * D, kv_size = (int64_t)m->hkv * D, n_qkv = q_size + 2 * kv_size;
    add_rms_norm_bf16(s->h, nullptr, 0, m->layers[0].input_norm, s->x, T, H, m->eps);
    // The adapter rows' segments and slots; over the kept rows after the last layer's gather.
    const int64_t* sg = s->seg;
    const int32_t* rs = s->row_slot;
    int ns = m->lora ? s->nseg : 0;
    for (int i = 0; i < m->num_layers; ++i) {
        const DecoderLayer& L = m->layers[i];
        if (ns) {
            const LoRAExt e = lora_shrink(m, s, i, 0, sg, ns, rs, s->x, H);
            L.qkv.lora_gemm(s->x, T, H, L.qkv.weight, n_qkv, s->qkv, m->qkv_epilogue, s->cos, s->sin_signed, D,
                            q_size + kv_size, &e);
        } else {
            L.qkv.gemm(s->x, T, H, L.qkv.weight, n_qkv, s->qkv, m->qkv_epilogue, s->cos, s->sin_signed, D,
                       q_size + kv_size);
        }
        store_kv_pairs(s->qkv + q_size, s->qkv + q_size + kv_size, s->slots, T, n_qkv, n_qkv, L.k_cache, L.v_cache,
                       m->hkv, (int)D, s->block_size);
        const int rc = m->attention(s->qkv, s->attn, s->q_start, s->q_len, n_qkv, q_size, L.k_cache, L.v_cache,
                                    s->block_tables, s->bt_stride, s->seq_lens, s->n, m->hq, m->hkv, s->block_size,
                                    m->scale, m->window, s->ngroups, s->group_start, s->group_members,
                                    s->group_prefix);
        if (rc != 0) return rc;
        for (int k = 0; k < s->n_score; ++k) {
            const int64_t j = s->score_seqs[k];
            score_blocks_bf16(s->qkv + s->q_start[j] * n_qkv, n_qkv, s->q_len[j], s->score_rows[2 * k],
                              s->score_rows[2 * k + 1], L.k_cache,
                              s->block_tables + j * s->bt_stride, s->seq_lens[j], m->hq, m->hkv, (int)D,
                              s->block_size, m->scale, s->scores + k * s->bt_stride);
        }
        if (i + 1 == m->num_layers && s->out_rows && s->n_out < T) {
            // Rows gathered in place: out_rows[r] >= r, so no row is read after it is overwritten.
            for (int64_t r = 0; r < s->n_out; ++r) {
                const int64_t from = s->out_rows[r];
                if (from == r) continue;
                memcpy(s->attn + r * q_size, s->attn + from * q_size, q_size * 2);
                memcpy(s->h + r * H, s->h + from * H, H * 2);
            }
            T = s->n_out;
            if (T == 0) return 0;
            if (ns) {
                // The kept rows' shrinks go into rows of s that held other rows' (maybe in
                // other slots' blocks): cleared first.
                for (int g = 1; g < 4; ++g)
                    memset(s->lora_s[g], 0, T * m->lora->num_slots * m->lora->block[g] * 2);
                sg = s->seg_out;
                ns = s->nseg_out;
                rs = s->row_slot_out;
            }
        }
        if (ns) {
            const LoRAExt e = lora_shrink(m, s, i, 1, sg, ns, rs, s->attn, q_size);
            L.o.lora_gemm(s->attn, T, q_size, L.o.weight, H, s->proj, 0, nullptr, nullptr, 0, 0, &e);
        } else {
            L.o.gemm(s->attn, T, q_size, L.o.weight, H, s->proj, 0, nullptr, nullptr, 0, 0);
        }
        add_rms_norm_bf16(s->h, s->proj, H, L.post_attn_norm, s->x, T, H, m->eps);
        if (ns) {
            const LoRAExt e = lora_shrink(m, s, i, 2, sg, ns, rs, s->x, H);
            L.gate_up.lora_gemm(s->x, T, H, L.gate_up.weight, 2 * m->inter, s->act, m->gate_up_epilogue, nullptr,
                                nullptr, 0, 0, &e);
        } else {
            L.gate_up.gemm(s->x, T, H, L.gate_up.weight, 2 * m->inter, s->act, m->gate_up_epilogue, nullptr,
                           nullptr, 0, 0);
        }
        if (ns) {
            const LoRAExt e = lora_shrink(m, s, i, 3, sg, ns, rs, s->act, m->inter);
            L.down.lora_gemm(s->act, T, m->inter, L.down.weight, H, s->proj, 0, nullptr, nullptr, 0, 0, &e);
        } else {
            L.down.gemm(s->act, T, m->inter, L.down.weight, H, s->proj, 0, nullptr, nullptr, 0, 0);
        }
        const uint16_t* next_norm = i + 1 < m->num_layers ? m->layers[i + 1].input_norm : m->final_norm;
        add_rms_norm_bf16(s->h, s->proj, H, next_norm, s->x, T, H, m->eps);
    }
    return 0;
}
