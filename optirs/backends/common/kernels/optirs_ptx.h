/* Inline PTX shared by the OpenCL headers, built only on NVIDIA's driver (the host defines
 * OPTIRS_NV_PTX there: docs/opencl.md); elsewhere plain OpenCL C takes its place. */
#ifndef OPTIRS_PTX_H
#define OPTIRS_PTX_H

#ifndef OPTIRS_NV_PTX
#define OPTIRS_NV_PTX 0 /* the host's define on NVIDIA's driver: inline PTX where it saves instructions */
#endif

/* The reciprocal's approximation (rcp.approx.ftz) that divide_by_uniform and the int8 blocks'
 * optirs_rcp_fast refine by one Newton step (tests/test_opencl_formats.py defines OPTIRS_RCP_APPROX
 * first, to put an approximation within its error bound in its place on any device). */
#if OPTIRS_NV_PTX && !defined(OPTIRS_RCP_APPROX)
float optirs_rcp_approx(float b)
{
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(b));
    return y;
}
#define OPTIRS_RCP_APPROX(b) optirs_rcp_approx(b)
#endif

#endif
