/* A persistent worker pool for the CPU kernels (see cpu_pool.c). */
#ifndef NOVAINFER_CPU_POOL_H
#define NOVAINFER_CPU_POOL_H

typedef void (*pool_chunk_fn)(void *ctx, int chunk);

/* Runs fn(ctx, 0..nchunks-1) on the calling thread and up to nthreads-1 pool workers; returns when all ran. */
void pool_run(pool_chunk_fn fn, void *ctx, int nchunks, int nthreads);

#endif
