/* The buffer slots of the chunked kernels: OpenCL 1.2 has no pointer tables, so a launch takes
 * OPTIRS_SLOTS buffers of each kind as arguments and a tensor table names each tensor's slot.
 * Shared by optirs_steps.cl and optirs_formats.cl. */
#ifndef OPTIRS_SLOTS_H
#define OPTIRS_SLOTS_H

#define OPTIRS_SLOTS 16

/* OPTIRS_SLOTS kernel arguments X0..X15 of type __global TY * (TY may carry const). */
#define SLOT_PARAMS_OF(X, TY)                                                                    \
    __global TY *X##0, __global TY *X##1, __global TY *X##2, __global TY *X##3,                  \
    __global TY *X##4, __global TY *X##5, __global TY *X##6, __global TY *X##7,                  \
    __global TY *X##8, __global TY *X##9, __global TY *X##10, __global TY *X##11,                \
    __global TY *X##12, __global TY *X##13, __global TY *X##14, __global TY *X##15

/* The slot's buffer; s is uniform over the work-group (one tensor per chunk). */
#define PICK(s, X)                                                                               \
    ((s) < 8 ? ((s) < 4 ? ((s) < 2 ? ((s) == 0 ? X##0 : X##1) : ((s) == 2 ? X##2 : X##3))       \
                        : ((s) < 6 ? ((s) == 4 ? X##4 : X##5) : ((s) == 6 ? X##6 : X##7)))      \
             : ((s) < 12 ? ((s) < 10 ? ((s) == 8 ? X##8 : X##9) : ((s) == 10 ? X##10 : X##11))  \
                         : ((s) < 14 ? ((s) == 12 ? X##12 : X##13) : ((s) == 14 ? X##14 : X##15))))

#endif
