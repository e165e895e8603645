/* Helpers of the generated fused kernels (optirs.analysis.fusion): numpy's NaN and signed-zero
   behaviour for maximum/minimum, which OpenCL's fmax/fmin do not have. OpenCL C contracts
   a * b + c into an fma by default; numpy rounds twice, so contraction is switched off. */
#pragma OPENCL FP_CONTRACT OFF
inline float optirs_fmax_float(float a, float b) { return (a > b || a != a) ? a : b; }
inline float optirs_fmin_float(float a, float b) { return (a < b || a != a) ? a : b; }
