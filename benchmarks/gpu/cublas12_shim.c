/* libcublas.so.12 that forwards to the CUDA 13 cuBLAS already loaded by torch.
 *
 * Why: PyPI's faiss-gpu wheels link cuBLAS 12 (about 600 MB as wheels) while the GPU
 * machines the benchmark runs on carry CUDA 13 only and accept at most 64 MiB per upload. FAISS
 * calls eight cuBLAS entry points whose signatures did not change between 12 and 13; each
 * one here is a tail jump to its CUDA 13 twin, so the arguments pass through untouched.
 * Benchmarks only: a production image installs the faiss-gpu matching its CUDA.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#define FORWARDS(X) X(cublasCreate_v2) X(cublasDestroy_v2) X(cublasGemmEx) \
    X(cublasGemmStridedBatchedEx) X(cublasGetMathMode) X(cublasSetMathMode) \
    X(cublasSetStream_v2) X(cublasSgemmEx)

#define POINTER(name) void *target_##name;
FORWARDS(POINTER)

#define JUMP(name) __attribute__((naked)) void name(void) { \
    __asm__ volatile("jmp *target_" #name "(%rip)"); }
FORWARDS(JUMP)

/* CUBLAS_STATUS_NOT_SUPPORTED: FAISS raises it as an error instead of the process dying. */
static int not_supported(void) { return 15; }

__attribute__((constructor)) static void resolve(void) {
    const char *path = getenv("CUBLAS13_PATH");
    void *lib = dlopen(path ? path : "libcublas.so.13", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        fprintf(stderr, "cublas12_shim: cannot load cuBLAS 13: %s\n", dlerror());
        abort();
    }
#define RESOLVE(name) if (!(target_##name = dlsym(lib, #name))) { \
        fprintf(stderr, "cublas12_shim: cuBLAS 13 lacks %s\n", #name); \
        target_##name = (void *)not_supported; }
    FORWARDS(RESOLVE)
}
