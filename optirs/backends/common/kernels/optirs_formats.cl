/* The step formats' kernels (docs/formats.md; host: optirs/backends/opencl/formats.py).
 *
 * One program per format, family and set of state slots, specialised at build time by the host's
 * defines:
 *   OPTIRS_FMT_PARAM   parameter storage: 0 float32, 1 bfloat16, 2 float16 (16-bit as ushort bits)
 *   OPTIRS_FMT_GRAD    gradient storage, the same codes
 *   OPTIRS_FMT_MASTER  0 none, 1 float32, 2 remainder16 (short), 3 remainder8 (char)
 *   OPTIRS_FMT_STATE   0 float32, 1 bfloat16 (ushort bits, stochastic rounding), 2 int8 blocks
 *                      (the dynamic map), 3 int8 blocks of square-root codes (no map), 4 blocks of
 *                      float8_e4m3fn codes (no map)
 *   OPTIRS_FMT_SR      1: bfloat16 parameters without masters round stochastically
 *   OPTIRS_FMT_USED    bit k: state slot k is stored (an absent slot costs no code or registers)
 *   OPTIRS_FMT_SIGNED  bit k: state slot k takes the signed int8 map (or signed square-root codes)
 *   OPTIRS_FMT_LAMB    1: the program holds LAMB's passes
 * so a launch has no per-element branch on the format or the slots. A model is one launch (per
 * OPTIRS_SLOTS distinct buffers of each kind) of a resident grid: each work-group
 * takes chunks of OPTIRS_CHUNK elements of one tensor from a counter until none are left (a
 * work-group that starts late finds none: the grid may exceed what stays resident), each
 * work-item eight consecutive elements per round (one 16-byte load of 16-bit parameters; vector
 * pointer loads where the tensor's offsets are 8-element aligned, vload8 otherwise, element by
 * element at a tensor's ragged end).
 *
 * int8 state: a block of 256 elements is 32 consecutive work-items (a chunk starts on a block
 * boundary: OPTIRS_CHUNK is a multiple of 256), its absmax reduced in registers over the 8 lanes,
 * then in local memory over the 32 work-items; the maps are copied to local memory once per
 * work-group (the binary search's addresses differ per lane, which __constant memory serialises).
 * Square-root codes take the same blocks and scales, but their codes are arithmetic: no map, no
 * local memory beyond the portable absmax tree.
 * Every barrier is in code the whole work-group runs (chunk and round loops have uniform trip
 * counts).
 *
 * The host appends `#define OPT F` + optirs_formats_step.h (the kernel F_fmt) for the program's
 * elementwise family F.
 */
#pragma OPENCL FP_CONTRACT OFF /* no a*b+c -> fma contraction: same rounding as the numba backends */

#include "optirs_program.h"
#if OPTIRS_WG % 32 != 0 || OPTIRS_CHUNK % (8 * OPTIRS_WG) != 0
#error "the format kernels need OPTIRS_WG a multiple of 32 and OPTIRS_CHUNK a multiple of 8 * OPTIRS_WG"
#endif
#define FMT_ROUND (8 * OPTIRS_WG)
#ifndef OPTIRS_FMT_USED
#define OPTIRS_FMT_USED 0
#endif
#ifndef OPTIRS_FMT_SIGNED
#define OPTIRS_FMT_SIGNED 0
#endif
#ifndef OPTIRS_FMT_LAMB
#define OPTIRS_FMT_LAMB 0
#endif
#ifndef OPTIRS_NV_WARP
#define OPTIRS_NV_WARP 0 /* fmt_warp_max */
#endif
/* The kernels' work-group size attribute, left out where the host caps the registers
 * (OPTIRS_FMT_MAXREG, with NVIDIA's -cl-nv-maxrregcount): ptxas ignores a register cap for a kernel
 * whose PTX has .reqntid (ptxas 13.5 on the driver's own PTX of the int8 programs: 80 registers
 * with the cap of 64 asked, 64 without the directive), so the cap took no effect. */
#ifndef OPTIRS_FMT_MAXREG
#define OPTIRS_FMT_MAXREG 0
#endif
#if OPTIRS_FMT_MAXREG
#define FMT_WG_ATTR
#else
#define FMT_WG_ATTR __attribute__((reqd_work_group_size(OPTIRS_WG, 1, 1)))
#endif
#define FMT_USED(k) ((OPTIRS_FMT_USED >> (k)) & 1)
#define FMT_SIGNED(k) ((OPTIRS_FMT_SIGNED >> (k)) & 1)
/* int8 blocks (either code), and the dynamic map's codes alone (its maps in local memory) */
#define FMT_INT8 (OPTIRS_FMT_STATE == 2 || OPTIRS_FMT_STATE == 3 || OPTIRS_FMT_STATE == 4)
#define FMT_MAP (OPTIRS_FMT_STATE == 2)

#include "optirs_scalars.h"
#include "optirs_formats.h"
/* OPTIRS_SLOTS buffer slots of each kind (as many as the device's kernel argument space holds):
 * SLOT_PARAMS(X, TY), the arguments X0..; PICK(s, X), slot s's buffer; DEAL_CHUNK (FMT_DEAL_CHUNK
 * deals as it does, a ticket ahead). */
#include "optirs_chunks.h"

#define T float8
#define SUFFIX v8
#include "optirs_elementwise.h"

/* The uniform element step of each elementwise family, (p, g, s0, s1, s2) -> updated in place,
 * as element_update of optirs/backends/common/elementwise.py; slots a family or an option does
 * not use are carried untouched. */
void adam_element_v8(T *p, T g, T *s0, T *s1, T *s2, const adam_scalars *sc) { adam_update_v8(p, g, s0, s1, s2, sc); }
void sgd_element_v8(T *p, T g, T *s0, T *s1, T *s2, const sgd_scalars *sc) { sgd_update_v8(p, g, s0, sc); }
void rmsprop_element_v8(T *p, T g, T *s0, T *s1, T *s2, const rmsprop_scalars *sc) { rmsprop_update_v8(p, g, s0, s1, s2, sc); }
void adagrad_element_v8(T *p, T g, T *s0, T *s1, T *s2, const adagrad_scalars *sc) { adagrad_update_v8(p, g, s0, sc); }
void lion_element_v8(T *p, T g, T *s0, T *s1, T *s2, const lion_scalars *sc) { lion_update_v8(p, g, s0, sc); }
void nadam_element_v8(T *p, T g, T *s0, T *s1, T *s2, const nadam_scalars *sc) { nadam_update_v8(p, g, s0, s1, sc); }
void radam_element_v8(T *p, T g, T *s0, T *s1, T *s2, const radam_scalars *sc) { radam_update_v8(p, g, s0, s1, sc); }
void adamax_element_v8(T *p, T g, T *s0, T *s1, T *s2, const adamax_scalars *sc) { adamax_update_v8(p, g, s0, s1, sc); }
void adadelta_element_v8(T *p, T g, T *s0, T *s1, T *s2, const adadelta_scalars *sc) { adadelta_update_v8(p, g, s0, s1, sc); }
void asgd_element_v8(T *p, T g, T *s0, T *s1, T *s2, const asgd_scalars *sc) { asgd_update_v8(p, g, s0, sc); }
void rprop_element_v8(T *p, T g, T *s0, T *s1, T *s2, const rprop_scalars *sc) { rprop_update_v8(p, g, s0, s1, sc); }
#undef T
#undef SUFFIX

