/* The per-element optimizer math in OpenCL C, written once.
 *
 * This file is included twice by optirs_steps.cl: with T = float (names suffixed _v1) and with
 * T = float4 (suffixed _v4), so the scalar tail and the vector body run the same text. Every
 * formula mirrors optirs/backends/elementwise.py term by term and in the same order; with
 * FP_CONTRACT off (set in optirs_steps.cl) and correctly rounded division and sqrt, a float
 * element gets the same bits as on the numba backends.
 *
 * Expects: T, FN(name) (name with the suffix), and the structs of optirs_scalars.h.
 * The *_elem functions load element (or vector) i of the parameter/gradient and j of the
 * state, update, and store; state slots an option does not use are never touched.
 *
 * Every *_update starts with g = g * grad_factor (the last field of every scalars record: -1 for
 * maximize, 1 / scale to unscale), as the numba math does.
 *
 * As torch, weight_decay == 0 adds no decay term (so 0 * inf never makes an infinite weight NaN);
 * the test is on a scalar, the same for every element. The decoupled decays multiply by
 * decay_factor, exactly 1 when weight_decay is 0, which keeps every value as it is.
 */

/* ---------------------------------------------------------------- Adam / AdamW */

#include "optirs_ptx.h"

/* a / b for b in (0, 1], the same for every element (Adam's sqrt(1 - beta2^t)), and a a square root
 * of a non-negative float, 0, inf or NaN: the division's bits (optirs/backends/common/division.py,
 * the numba kernels' divide_by_uniform). With OPTIRS_NV_PTX the compiler's own fast path of div.rn
 * with the reciprocal's approximation and refinement taken once for the 8 lanes of a float8 (they
 * depend on b alone; clang + ptxas left them in the formats kernels' round loop, 3 instructions a
 * round) and no range check or slow path: q = a * y, r = fma(-b, q, a), q + r * y fused, 5
 * instructions an element where div.rn took about 11 and a branch region; 0, inf and NaN take
 * a * y, exact for them (the correction would make NaN of inf, or +0 of -0). Equal to the division
 * for the square root of every non-negative float32 and ten divisors on the H200 (the cuda
 * kernels' check; test_opencl_formats.py runs the same check on an NVIDIA OpenCL device).
 * Elsewhere the division itself (correctly rounded: -cl-fp32-correctly-rounded-divide-sqrt). */
T FN(divide_by_uniform)(T a, float b)
{
#if OPTIRS_NV_PTX
    const float y0 = OPTIRS_RCP_APPROX(b);
    const float y = fma(fma(-b, y0, 1.0f), y0, y0);
    const T q = a * y;
    const T corrected = fma(fma((T)(-b), q, a), (T)(y), q);
    return select(q, corrected, isgreater(a, (T)(0.0f)) & isless(a, (T)(INFINITY)));
#else
    return a / b;
#endif
}

void FN(adam_update)(T *p, T g, T *m, T *v, T *vmax, const adam_scalars *sc)
{
    g = g * sc->grad_factor;
    T pp = *p;
    if (sc->decoupled)
        pp = pp * sc->decay_factor;
    else if (sc->weight_decay != 0.0f)
        g = g + sc->weight_decay * pp;
    const T mm = sc->beta1 * *m + sc->one_minus_beta1 * g;
    const T vv = sc->beta2 * *v + sc->one_minus_beta2 * g * g;
    /* amsgrad divides the running maximum: one square root and one division in the code either
     * way (two copies of them, one per branch, was the compilers' choice) */
    T vs = vv;
    if (sc->amsgrad) {
        vs = fmax(*vmax, vv);
        *vmax = vs;
    }
#if defined(OPTIRS_FMT_APPROX) && OPTIRS_FMT_APPROX
    /* a tuning build of the formats programs: the device's approximate root and quotient */
    const T denom = native_sqrt(vs) * native_recip(sc->bias_correction2_sqrt) + sc->eps;
    *p = pp - native_divide(sc->step_size * mm, denom);
#else
    const T denom = FN(divide_by_uniform)(sqrt(vs), sc->bias_correction2_sqrt) + sc->eps;
    *p = pp - sc->step_size * mm / denom;
#endif
    *m = mm;
    *v = vv;
}

