/* The format step of one elementwise family OPT (the host defines OPT and includes this after
 * optirs_formats.cl): kernel OPT_fmt decodes the parameters (or masters), gradients
 * and state, runs the family's element step (OPT_element_v8, the float32 step's math) and
 * encodes everything back, over the chunks its work-group takes. skip[off.skip] != 0 (AMP's
 * found_inf) makes the launch write nothing. */
#define FMT_CAT_(a, b) a##b
#define FMT_CAT(a, b) FMT_CAT_(a, b)

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
                fmt_store_master(pp, p + k, m + k, nv, aligned, idx, key);
            }
            fmt_store_states(&sl, k, nv, s, idx, lmaps, ltables, lpacked, scratch);
        FMT_ROUND_END
    FMT_CHUNKS_END
    (void)scratch;
}

#undef FMT_CAT
#undef FMT_CAT_