/* FMT_NAN_IN_PARAM_<family>: the family's new parameter is NaN wherever one of its new state values
 * is (without the slot 2 of amsgrad, whose fmax drops a NaN): Adam's p - step * m / (sqrt(v) / c +
 * eps) takes m and v through arithmetic alone, and a NaN operand makes a NaN result. A NaN-free
 * round (fmt_num) then tests the parameter alone. */
#define FMT_NAN_IN_PARAM_adam 1

/* Inlined whatever its size, where the compiler takes the attribute (clang-based ones: PoCL left
 * fmt_load_round a call per round, which made the float32-state kernels about 1.4x slower there). */
#ifdef __clang__
#define FMT_INLINE __attribute__((always_inline))
#else
#define FMT_INLINE
#endif

/* ---------------------------------------------------------------- 8-lane loads and stores */

/* The 8 words of element type ST at an 8-element aligned address, read and written as 32-bit
 * words: PTX has no vector access wider than 4 elements, so NVIDIA's compiler splits an 8 x 16-bit
 * vector into two 8-byte accesses and 8 x 8-bit into two 4-byte ones (the dumped PTX of every
 * compact format: twice the loads and stores of the CUDA kernels' ld.v4.u32 / ld.v2.u32). The
 * halves and bytes are taken apart and put together by shifts, not by a vector reinterpretation,
 * which LLVM folds back into the 8-element access. */
#define FMT_VLD_float(a) (*(__global const float8 *)(a))
#define FMT_VST_float(x, a) (*(__global float8 *)(a) = (x))
#define FMT_HALVES(w) (uint8)((w).s0, (w).s0 >> 16, (w).s1, (w).s1 >> 16, (w).s2, (w).s2 >> 16, (w).s3, (w).s3 >> 16)
#define FMT_BYTES(w)                                                                             \
    (uint8)((w).s0, (w).s0 >> 8, (w).s0 >> 16, (w).s0 >> 24, (w).s1, (w).s1 >> 8, (w).s1 >> 16, (w).s1 >> 24)
#define FMT_PAIRS(u) (uint4)((u).s0 | (u).s1 << 16, (u).s2 | (u).s3 << 16, (u).s4 | (u).s5 << 16, (u).s6 | (u).s7 << 16)
#define FMT_QUADS(u)                                                                             \
    (uint2)((u).s0 | (u).s1 << 8 | (u).s2 << 16 | (u).s3 << 24, (u).s4 | (u).s5 << 8 | (u).s6 << 16 | (u).s7 << 24)
ushort8 FMT_VLD_ushort(__global const ushort *a) { return convert_ushort8(FMT_HALVES(*(__global const uint4 *)a)); }
short8 FMT_VLD_short(__global const short *a) { return as_short8(convert_ushort8(FMT_HALVES(*(__global const uint4 *)a))); }
uchar8 FMT_VLD_uchar(__global const uchar *a) { return convert_uchar8(FMT_BYTES(*(__global const uint2 *)a)); }
char8 FMT_VLD_char(__global const char *a) { return as_char8(convert_uchar8(FMT_BYTES(*(__global const uint2 *)a))); }
void FMT_VST_ushort(ushort8 x, __global ushort *a) { const uint8 u = convert_uint8(x); *(__global uint4 *)a = FMT_PAIRS(u); }
void FMT_VST_short(short8 x, __global short *a) { const uint8 u = convert_uint8(as_ushort8(x)); *(__global uint4 *)a = FMT_PAIRS(u); }
void FMT_VST_uchar(uchar8 x, __global uchar *a) { const uint8 u = convert_uint8(x); *(__global uint2 *)a = FMT_QUADS(u); }
void FMT_VST_char(char8 x, __global char *a) { const uint8 u = convert_uint8(as_uchar8(x)); *(__global uint2 *)a = FMT_QUADS(u); }

/* nv lanes valid (8: all); aligned: the address is 8-element aligned (one vector access). */
#define FMT_LOAD_STORE(ST, VT)                                                                   \
    VT load8_##ST(__global const ST *p, int nv, int aligned)                                     \
    {                                                                                            \
        if (nv >= 8)                                                                             \
            return aligned ? FMT_VLD_##ST(p) : vload8(0, p);                                     \
        ST a[8];                                                                                 \
        for (int j = 0; j < 8; ++j)                                                              \
            a[j] = j < nv ? p[j] : (ST)0;                                                        \
        return vload8(0, a);                                                                     \
    }                                                                                            \
    void store8_##ST(VT x, __global ST *p, int nv, int aligned)                                  \
    {                                                                                            \
        if (nv >= 8) {                                                                           \
            if (aligned)                                                                         \
                FMT_VST_##ST(x, p);                                                              \
            else                                                                                 \
                vstore8(x, 0, p);                                                                \
            return;                                                                              \
        }                                                                                        \
        ST a[8];                                                                                 \
        vstore8(x, 0, a);                                                                        \
        for (int j = 0; j < nv; ++j)                                                             \
            p[j] = a[j];                                                                         \
    }
FMT_LOAD_STORE(float, float8)
FMT_LOAD_STORE(ushort, ushort8)
FMT_LOAD_STORE(short, short8)
FMT_LOAD_STORE(char, char8)
FMT_LOAD_STORE(uchar, uchar8)

/* bfloat16 words wide (optirs_formats.h): the 8 at p, each in the high half of its word, and
 * their store from the high halves (the low halves undefined). */
uint8 load8_wide(__global const ushort *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        return optirs_bf16_wide8(*(__global const uint4 *)p);
    return convert_uint8(load8_ushort(p, nv, aligned)) << 16;
}
void store8_wide(uint8 w, __global ushort *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        *(__global uint4 *)p = optirs_pack_high16x4(w);
    else
        store8_ushort(convert_ushort8(w >> 16), p, nv, aligned);
}
#define FMT_VLD_WIDE(a) optirs_bf16_wide8(*(__global const uint4 *)(a))
#define FMT_VLDU_WIDE(a) (convert_uint8(vload8(0, a)) << 16)

