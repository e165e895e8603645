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

__kernel FMT_WG_ATTR
void FMT_CAT(OPT, _fmt)(SLOT_PARAMS(P, PST), SLOT_PARAMS(G, const GST), FMT_BUFFER_PARAMS, FMT_TABLE_PARAMS,
                        __global const int *skip, const fmt_step st, const FMT_CAT(OPT, _scalars) sc)
{
    FMT_WRITER_START
    FMT_CHUNKS_BEGIN(P, G)
        FMT_STATE_CHUNK
        FMT_ROUND_BEGIN
            float8 s[3], pp, gv;
            const uint8 idx = fmt_index8(lay, k);
            fmt_load_round(p, m, g, &sl, k, nv, lmaps, &pp, &gv, s);
            if (nv > 0) {
                FMT_CAT(OPT, _element_v8)(&pp, gv, &s[0], &s[1], &s[2], &sc);
#if FMT_NUM_PATH
                if (nv >= 8 && aligned && FMT_CAT(OPT, _fmt_num)(pp, s)) {
                    fmt_store_master_num(pp, p + k, m + k, idx, key);
#if OPTIRS_FMT_STATE == 1
                    fmt_store_states_num(&sl, k, s, idx);
                    continue; /* the round's every store is done (no barrier below for bfloat16 state) */
#endif
                } else
#endif
                    fmt_store_master(pp, p + k, m + k, nv, aligned, idx, key);
            }
            fmt_store_states(&sl, k, nv, s, idx, lmaps, ltables, lpacked, scratch);
        FMT_ROUND_END
    FMT_CHUNKS_END
    (void)scratch;
}

#undef FMT_CAT
#undef FMT_CAT_
