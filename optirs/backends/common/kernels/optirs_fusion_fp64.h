/* The float64 helpers of the generated fused kernels, included when a group uses float64 values
   or accumulates a reduction (needs cl_khr_fp64). */
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
inline double optirs_fmax_double(double a, double b) { return (a > b || a != a) ? a : b; }
inline double optirs_fmin_double(double a, double b) { return (a < b || a != a) ? a : b; }