/* int8 codes one to a word (optirs_codes8), loaded and stored as wide words are. */
uint8 load8_codes(__global const uchar *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        return optirs_codes8(*(__global const uint2 *)p);
    return convert_uint8(load8_uchar(p, nv, aligned));
}
void store8_codes(uint8 c, __global uchar *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        *(__global uint2 *)p = optirs_pack_codes8(c);
    else
        store8_uchar(convert_uchar8(c), p, nv, aligned);
}

/* Square-root codes as loaded (8 bytes, element 4i + j in word i's byte j), and stored from
 * optirs_sqrt_words8's words (each code in its low byte). */
uint2 load8_bytes(__global const uchar *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        return *(__global const uint2 *)p;
    const uint8 u = convert_uint8(load8_uchar(p, nv, aligned));
    return FMT_QUADS(u);
}
/* Codes packed four to a word (element 4i + j in word i's byte j), as stored. */
void store8_quads(uint2 q, __global uchar *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        *(__global uint2 *)p = q;
    else
        store8_uchar(convert_uchar8(FMT_BYTES(q)), p, nv, aligned);
}
void store8_byte0(uint8 w, __global uchar *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        *(__global uint2 *)p = optirs_pack_byte0x8(w);
    else
        store8_uchar(convert_uchar8(w & 0xFFu), p, nv, aligned);
}

/* ... of the packed quantizer's words (each code in byte 2, bits 24-31 zero). */
void store8_codes_byte2(uint8 w, __global uchar *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        *(__global uint2 *)p = optirs_pack_byte2x8(w);
    else
        store8_uchar(convert_uchar8(w >> 16), p, nv, aligned);
}

/* remainder16 masters as remainder words (optirs_r16_words8), and their store from the master's bits
 * (the remainder is the low half). */
uint8 load8_r16words(__global const short *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        return optirs_r16_words8(*(__global const uint4 *)p);
    return as_uint8(convert_int8(load8_short(p, nv, aligned)));
}
void store8_r16words(uint8 u, __global short *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        *(__global uint4 *)p = optirs_pack_low16x4(u);
    else
        store8_short(as_short8(convert_ushort8(u)), p, nv, aligned);
}

/* remainder8 masters as remainder words (optirs_r8_words8), and their store from the rounding words
 * (optirs_round24_word8: each remainder in byte 1). */
uint8 load8_r8words(__global const char *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        return optirs_r8_words8(*(__global const uint2 *)p);
    return optirs_r8_words_of(load8_char(p, nv, aligned));
}
void store8_r8words(uint8 t, __global char *p, int nv, int aligned)
{
    if (nv >= 8 && aligned)
        *(__global uint2 *)p = (uint2)(optirs_pack_byte1x4(t.s0, t.s1, t.s2, t.s3), optirs_pack_byte1x4(t.s4, t.s5, t.s6, t.s7));
    else
        store8_char(as_char8(convert_uchar8(t >> 8)), p, nv, aligned);
}

/* Storage of the parameters (PST), gradients (GST), masters (MST) and state slots (SST), the
 * vector of 8 of their words (PV, GV, MV, SV; bfloat16: wide words, each value in the high half of
 * its word; float16 parameters and gradients: their values, converted as they are read),
 * X_WORDS(p, nv, al) the 8 words at p, X_VLD / X_VLDU(a) one aligned / unaligned vector of them,
 * P_DECODE / G_DECODE the words as float32 and P_STORE the parameters' rounding and store
 * (stochastic rounding and remainders aside). */
#if OPTIRS_FMT_PARAM == 0
typedef float PST;
typedef float8 PV;
#define P_WORDS load8_float
#define P_VLD FMT_VLD_float
#define P_DECODE(w) (w)
#elif OPTIRS_FMT_PARAM == 1
typedef ushort PST;
typedef uint8 PV; /* wide */
#define P_WORDS load8_wide
#define P_VLD FMT_VLD_WIDE
#define P_VLDU FMT_VLDU_WIDE
#define P_DECODE(w) as_float8(w) /* a wide word is the value's float32 bits (optirs_bf16_decode8 says why) */
#define P_STORE(x, p, nv, al) store8_wide(optirs_bf16_rne_wide8(as_uint8(x)), p, nv, al)
#else
typedef ushort PST;
typedef float8 PV; /* float16: converted as it is loaded (optirs_f16_load8), the "words" are the values */
#define P_WORDS optirs_f16_load8
#define P_VLD(a) vloada_half8(0, (__global const half *)(a))
#define P_VLDU(a) vload_half8(0, (__global const half *)(a))
#define P_DECODE(w) (w)
#define P_STORE(x, p, nv, al) optirs_f16_store8(x, p, nv, al)
#endif
#ifndef P_VLDU
#define P_VLDU(a) vload8(0, a)
#endif
#define P_LOAD(p, nv, al) P_DECODE(P_WORDS(p, nv, al))

#if OPTIRS_FMT_GRAD == 0
typedef float GST;
typedef float8 GV;
#define G_WORDS load8_float
#define G_VLD FMT_VLD_float
#define G_DECODE(w) (w)
#elif OPTIRS_FMT_GRAD == 1
typedef ushort GST;
typedef uint8 GV; /* wide */
#define G_WORDS load8_wide
#define G_VLD FMT_VLD_WIDE
#define G_VLDU FMT_VLDU_WIDE
#define G_DECODE(w) as_float8(w) /* widened as unpacked (optirs_bf16_decode8 says why) */
#else
typedef ushort GST;
typedef float8 GV; /* float16: converted as it is loaded */
#define G_WORDS optirs_f16_load8
#define G_VLD(a) vloada_half8(0, (__global const half *)(a))
#define G_VLDU(a) vload_half8(0, (__global const half *)(a))
#define G_DECODE(w) (w)
#endif
#ifndef G_VLDU
#define G_VLDU(a) vload8(0, a)
#endif
#define M_VLDU(a) vload8(0, a)
#define G_LOAD(p, nv, al) G_DECODE(G_WORDS(p, nv, al))

/* Whether the parameters have masters to read (float32 parameters never do). */
#define FMT_HAS_MASTER (OPTIRS_FMT_PARAM != 0 && OPTIRS_FMT_MASTER != 0)
#if OPTIRS_FMT_MASTER == 2
typedef short MST;
typedef uint8 MV; /* remainder words: each remainder sign-extended (optirs_r16_words8) */
#define M_WORDS load8_r16words
#define M_VLD(a) optirs_r16_words8(*(__global const uint4 *)(a))
#undef M_VLDU
#define M_VLDU(a) as_uint8(convert_int8(vload8(0, a)))
#elif OPTIRS_FMT_MASTER == 3
typedef char MST;
typedef uint8 MV; /* remainder words: each remainder sign-extended in bits 8 and up (optirs_r8_words8) */
#define M_WORDS load8_r8words
#define M_VLD(a) optirs_r8_words8(*(__global const uint2 *)(a))
#undef M_VLDU
#define M_VLDU(a) optirs_r8_words_of(vload8(0, a))
#else
typedef float MST; /* float32 masters; a dummy buffer without masters */
typedef float8 MV;
#define M_WORDS load8_float
#define M_VLD FMT_VLD_float
#endif