/* s0: exp_avg, s1: exp_avg_sq, s2: max_exp_avg_sq (amsgrad) */
void FN(adam_elem)(__global T *p, __global const T *g, __global T *s0, __global T *s1,
                          __global T *s2, size_t i, size_t j, const adam_scalars *sc)
{
    T pp = p[i], m = s0[j], v = s1[j], vm = m;
    if (sc->amsgrad)
        vm = s2[j];
    FN(adam_update)(&pp, g[i], &m, &v, &vm, sc);
    p[i] = pp;
    s0[j] = m;
    s1[j] = v;
    if (sc->amsgrad)
        s2[j] = vm;
}

/* ---------------------------------------------------------------- SGD */

void FN(sgd_update)(T *p, T g, T *buf, const sgd_scalars *sc)
{
    g = g * sc->grad_factor;
    if (sc->weight_decay != 0.0f)
        g = g + sc->weight_decay * *p;
    if (sc->has_momentum) {
        if (sc->first_step)
            *buf = g;
        else
            *buf = sc->momentum * *buf + sc->dampening_factor * g;
        if (sc->nesterov)
            g = g + sc->momentum * *buf;
        else
            g = *buf;
    }
    *p = *p - sc->lr * g;
}

/* s0: momentum_buffer (with momentum) */
void FN(sgd_elem)(__global T *p, __global const T *g, __global T *s0, __global T *s1,
                         __global T *s2, size_t i, size_t j, const sgd_scalars *sc)
{
    T pp = p[i], buf = pp;
    if (sc->has_momentum && !sc->first_step)
        buf = s0[j];
    FN(sgd_update)(&pp, g[i], &buf, sc);
    p[i] = pp;
    if (sc->has_momentum)
        s0[j] = buf;
}

/* ---------------------------------------------------------------- RMSprop */

void FN(rmsprop_update)(T *p, T g, T *square_avg, T *buf, T *grad_avg, const rmsprop_scalars *sc)
{
    g = g * sc->grad_factor;
    if (sc->weight_decay != 0.0f)
        g = g + sc->weight_decay * *p;
    *square_avg = sc->alpha * *square_avg + sc->one_minus_alpha * g * g;
    T avg;
    if (sc->centered) {
        *grad_avg = sc->alpha * *grad_avg + sc->one_minus_alpha * g;
        avg = sqrt(*square_avg - *grad_avg * *grad_avg) + sc->eps;
    } else {
        avg = sqrt(*square_avg) + sc->eps;
    }
    if (sc->has_momentum) {
        *buf = sc->momentum * *buf + g / avg;
        *p = *p - sc->lr * *buf;
    } else {
        *p = *p - sc->lr * g / avg;
    }
}

/* s0: square_avg, s1: momentum_buffer (momentum > 0), s2: grad_avg (centered) */
void FN(rmsprop_elem)(__global T *p, __global const T *g, __global T *s0, __global T *s1,
                             __global T *s2, size_t i, size_t j, const rmsprop_scalars *sc)
{
    T pp = p[i], sq = s0[j], buf = sq, ga = sq;
    if (sc->has_momentum)
        buf = s1[j];
    if (sc->centered)
        ga = s2[j];
    FN(rmsprop_update)(&pp, g[i], &sq, &buf, &ga, sc);
    p[i] = pp;
    s0[j] = sq;
    if (sc->has_momentum)
        s1[j] = buf;
    if (sc->centered)
        s2[j] = ga;
}

/* ---------------------------------------------------------------- Adagrad */

void FN(adagrad_update)(T *p, T g, T *acc, const adagrad_scalars *sc)
{
    g = g * sc->grad_factor;
    if (sc->weight_decay != 0.0f)
        g = g + sc->weight_decay * *p;
    *acc = *acc + g * g;
    *p = *p - sc->clr * g / (sqrt(*acc) + sc->eps);
}

/* s0: sum */
void FN(adagrad_elem)(__global T *p, __global const T *g, __global T *s0, __global T *s1,
                             __global T *s2, size_t i, size_t j, const adagrad_scalars *sc)
{
    T pp = p[i], acc = s0[j];
    FN(adagrad_update)(&pp, g[i], &acc, sc);
    p[i] = pp;
    s0[j] = acc;
}

/* ---------------------------------------------------------------- LAMB (two passes) */

/* Pass 1: the (clipped) gradient folded into the moments; grad_scale is the gradient factor times
 * the clipping factor (lamb_grad_scale in optirs_steps.cl). */
void FN(lamb_moments)(T g, T *m, T *v, float grad_scale, const lamb_scalars *sc)
{
    g = g * grad_scale;
    *m = sc->beta1 * *m + sc->one_minus_beta1 * g;
    *v = sc->beta2 * *v + sc->one_minus_beta2 * g * g;
}

