/* The format step of one elementwise family OPT (the host defines OPT and includes this after
 * optirs_formats.cl): kernel OPT_fmt decodes the parameters (or masters), gradients
 * and state, runs the family's element step (OPT_element_v8, the float32 step's math) and
 * encodes everything back, over the chunks its work-group takes. skip[off.skip] != 0 (AMP's
 * found_inf) makes the launch write nothing. */
#define FMT_CAT_(a, b) a##b
#define FMT_CAT(a, b) FMT_CAT_(a, b)

#if FMT_NUM_PATH
/* Whether none of the round's values that a bfloat16 encoder takes is NaN: the new parameter (its
 * NaN implies the state's for a family of FMT_NAN_IN_PARAM_), else each value encoded. */
int FMT_CAT(OPT, _fmt_num)(float8 pp, const float8 *s)
{
#if FMT_CAT(FMT_NAN_IN_PARAM_, OPT) && !FMT_USED(2)
    return !any(isnan(pp));
#else
    int8 bad = FMT_NUM_PARAM ? isnan(pp) : (int8)0;
#pragma unroll
    for (int j = 0; j < 3; ++j)
        if (OPTIRS_FMT_STATE == 1 && FMT_USED(j))
            bad |= isnan(s[j]);
    return !any(bad);
#endif
}
#endif

/* One round of the step: the work-item's elements k.. of the chunk, nv of its 8 in it. */
FMT_INLINE void FMT_CAT(OPT, _fmt_round)(__global PST *p, __global MST *m, __global const GST *g, const fmt_slots *sl,
                                         int k, int nv, int aligned, long lay, uint key, __local const float *lmaps,
                                         __local const uchar *ltables, __local const uint *lpacked,
                                         __local uint *scratch, const FMT_CAT(OPT, _scalars) *sc)
{
    float8 s[3], pp, gv;
    const uint8 idx = fmt_index8(lay, k);
    fmt_load_round(p, m, g, sl, k, nv, lmaps, &pp, &gv, s);
    if (nv > 0) {
        FMT_CAT(OPT, _element_v8)(&pp, gv, &s[0], &s[1], &s[2], sc);
#if FMT_NUM_PATH
        if (nv >= 8 && aligned && FMT_CAT(OPT, _fmt_num)(pp, s)) {
            fmt_store_master_num(pp, p + k, m + k, idx, key);
#if OPTIRS_FMT_STATE == 1
            fmt_store_states_num(sl, k, s, idx);
            return; /* the round's every store is done (no barrier below for bfloat16 state) */
#endif
        } else
#endif
            fmt_store_master(pp, p + k, m + k, nv, aligned, idx, key);
    }
    fmt_store_states(sl, k, nv, s, idx, lmaps, ltables, lpacked, scratch);
}

__kernel FMT_WG_ATTR
void FMT_CAT(OPT, _fmt)(SLOT_PARAMS(P, PST), SLOT_PARAMS(G, const GST), FMT_BUFFER_PARAMS, FMT_TABLE_PARAMS,
                        __global const int *skip, const fmt_step st, const FMT_CAT(OPT, _scalars) sc)
{
    FMT_WRITER_START
    FMT_CHUNKS_BEGIN(P, G)
        FMT_STATE_CHUNK
        /* FMT_FULL_ROUNDS: an aligned, coded chunk's rounds whose every work-item holds 8 elements
         * (all but a tensor's last) in a loop of their own, compiled with those as constants: no
         * test of a work-item's count or of the small-tensor path in it, and the general round's
         * values and branches not live there (the work-group's count, alignment and kind are
         * uniform, so the barriers of fmt_store_states are reached by all) */
        int full_ = 0;
#if FMT_FULL_ROUNDS
        fmt_slots slf = sl;
        slf.is_small = 0;
        slf.aligned = 1;
        if (aligned && !sl.is_small) {
            full_ = n_ - n_ % FMT_ROUND;
            for (int base_ = 0; base_ < full_; base_ += FMT_ROUND)
                FMT_CAT(OPT, _fmt_round)(p, m, g, &slf, base_ + 8 * lid, 8, 1, lay, key, lmaps, ltables, lpacked,
                                         scratch, &sc);
        }
#endif
        for (int base_ = full_; base_ < n_; base_ += FMT_ROUND) {
            const int k = base_ + 8 * lid;
            FMT_CAT(OPT, _fmt_round)(p, m, g, &sl, k, clamp(n_ - k, 0, 8), aligned, lay, key, lmaps, ltables, lpacked,
                                     scratch, &sc);
        }
    FMT_CHUNKS_END
    (void)scratch;
}

#undef FMT_CAT
#undef FMT_CAT_