#if OPTIRS_FMT_STATE == 1
typedef ushort SST;
typedef uint8 SV; /* wide */
#define S_WORDS load8_wide
#define S_VLD FMT_VLD_WIDE
#define S_VLDU FMT_VLDU_WIDE
#elif OPTIRS_FMT_STATE == 2
typedef uchar SST; /* codes */
typedef uint8 SV; /* one to a word */
#define S_WORDS load8_codes
#define S_VLD(a) optirs_codes8(*(__global const uint2 *)(a))
#define S_VLDU(a) convert_uint8(vload8(0, a))
#elif OPTIRS_FMT_STATE == 3 || OPTIRS_FMT_STATE == 4
typedef uchar SST; /* square-root or float8 codes */
typedef uint2 SV; /* the 8 bytes as loaded: the decode unpacks them (square-root codes: knowing the slot's sign) */
#define S_WORDS load8_bytes
#define S_VLD(a) (*(__global const uint2 *)(a))
#define S_VLDU(a) FMT_QUADS(convert_uint8(vload8(0, a)))
#else
typedef float SST;
typedef float8 SV;
#define S_WORDS load8_float
#define S_VLD FMT_VLD_float
#endif
#ifndef S_VLDU
#define S_VLDU(a) vload8(0, a)
#endif

/* ---------------------------------------------------------------- per-launch records */

/* Element offsets of the state buffers in their cl_mem (pyopencl arrays may be views). */
typedef struct {
    long m, s0, s1, s2, c0, c1, c2, l0, l1, l2, skip;
} fmt_offsets;

/* seed, step: the random bits' key inputs. */
typedef struct {
    uint seed, step;
} fmt_step;

/* Tensor table row (long8): x param offset, y grad offset (elements, in their slot's buffer),
 * z layout offset (the state index and the random bits' counter base), w size, s4 first int8
 * block (-1: none), s5 offset in the small-tensor float32 state (-1: int8 blocks), s6 flags:
 * param slot | grad slot << 8 | 8-element aligned << 16. */
#define FMT_TABLE_PARAMS __global const long8 *tens, DEAL_PARAMS

#define FMT_BUFFER_PARAMS                                                                        \
    __global MST *M, __global SST *S0, __global SST *S1, __global SST *S2, __global float *C0,   \
    __global float *C1, __global float *C2, __global float *L0, __global float *L1,              \
    __global float *L2, __global const float *maps, const fmt_offsets off

/* Where one tensor's state lives, gathered once per work-group (private pointers to global memory). */
typedef struct {
    __global SST *s[3];       /* values or codes, at the tensor's first element */
    __global float *scale[3]; /* int8: the tensor's first block's scale */
    __global float *small[3]; /* int8 small tensors: their float32 state */
    int is_small, aligned;
    uint key[2]; /* bfloat16 state: the random keys of stream 1 (slots 0 and 1) and stream 2 (slot 2) */
} fmt_slots;

/* ---------------------------------------------------------------- dealing chunks */

/* The chunk work-item 0 takes for the work-group (FMT_DEAL_CHUNK). */
typedef struct {
    uint taken;
    int t;
    long start;
    __global PST *p;
    __global const GST *g;
} fmt_deal;

/* optirs_chunks.h's DEAL_CHUNK with the ticket taken a chunk ahead: work-item 0 holds the
 * work-group's next ticket (ahead_, taken when the previous chunk was dealt, or at the start) and
 * takes the following one as it deals, so the atomic's round trip runs under the chunk's rounds
 * instead of holding the whole work-group at the barrier (a chunk is 2 rounds of 128 x 8 elements;
 * the CUDA kernels deal chunks statically, without atomics). A work-group still takes one ticket
 * per chunk it runs plus the one that finds none, so a launch moves the counter as before. */
#define FMT_DEAL_CHUNK(D, P, G, PSLOT, GSLOT) \
    DEAL_CHUNK_AT(D, P, G, PSLOT, GSLOT, ahead_, ahead_ = atomic_inc(tickets))

/* A launch that writes nothing (found_inf) advances the counter as much as a full one. */
void fmt_skip_tickets(__global volatile uint *tickets, uint nchunks)
{
    if (get_group_id(0) == 0 && get_local_id(0) == 0)
        atomic_add(tickets, nchunks + (uint)get_num_groups(0));
}

/* The loop over the chunks the work-group takes: chunk c of tensor t (its table row), its first
 * element start (of the tensor), its n_ elements, and the parameter and gradient pointers p and g
 * and the layout offset lay of that first element. Every array's chunk base is computed here, once
 * per chunk in 64 bits; a round adds its 32-bit offset k (64-bit index arithmetic per round and
 * array cost the CUDA kernels about 2 instructions an element). */