/* The update direction u, before the trust ratio and the learning rate. */
T FN(lamb_direction)(T p, T m, T v, const lamb_scalars *sc)
{
    /* sqrt(v) / sqrt(bc2), not sqrt(v / bc2): v / bc2 overflows where the quotient is finite */
    T u = (m / sc->bias_correction1) / (sqrt(v) / sqrt(sc->bias_correction2) + sc->eps);
    if (sc->weight_decay != 0.0f)
        u = u + sc->weight_decay * p;
    return u;
}

/* ---------------------------------------------------------------- Lion */

/* sign() is 0 for NaN in OpenCL but NaN in torch: keep c where it is NaN, so p becomes NaN. */
void FN(lion_update)(T *p, T g, T *m, const lion_scalars *sc)
{
    g = g * sc->grad_factor;
    const T pp = *p * sc->decay_factor;
    const T c = sc->beta1 * *m + sc->one_minus_beta1 * g;
    const T s = select(sign(c), c, isnan(c));
    *p = pp - sc->lr * s;
    *m = sc->beta2 * *m + sc->one_minus_beta2 * g;
}

/* s0: exp_avg */
void FN(lion_elem)(__global T *p, __global const T *g, __global T *s0, __global T *s1,
                   __global T *s2, size_t i, size_t j, const lion_scalars *sc)
{
    T pp = p[i], m = s0[j];
    FN(lion_update)(&pp, g[i], &m, sc);
    p[i] = pp;
    s0[j] = m;
}

/* ---------------------------------------------------------------- Adafactor (per element; the
 * per-tensor sums are in optirs_steps.cl's adafactor_step) */

T FN(adafactor_grad)(T g, const adafactor_scalars *sc)
{
    g = g * sc->grad_factor;
    return sc->maximize ? -g : g;
}

/* old + w * (new - old): torch's lerp_ of the running means. */
T FN(adafactor_running_mean)(T old, T mean, const adafactor_scalars *sc)
{
    return old + sc->beta2_weight * (mean - old);
}

T FN(adafactor_factored_direction)(T g, T row, T col, float row_mean, const adafactor_scalars *sc)
{
    const T v = row * col / fmax(row_mean, sc->eps1);
    return g / sqrt(fmax(v, sc->eps1_squared));
}

T FN(adafactor_direction)(T g, T variance, const adafactor_scalars *sc)
{
    return g / sqrt(fmax(variance, sc->eps1_squared));
}

T FN(adafactor_apply)(T p, T u, float step, const adafactor_scalars *sc)
{
    return p * sc->decay_factor - step * u;
}

/* ---------------------------------------------------------------- the rest of torch.optim's elementwise
 * optimizers (NAdam, RAdam, Adamax, Adadelta, ASGD, Rprop), term by term as elementwise.py. Per-element
 * choices are select()s so the same text runs on float, float4 and float8. */

/* torch's two weight decays (NAdam, RAdam): p * (1 - lr * wd) or g + wd * p; none at wd 0. */
#define DECAY_L2_OR_DECOUPLED(pp, g, sc)                                                         \
    if ((sc)->decoupled)                                                                         \
        pp = pp * (sc)->decay_factor;                                                            \
    else if ((sc)->weight_decay != 0.0f)                                                         \
        g = g + (sc)->weight_decay * pp;

void FN(nadam_update)(T *p, T g, T *m, T *v, const nadam_scalars *sc)
{
    g = g * sc->grad_factor;
    T pp = *p;
    DECAY_L2_OR_DECOUPLED(pp, g, sc)
    const T mm = sc->beta1 * *m + sc->one_minus_beta1 * g;
    const T vv = sc->beta2 * *v + sc->one_minus_beta2 * g * g;
    const T denom = sqrt(vv / sc->bias_correction2) + sc->eps;
    pp = pp + sc->grad_coef * (g / denom);
    *p = pp + sc->avg_coef * (mm / denom);
    *m = mm;
    *v = vv;
}


void FN(radam_update)(T *p, T g, T *m, T *v, const radam_scalars *sc)
{
    g = g * sc->grad_factor;
    T pp = *p;
    DECAY_L2_OR_DECOUPLED(pp, g, sc)
    const T mm = sc->beta1 * *m + sc->one_minus_beta1 * g;
    const T vv = sc->beta2 * *v + sc->one_minus_beta2 * g * g;
    T update = mm / sc->bias_correction1 * sc->lr;
    if (sc->rectified)
        update = update * (sc->bias_correction2_sqrt / (sqrt(vv) + sc->eps)) * sc->rect;
    *p = pp - update;
    *m = mm;
    *v = vv;
}


