/* Import-time stand-in for libcudart, for FlashInfer 0.5.x-0.6.10 on machines
 * without CUDA.
 *
 * Those releases build `cudart = CudaRTLibrary()` when flashinfer.comm.cuda_ipc is
 * imported: it looks for a loaded "libcudart" in /proc/self/maps and binds eleven
 * symbols, so `import flashinfer.comm` fails on a CPU-only host. The conformance
 * harness loads this stub first (ctypes, RTLD_GLOBAL) so the import succeeds, then
 * replaces FlashInfer's `cudart` object with a recording Python stand-in. Nothing
 * here is meant to be called: every function fails with cudaErrorUnknown (999) so
 * that an unexpected call is loud.
 */
#include <stddef.h>

#define FAIL 999

int cudaSetDevice(int device) { (void)device; return FAIL; }
int cudaDeviceSynchronize(void) { return FAIL; }
int cudaDeviceReset(void) { return FAIL; }
const char *cudaGetErrorString(int error) {
    (void)error;
    return "libcudart stub (flashinfer-safe-workspace conformance test): not a real CUDA runtime";
}
int cudaMalloc(void **ptr, size_t size) { (void)ptr; (void)size; return FAIL; }
int cudaFree(void *ptr) { (void)ptr; return FAIL; }
int cudaMemset(void *ptr, int value, size_t count) { (void)ptr; (void)value; (void)count; return FAIL; }
int cudaMemcpy(void *dst, const void *src, size_t count, int kind) {
    (void)dst; (void)src; (void)count; (void)kind; return FAIL;
}
typedef struct { char internal[128]; } cudaIpcMemHandle_t;
int cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *ptr) { (void)handle; (void)ptr; return FAIL; }
int cudaIpcOpenMemHandle(void **ptr, cudaIpcMemHandle_t handle, unsigned int flags) {
    (void)ptr; (void)handle; (void)flags; return FAIL;
}
int cudaIpcCloseMemHandle(void *ptr) { (void)ptr; return FAIL; }