#define FMT_CHUNKS_BEGIN(P, G)                                                                   \
    __local fmt_deal deal_;                                                                      \
    const int lid = (int)get_local_id(0);                                                        \
    uint ahead_ = lid == 0 ? atomic_inc(tickets) : 0u;                                           \
    for (;;) {                                                                                   \
        FMT_DEAL_CHUNK(deal_, P, G, (int)(tens[t].s6 & 0xFF), (int)((tens[t].s6 >> 8) & 0xFF))\
        if (deal_.taken >= nchunks)                                                              \
            break;                                                                               \
        const uint c = chunk_base + deal_.taken;                                                 \
        const int t = deal_.t;                                                                   \
        const long8 row = tens[t];                                                               \
        const int aligned = (int)((row.s6 >> 16) & 1);                                           \
        const long start = deal_.start;                                                          \
        const int n_ = (int)(min(start + (long)OPTIRS_CHUNK, row.s3) - start);                   \
        __global PST *p = deal_.p + row.s0 + start;                                              \
        __global const GST *g = deal_.g + row.s1 + start;                                        \
        const long lay = row.s2 + start;
#define FMT_CHUNKS_END }

/* The writing kernels' start: found_inf skips the launch (uniform: every work-item returns), the
 * int8 maps' local memory, the random key of the parameters' stream. */
#define FMT_WRITER_START                                                                         \
    if (skip[off.skip]) {                                                                        \
        fmt_skip_tickets(tickets, nchunks);                                                      \
        return;                                                                                  \
    }                                                                                            \
    __local float lmaps[FMT_MAP ? 1024 : 1];                                                     \
    __local uchar ltables[FMT_MAP ? OPTIRS_QT_SIZE : 1];                                         \
    __local uint lpacked[FMT_MAP ? OPTIRS_QT_WIDTH : 1];                                         \
    __local uint scratch[FMT_INT8 && !OPTIRS_NV_WARP ? 3 * OPTIRS_WG : 1];                       \
    int maps_ready = 0;                                                                          \
    const uint key = optirs_rand_key(st.seed, st.step, 0u);

/* A chunk's start in the kernels that read the state: the maps in local memory (at the
 * work-group's first chunk: a late work-group that finds no chunk loads nothing), the master
 * pointer m and the state slots sl. */
#define FMT_STATE_CHUNK                                                                          \
    if (!maps_ready) {                                                                           \
        fmt_load_maps(maps, lmaps, ltables, lpacked);                                            \
        maps_ready = 1;                                                                          \
    }                                                                                            \
    __global MST *m = M + off.m + lay;                                                           \
    const fmt_slots sl = fmt_slots_of(row.s4, row.s5, start, lay, aligned, S0, S1, S2, C0, C1, C2, L0, L1, L2, off, st);

/* Local copies of the two int8 maps: [signed q, signed mid, unsigned q, unsigned mid], the signed
 * map's bucket table (stored after the maps as floats, kept here as bytes), and the unsigned map's
 * packed words (optirs_packed_word, from its bucket table's positive half, stored after the signed
 * table, and its midpoints): its codes take one local load an element. */
void fmt_load_maps(__global const float *maps, __local float *lmaps, __local uchar *ltables, __local uint *lpacked)
{
#if FMT_MAP
    for (int j = get_local_id(0); j < 1024; j += OPTIRS_WG)
        lmaps[j] = maps[j];
    for (int j = get_local_id(0); j < (int)OPTIRS_QT_SIZE; j += OPTIRS_WG)
        ltables[j] = (uchar)maps[1024 + j];
    for (int b = get_local_id(0); b < (int)OPTIRS_QT_WIDTH; b += OPTIRS_WG) {
        const uint c = (uint)maps[1024 + OPTIRS_QT_SIZE + b];
        lpacked[b] = optirs_packed_word((uint)b, c, maps[768 + c]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
}

/* block: the tensor's first int8 block, small: its small-tensor state offset (the table row's s4,
 * s5); start: the chunk's first element (of the tensor; a multiple of the block), lay its layout
 * offset. The pointers are at the chunk's first element and block. */
fmt_slots fmt_slots_of(long block, long small, long start, long lay, int aligned, __global SST *S0, __global SST *S1, __global SST *S2,
                       __global float *C0, __global float *C1, __global float *C2, __global float *L0,
                       __global float *L1, __global float *L2, const fmt_offsets off, fmt_step st)
{
    fmt_slots sl;
    sl.s[0] = S0 + off.s0 + lay;
    sl.s[1] = S1 + off.s1 + lay;
    sl.s[2] = S2 + off.s2 + lay;
    sl.scale[0] = C0 + off.c0 + block + (start >> 8);
    sl.scale[1] = C1 + off.c1 + block + (start >> 8);
    sl.scale[2] = C2 + off.c2 + block + (start >> 8);
    sl.small[0] = L0 + off.l0 + small + start;
    sl.small[1] = L1 + off.l1 + small + start;
    sl.small[2] = L2 + off.l2 + small + start;
    sl.is_small = FMT_INT8 && small >= 0;
    sl.aligned = aligned;
    sl.key[0] = FMT_USED(0) || FMT_USED(1) ? optirs_rand_key(st.seed, st.step, OPTIRS_STATE_STREAM(0)) : 0u;
    sl.key[1] = FMT_USED(2) ? optirs_rand_key(st.seed, st.step, OPTIRS_STATE_STREAM(2)) : 0u;
    return sl;
}

/* ---------------------------------------------------------------- master weights */

/* The float32 value the step starts from, from 8 parameter words pw and their master words mw
 * (unused without masters). */
float8 fmt_master_of(PV pw, MV mw)
{
#if !FMT_HAS_MASTER
    return P_DECODE(pw);
#elif OPTIRS_FMT_MASTER == 1
    /* a master word of 0 (a fresh buffer, or +0.0 whose parameter is +0.0 too): the parameter */
    return select(mw, P_DECODE(pw), as_int8(mw) == (int8)(0));
#elif OPTIRS_FMT_MASTER == 2
    return as_float8(pw + mw); /* hi_w + the remainder sign-extended: optirs_r16_join_wide8 */
#else
    return as_float8(pw + mw); /* hi_w + the remainder's word: optirs_r8_join_wide8 */
#endif
}

/* The float32 value the step starts from, for the 8 elements at p (and m). */
float8 fmt_load_master(__global const PST *p, __global const MST *m, int nv, int al)
{
#if FMT_HAS_MASTER
    const MV mw = M_WORDS(m, nv, al);
#else
    const MV mw = (MV)0;
#endif
    return fmt_master_of(P_WORDS(p, nv, al), mw);
}

/* Store the new float32 value x: the parameter (and its master) as the format says. idx: the
 * elements' layout indices, for stochastic rounding (stream 0). */
void fmt_store_master(float8 x, __global PST *p, __global MST *m, int nv, int al, uint8 idx, uint key)
{
    const uint8 u = as_uint8(x);
#if OPTIRS_FMT_PARAM == 0
    store8_float(x, p, nv, al);
#elif OPTIRS_FMT_MASTER == 0
#if OPTIRS_FMT_SR
    store8_wide(optirs_bf16_sr_wide8(u, optirs_rand8(key, idx)), p, nv, al);
#else
    P_STORE(x, p, nv, al);
#endif
#elif OPTIRS_FMT_MASTER == 1
    store8_float(x, m, nv, al);
    P_STORE(x, p, nv, al);
#elif OPTIRS_FMT_MASTER == 2
    const uint8 q = optirs_quiet_nan_master8(u);
    store8_wide(optirs_r16_hi_wide8(q), p, nv, al);
    store8_r16words(q, m, nv, al);
#else
    /* optirs_r8_hi_wide8's high half and optirs_r8_split8's remainder from the unshifted rounding:
     * the byte below the kept 24 bits changes no carry into the high half (0x8000 is a multiple of
     * 256) */
    const uint8 t = optirs_round24_word8(u);
    store8_wide(t + 0x8000u, p, nv, al);
    store8_r8words(t, m, nv, al);
#endif
}

/* ---------------------------------------------------------------- NaN-free rounds

 * A round whose values to encode are known not to be NaN (fmt_num of optirs_formats_step.h, one test
 * a value or, for Adam, a parameter) with all 8 lanes full and aligned: its bfloat16 encodes without
 * the NaN test and select (the numba *_num encoders; the cuda kernels' fast path), the nearest
 * parameter pairs by cvt.rn.bf16x2.f32 (OPTIRS_NV_PTX >= 2), and every store of the round under the
 * one branch (each array's own full-lane test and branch region cost a few instructions a round).
 * FMT_NUM_PATH: the program has such encodes (bfloat16 state, or bfloat16 parameters rounded
 * without a remainder master). */
#ifndef OPTIRS_FMT_NUM
#define OPTIRS_FMT_NUM 1 /* 0: no NaN-free rounds (the host's OPTIRS_OPENCL_FORMATS_NUM=0, to compare) */
#endif
#define FMT_NUM_PARAM (OPTIRS_FMT_PARAM == 1 && OPTIRS_FMT_MASTER <= 1)
#define FMT_NUM_PATH (OPTIRS_FMT_NUM && (FMT_NUM_PARAM || OPTIRS_FMT_STATE == 1))

/* fmt_store_master for a NaN-free round, full and aligned. */
void fmt_store_master_num(float8 x, __global PST *p, __global MST *m, uint8 idx, uint key)
{
#if FMT_NUM_PARAM
#if OPTIRS_FMT_MASTER == 1
    FMT_VST_float(x, m);
#endif
#if OPTIRS_FMT_MASTER == 0 && OPTIRS_FMT_SR
    *(__global uint4 *)p = optirs_pack_high16x4(optirs_bf16_sr_wide8_num(as_uint8(x), optirs_rand8(key, idx)));
#else
    *(__global uint4 *)p = optirs_bf16_rne_pairs_num(x);
#endif
#else
    fmt_store_master(x, p, m, 8, 1, idx, key);
#endif
}

#if OPTIRS_FMT_STATE == 1
/* fmt_store_states of bfloat16 state for a NaN-free round, full and aligned. */
void fmt_store_states_num(const fmt_slots *sl, int k, const float8 *s, uint8 idx)
{
    const uint8 r01 = FMT_USED(0) || FMT_USED(1) ? optirs_rand8(sl->key[0], idx) : (uint8)0u;
    const uint8 r2 = FMT_USED(2) ? optirs_rand8(sl->key[1], idx) : (uint8)0u;
#pragma unroll
    for (int j = 0; j < 3; ++j)
        if (FMT_USED(j))
            *(__global uint4 *)(sl->s[j] + k) =
                optirs_pack_high16x4(optirs_bf16_sr_wide8_num(as_uint8(s[j]), optirs_slot_bits8(j < 2 ? r01 : r2, j)));
}
#endif

/* ---------------------------------------------------------------- state slots */

/* Slot j's values from its 8 words w: float32, bfloat16 (wide words: widened as unpacked,
 * optirs_bf16_decode8 says why), or int8 codes at their block's scale (square-root codes: the
 * block's decode factor taken here, once a round). */
float8 fmt_state_of(int j, SV w, float scale, __local const float *lmaps)
{
#if OPTIRS_FMT_STATE == 0
    return w;
#elif OPTIRS_FMT_STATE == 1
    return as_float8(w);
#elif OPTIRS_FMT_STATE == 3
    return optirs_sqrt_values8(w, FMT_SIGNED(j), scale);
#elif OPTIRS_FMT_STATE == 4
    return optirs_fp8_values8(w, scale);
#else
    return optirs_dequantize_codes8(w, scale, lmaps + (FMT_SIGNED(j) ? 0 : 512));
#endif
}

/* Elements k.. of the tensor (k a multiple of 8), nv of them valid; each slot loaded and decoded
 * in turn. */
void fmt_load_states(const fmt_slots *sl, int k, int nv, float8 *s, __local const float *lmaps)
{
#pragma unroll
    for (int j = 0; j < 3; ++j) {
        s[j] = (float8)0.0f;
        if (!FMT_USED(j) || nv <= 0)
            continue;
#if FMT_INT8
        if (sl->is_small) {
            s[j] = load8_float(sl->small[j] + k, nv, sl->aligned);
            continue;
        }
        const float scale = sl->scale[j][k >> 8];
#else
        const float scale = 0.0f;
#endif
        s[j] = fmt_state_of(j, S_WORDS(sl->s[j] + k, nv, sl->aligned), scale, lmaps);
    }
}

/* A full round's words of every array (and the int8 blocks' scales), loaded before any is used. */
typedef struct {
    PV p;
    GV g;
    MV m;
    SV s[3];
    float scale[3];
} fmt_words;

/* LD(X, a): the 8 words of array X (P, G, M, S) at a, every load of a round issued in one basic block. */
#define FMT_LD_ALIGNED(X, a) X##_VLD(a)
#define FMT_LD_VLOAD(X, a) X##_VLDU(a)
#define FMT_WORD_LOADS(LD)                                                                       \
    w->p = LD(P, p);                                                                             \
    w->g = LD(G, g);                                                                             \
    if (FMT_HAS_MASTER)                                                                          \
        w->m = LD(M, m);                                                                         \
    if (FMT_USED(0))                                                                             \
        w->s[0] = LD(S, sl->s[0] + k);                                                           \
    if (FMT_USED(1))                                                                             \
        w->s[1] = LD(S, sl->s[1] + k);                                                           \
    if (FMT_USED(2))                                                                             \
        w->s[2] = LD(S, sl->s[2] + k);

/* The 8 elements k.. of every array, all 8 in the chunk, state as values or codes (not a small
 * int8 tensor's float32 state). */
void fmt_load_words(fmt_words *w, __global const PST *p, __global const GST *g, __global const MST *m,
                    const fmt_slots *sl, int k)
{
#if FMT_INT8
#pragma unroll
    for (int j = 0; j < 3; ++j)
        w->scale[j] = FMT_USED(j) ? sl->scale[j][k >> 8] : 0.0f;
#else
    w->scale[0] = w->scale[1] = w->scale[2] = 0.0f;
#endif
    if (sl->aligned) {
        FMT_WORD_LOADS(FMT_LD_ALIGNED)
    } else {
        FMT_WORD_LOADS(FMT_LD_VLOAD)
    }
}

/* A round's inputs as float32: the value the step starts from (*pp), the gradients (*gv) and the
 * state slots (s; 0 for a slot not in use). Past the chunk (nv <= 0) only s is set, to 0.
 *
 * Compact state (bfloat16 or int8) leaves the kernel bound by latency and instructions: there a
 * full round issues every load (parameters, gradients, masters, state, scales) before unpacking
 * any, since a load whose words are used before the next one is issued exposes its whole latency
 * (the CUDA formats kernels measured -4 to -10% of kernel time on the H200). Float32 state keeps
 * the kernel bound by DRAM, where loading and decoding each array in turn measured 7% faster
 * (bf16 + float32 masters), so it keeps that order. */
FMT_INLINE void fmt_load_round(__global const PST *p, __global const MST *m, __global const GST *g, const fmt_slots *sl, int k,
                    int nv, __local const float *lmaps, float8 *pp, float8 *gv, float8 *s)
{
#if OPTIRS_FMT_STATE != 0
    if (nv >= 8 && !sl->is_small) {
        fmt_words w;
        fmt_load_words(&w, p + k, g + k, m + k, sl, k);
        *pp = fmt_master_of(w.p, w.m);
        *gv = G_DECODE(w.g);
#pragma unroll
        for (int j = 0; j < 3; ++j)
            s[j] = FMT_USED(j) ? fmt_state_of(j, w.s[j], w.scale[j], lmaps) : (float8)0.0f;
        return;
    }
#endif
    fmt_load_states(sl, k, nv, s, lmaps);
    if (nv > 0) {
        *pp = fmt_load_master(p + k, m + k, nv, sl->aligned);
        *gv = G_LOAD(g + k, nv, sl->aligned);
    }
}

#if FMT_INT8
/* A block's scale is the largest |x| of its new values, NaN-propagating (docs/formats.md: a NaN
 * makes the scale NaN; fmax would drop it). Taken over |x|'s bits as unsigned integers, whose order
 * is the order of the magnitudes with every NaN above inf: an AND and an integer max an element,
 * where the compare-and-select took three, and the reduction over the block is of integers (one
 * instruction for the whole warp below). A NaN block's scale is the NaN of the largest payload. */
uint fmt_lane_absmax(float8 x, int nv)
{
    const uint8 a = as_uint8(x) & 0x7FFFFFFFu;
    const uint8 v = select((uint8)0u, a, (int8)(0, 1, 2, 3, 4, 5, 6, 7) < nv);
    const uint4 h = max(v.lo, v.hi);
    const uint2 q = max(h.lo, h.hi);
    return max(q.lo, q.hi);
}

/* OPTIRS_NV_WARP (the host's define on NVIDIA's driver: 1, or 2 from sm_80 on): a block is the 32
 * work-items of one warp (consecutive local ids), so its maximum is a warp reduction in registers,
 * as the CUDA kernels' shfl.sync.bfly, through inline PTX: redux.sync.max.u32 (sm_80 on: one
 * instruction for the warp) or five shuffles. Elsewhere a tree in local memory over the 32
 * work-items, a barrier a level. */
#if OPTIRS_NV_WARP
uint fmt_warp_max(uint u)
{
#if OPTIRS_NV_WARP >= 2
    uint r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(u));
    return r;
#else
    for (uint k = 16; k > 0; k >>= 1) {
        uint o;
        asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(o) : "r"(u), "r"(k));
        u = max(u, o);
    }
    return u;
#endif
}
#endif
#endif

/* Store the slots' new values; int8 slots are requantized with their block's new scale (the map's
 * s[j] then becomes the stored, dequantized value; square-root codes leave s[j] as it is: nothing
 * reads it after the store). Called by the whole work-group (barriers). */
void fmt_store_states(const fmt_slots *sl, int k, int nv, float8 *s, uint8 idx, __local const float *lmaps,
                      __local const uchar *ltables, __local const uint *lpacked, __local uint *scratch)
{
#if FMT_INT8
    float scale[3];
#if OPTIRS_NV_WARP
#pragma unroll
    for (int j = 0; j < 3; ++j)
        scale[j] = FMT_USED(j) ? as_float(fmt_warp_max(nv > 0 ? fmt_lane_absmax(s[j], nv) : 0u)) : 0.0f;
#else
    const int lid = get_local_id(0);
#pragma unroll
    for (int j = 0; j < 3; ++j)
        if (FMT_USED(j))
            scratch[j * OPTIRS_WG + lid] = nv > 0 ? fmt_lane_absmax(s[j], nv) : 0u;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = 16; w > 0; w >>= 1) {
        if ((lid & 31) < w) {
#pragma unroll
            for (int j = 0; j < 3; ++j)
                if (FMT_USED(j))
                    scratch[j * OPTIRS_WG + lid] = max(scratch[j * OPTIRS_WG + lid], scratch[j * OPTIRS_WG + lid + w]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
#pragma unroll
    for (int j = 0; j < 3; ++j)
        scale[j] = FMT_USED(j) ? as_float(scratch[j * OPTIRS_WG + (lid & ~31)]) : 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE); /* scratch is reused by the next round */
#endif
#endif
    if (nv <= 0)
        return;
#if OPTIRS_FMT_STATE == 1
    /* the random words: one hash per element for slots 0 and 1 (halves of stream 1's), one for slot 2 */
    const uint8 r01 = FMT_USED(0) || FMT_USED(1) ? optirs_rand8(sl->key[0], idx) : (uint8)0u;
    const uint8 r2 = FMT_USED(2) ? optirs_rand8(sl->key[1], idx) : (uint8)0u;
#endif
#pragma unroll
    for (int j = 0; j < 3; ++j) {
        if (!FMT_USED(j))
            continue;
#if OPTIRS_FMT_STATE == 0
        store8_float(s[j], sl->s[j] + k, nv, sl->aligned);
#elif OPTIRS_FMT_STATE == 1
        const uint8 bits = optirs_bf16_sr_wide8(as_uint8(s[j]), optirs_slot_bits8(j < 2 ? r01 : r2, j));
        store8_wide(bits, sl->s[j] + k, nv, sl->aligned);
        s[j] = as_float8(bits & 0xFFFF0000u);
#else
        if (sl->is_small) {
            store8_float(s[j], sl->small[j] + k, nv, sl->aligned);
        } else {
#if OPTIRS_FMT_STATE == 3
            /* the block's factors once per work-item and block (a round is 8 of its elements) */
            store8_byte0(optirs_sqrt_block8(s[j], scale[j], FMT_SIGNED(j)), sl->s[j] + k, nv, sl->aligned);
            if ((k & 255) == 0) /* the block's first work-item */
                sl->scale[j][k >> 8] = scale[j];
#elif OPTIRS_FMT_STATE == 4
            store8_quads(optirs_fp8_block8(s[j], scale[j]), sl->s[j] + k, nv, sl->aligned);
            if ((k & 255) == 0) /* the block's first work-item */
                sl->scale[j][k >> 8] = scale[j];
#else
            __local const float *q = lmaps + (FMT_SIGNED(j) ? 0 : 512);
            /* the block's reciprocal once per work-item and block (a round is 8 of its elements) */
            uint8 code;
            if (FMT_SIGNED(j)) {
                code = optirs_quantize_block8(s[j], scale[j], nv >= 8, q + 256, ltables);
                store8_codes(code, sl->s[j] + k, nv, sl->aligned);
            } else {
                const uint8 words = optirs_quantize_block8_packed(s[j], scale[j], nv >= 8, lpacked);
                store8_codes_byte2(words, sl->s[j] + k, nv, sl->aligned);
                code = words >> 16;
            }
            if ((k & 255) == 0) /* the block's first work-item */
                sl->scale[j][k >> 8] = scale[j];
            s[j] = optirs_dequantize_codes8(code, scale[j], q);
#endif
        }
#endif
    }
}

uint8 fmt_index8(long lay, int k)
{
    return ((uint)lay + (uint)k) + (uint8)(0u, 1u, 2u, 3u, 4u, 5u, 6u, 7u);
}

/* A work-group's rounds over its chunk: element k = base + 8 * lid of the chunk, nv of its 8 in
 * it. The trip count is the same for the whole work-group (barriers inside are reached by all). */
#define FMT_ROUND_BEGIN                                                                          \
    for (int base_ = 0; base_ < n_; base_ += FMT_ROUND) {                                        \
        const int k = base_ + 8 * lid;                                                           \
        const int nv = clamp(n_ - k, 0, 8);
#define FMT_ROUND_END }

/* ---------------------------------------------------------------- the gradient check */

/* flag[0] = 1 when any gradient is not finite (reads only the gradients). */
__kernel FMT_WG_ATTR
void fmt_check(SLOT_PARAMS(P, PST), SLOT_PARAMS(G, const GST), FMT_TABLE_PARAMS, __global int *flag)
{
    int bad = 0;
    FMT_CHUNKS_BEGIN(P, G)
        FMT_ROUND_BEGIN
            if (nv > 0)
                bad |= any(!isfinite(G_LOAD(g + k, nv, aligned)));
        FMT_ROUND_END
        (void)p; (void)lay;
    FMT_CHUNKS_END
    if (bad)
        flag[0] = 1; /* every writer stores the same value */
}

#if OPTIRS_FMT_LAMB
/* ---------------------------------------------------------------- LAMB (two passes) */

acc_t fmt_sum_squares8(float8 x)
{
    return ((SQUARE(x.s0) + SQUARE(x.s1)) + (SQUARE(x.s2) + SQUARE(x.s3)))
         + ((SQUARE(x.s4) + SQUARE(x.s5)) + (SQUARE(x.s6) + SQUARE(x.s7)));
}

float8 fmt_valid(float8 x, int nv)
{
    return select((float8)0.0f, x, (int8)(0, 1, 2, 3, 4, 5, 6, 7) < nv);
}

/* Global gradient clipping, part 1: partial[c] = sum of g^2 over chunk c (part 2 is the float32
 * step's lamb_grad_scale). */
__kernel FMT_WG_ATTR
void fmt_lamb_grad_sumsq(SLOT_PARAMS(P, PST), SLOT_PARAMS(G, const GST), FMT_TABLE_PARAMS, __global acc_t *partial)
{
    __local acc_t red[OPTIRS_WG];
    FMT_CHUNKS_BEGIN(P, G)
        acc_t s = 0;
        FMT_ROUND_BEGIN
            if (nv > 0)
                s += fmt_sum_squares8(fmt_valid(G_LOAD(g + k, nv, aligned), nv));
        FMT_ROUND_END
        s = group_sum(s, red);
        if (lid == 0)
            partial[c] = s;
        (void)p; (void)lay;
    FMT_CHUNKS_END
}

/* LAMB's element work, the same in both passes: the new moments s[0], s[1] and the direction u
 * from the master pp, the gradients gv and the stored state (pass 1 writes nothing; pass 2
 * recomputes and writes). */
float8 fmt_lamb_element(float8 pp, float8 gv, float8 *s, float scale, const lamb_scalars *sc)
{
    lamb_moments_v8(gv, &s[0], &s[1], scale, sc);
    return lamb_direction_v8(pp, s[0], s[1], sc);
}

/* Pass 1: per-chunk sums of p^2 and u^2 (partial[2c], partial[2c + 1]). */
__kernel FMT_WG_ATTR
void fmt_lamb_norms(SLOT_PARAMS(P, PST), SLOT_PARAMS(G, const GST), FMT_BUFFER_PARAMS, FMT_TABLE_PARAMS,
                    __global const float *grad_scale, int clip, __global acc_t *partial, const fmt_step st,
                    const lamb_scalars sc)
{
    __local float lmaps[FMT_MAP ? 1024 : 1];
    __local uchar ltables[FMT_MAP ? OPTIRS_QT_SIZE : 1];
    __local uint lpacked[FMT_MAP ? OPTIRS_QT_WIDTH : 1];
    __local acc_t red[OPTIRS_WG];
    int maps_ready = 0;
    const float scale = clip ? grad_scale[0] : sc.grad_factor;  /* the clip factor carries grad_factor */
    FMT_CHUNKS_BEGIN(P, G)
        FMT_STATE_CHUNK
        acc_t sp = 0, su = 0;
        FMT_ROUND_BEGIN
            if (nv > 0) {
                float8 s[3], pp, gv;
                fmt_load_round(p, m, g, &sl, k, nv, lmaps, &pp, &gv, s);
                const float8 u = fmt_lamb_element(pp, gv, s, scale, &sc);
                sp += fmt_sum_squares8(fmt_valid(pp, nv));
                su += fmt_sum_squares8(fmt_valid(u, nv));
            }
        FMT_ROUND_END
        store_norm_partials(sp, su, red, partial, (size_t)c);
    FMT_CHUNKS_END
}

/* Pass 2: p -= lr * ratio * u, and the new moments stored in the state's format. */
__kernel FMT_WG_ATTR
void fmt_lamb_apply(SLOT_PARAMS(P, PST), SLOT_PARAMS(G, const GST), FMT_BUFFER_PARAMS, FMT_TABLE_PARAMS,
                    __global const float *grad_scale, int clip, __global const float *ratio,
                    __global const int *skip, const fmt_step st, const lamb_scalars sc)
{
    FMT_WRITER_START
    const float scale = clip ? grad_scale[0] : sc.grad_factor;
    FMT_CHUNKS_BEGIN(P, G)
        FMT_STATE_CHUNK
        const float step = sc.lr * ratio[t];
        FMT_ROUND_BEGIN
            float8 s[3], pp, gv;
            const uint8 idx = fmt_index8(lay, k);
            fmt_load_round(p, m, g, &sl, k, nv, lmaps, &pp, &gv, s);
            if (nv > 0) {
                const float8 u = fmt_lamb_element(pp, gv, s, scale, &sc);
                fmt_store_master(pp - step * u, p + k, m + k, nv, aligned, idx, key);
            }
            fmt_store_states(&sl, k, nv, s, idx, lmaps, ltables, lpacked, scratch);
        FMT_ROUND_END
    FMT_CHUNKS_END
    (void)scratch;
}
#endif

/* Lets the host check its numpy records against the structs. */
__kernel void fmt_struct_sizes(__global int *out)
{
    out[0] = (int)sizeof(fmt_offsets);
    out[1] = (int)sizeof(fmt_step);
    out[2] = (int)sizeof(acc_t);
}