/* torch.maximum: a NaN on either side is the result (fmax would drop it). */
void FN(adamax_update)(T *p, T g, T *m, T *u, const adamax_scalars *sc)
{
    g = g * sc->grad_factor;
    const T pp = *p;
    if (sc->weight_decay != 0.0f)
        g = g + sc->weight_decay * pp;
    const T mm = sc->beta1 * *m + sc->one_minus_beta1 * g;
    const T ub = sc->beta2 * *u;
    const T a = fabs(g) + sc->eps;
    const T uu = select(ub, a, isgreater(a, ub) | isnan(a));
    *p = pp - sc->clr * (mm / uu);
    *m = mm;
    *u = uu;
}


void FN(adadelta_update)(T *p, T g, T *square_avg, T *acc_delta, const adadelta_scalars *sc)
{
    g = g * sc->grad_factor;
    const T pp = *p;
    if (sc->weight_decay != 0.0f)
        g = g + sc->weight_decay * pp;
    const T sq = sc->rho * *square_avg + sc->one_minus_rho * g * g;
    const T delta = sqrt(*acc_delta + sc->eps) / sqrt(sq + sc->eps) * g;
    *acc_delta = sc->rho * *acc_delta + sc->one_minus_rho * delta * delta;
    *square_avg = sq;
    *p = pp - sc->lr * delta;
}


void FN(asgd_update)(T *p, T g, T *ax, const asgd_scalars *sc)
{
    g = g * sc->grad_factor;
    T pp = *p;
    if (sc->weight_decay != 0.0f)
        g = g + sc->weight_decay * pp;
    pp = pp * sc->decay_factor;
    pp = pp - sc->eta * g;
    if (sc->averaging)
        *ax = *ax + (pp - *ax) * sc->mu;
    else
        *ax = pp;
    *p = pp;
}

/* s0: ax */
void FN(asgd_elem)(__global T *p, __global const T *g, __global T *s0, __global T *s1,
                   __global T *s2, size_t i, size_t j, const asgd_scalars *sc)
{
    T pp = p[i], ax = s0[j];
    FN(asgd_update)(&pp, g[i], &ax, sc);
    p[i] = pp;
    s0[j] = ax;
}

/* The factor is etaplus / etaminus / 1 by the sign of g * prev (NaN where that is NaN, as torch's
 * sign); the clamp keeps NaN; where the sign flipped the element does not move and prev becomes 0. */
void FN(rprop_update)(T *p, T g, T *prev, T *step_size, const rprop_scalars *sc)
{
    g = g * sc->grad_factor;
    const T pp = *p;
    const T s = g * *prev;
    const T f = select(select(select(s, (T)(1.0f), s == (T)(0.0f)), (T)(sc->etaminus), s < (T)(0.0f)),
                       (T)(sc->etaplus), s > (T)(0.0f));
    T st = (sc->first_step ? (T)(sc->lr) : *step_size) * f;
    st = select(st, (T)(sc->step_size_min), st < (T)(sc->step_size_min));
    st = select(st, (T)(sc->step_size_max), st > (T)(sc->step_size_max));
    g = select(g, (T)(0.0f), f == (T)(sc->etaminus));
    *p = select(select(pp - g * st, pp + st, g < (T)(0.0f)), pp - st, g > (T)(0.0f));
    *prev = g;
    *step_size = st;
}


/* The element functions of the two-slot families: s0 and s1 are the definition's two slots
 * (nadam, radam: exp_avg, exp_avg_sq; adamax: exp_avg, exp_inf; adadelta: square_avg, acc_delta;
 * rprop: prev, step_size). */
#define TWO_SLOT_ELEM(OPT)                                                                       \
    void FN(OPT##_elem)(__global T *p, __global const T *g, __global T *s0, __global T *s1,      \
                        __global T *s2, size_t i, size_t j, const OPT##_scalars *sc)             \
    {                                                                                            \
        T pp = p[i], a = s0[j], b = s1[j];                                                       \
        FN(OPT##_update)(&pp, g[i], &a, &b, sc);                                                 \
        p[i] = pp;                                                                               \
        s0[j] = a;                                                                               \
        s1[j] = b;                                                                               \
    }
TWO_SLOT_ELEM(nadam)
TWO_SLOT_ELEM(radam)
TWO_SLOT_ELEM(adamax)
TWO_SLOT_ELEM(adadelta)
TWO_SLOT_ELEM(rprop)
#undef TWO_SLOT_ELEM
#undef DECAY_L2_OR_DECOUPLED
