/* Dealing chunks to a resident grid, shared by optirs_steps.cl and optirs_formats.cl (host:
 * optirs/backends/opencl/slots.py, which also generates OPTIRS_SLOTS, SLOT_PARAMS and PICK for
 * the device's slot count in front of the program).
 *
 * A launch runs as many work-groups as the compute units keep at once; each takes chunks from
 * the counter tickets[0] until none are left, in order, so a work-group that starts late finds
 * none and the grid may exceed what stays resident. Each take advances the counter by one and
 * every work-group's last take finds none, so a launch advances it by nchunks + its number of
 * work-groups and the host knows the next launch's first ticket (ticket_base) without reading
 * it back. */
#ifndef OPTIRS_CHUNKS_H
#define OPTIRS_CHUNKS_H

#ifndef OPTIRS_SLOTS
#error "the host defines OPTIRS_SLOTS, SLOT_PARAMS and PICK (optirs/backends/opencl/slots.py: slot_macros)"
#endif

/* The launch's chunk range [chunk_base, chunk_base + nchunks) of the chunk table (chunk c is
 * elements [chunk_start[c], + OPTIRS_CHUNK) of tensor chunk_tensor[c]) and the counter. */
#define DEAL_PARAMS                                                                              \
    __global const int *chunk_tensor, __global const long *chunk_start, uint chunk_base,         \
    uint nchunks, __global volatile uint *tickets, uint ticket_base

/* Work-item 0 takes the work-group's next chunk into the __local struct D (fields taken: the
 * chunk's index in the launch, nchunks when none is left; t: its tensor; start: its first element
 * in the tensor, read beside t so that the two loads overlap and no other work-item reads the table;
 * p, g: that tensor's parameter and gradient buffers, slots PSLOT and GSLOT, expressions of t,
 * picked once for the whole work-group). Needs lid (the local id) in scope; every work-item must
 * reach it.
 * DEAL_CHUNK_AT: the same with the ticket an expression TICKET, and TAKE_NEXT run when a chunk
 * is taken (the formats kernels take their next ticket a chunk ahead). */
#define DEAL_CHUNK_AT(D, P, G, PSLOT, GSLOT, TICKET, TAKE_NEXT)                              \
    barrier(CLK_LOCAL_MEM_FENCE); /* every work-item has read the previous deal */           \
    if (lid == 0) {                                                                          \
        const uint taken_ = min((TICKET) - ticket_base, nchunks);                            \
        D.taken = taken_;                                                                    \
        if (taken_ < nchunks) {                                                              \
            TAKE_NEXT;                                                                       \
            const int t = chunk_tensor[chunk_base + taken_];                                 \
            D.start = chunk_start[chunk_base + taken_];                                      \
            const int ps_ = (PSLOT), gs_ = (GSLOT);                                          \
            D.t = t;                                                                         \
            D.p = PICK(ps_, P);                                                              \
            D.g = PICK(gs_, G);                                                              \
        }                                                                                    \
    }                                                                                        \
    barrier(CLK_LOCAL_MEM_FENCE);
#define DEAL_CHUNK(D, P, G, PSLOT, GSLOT) DEAL_CHUNK_AT(D, P, G, PSLOT, GSLOT, atomic_inc(tickets), (void)0)

#endif
