// CUB's DeviceTopK (CCCL 3.3 and later) on |x|, for bench_topk.py's
// comparison: a shared library bench_topk.py loads with ctypes and calls on
// CuPy's pointers and stream. Built by drivers/build_cub_topk.sh against the
// CCCL headers of the cuda-cccl wheel; not part of spar_comm.
//
// CUB implements only the unordered, non-deterministic configuration so far:
// the k largest |x| (any of the tied ones at the k-th) with their positions,
// in any order. spar_comm's contract (ascending positions, ties to the lowest)
// asks for more, so this is a floor to compare against, not a replacement.
#include <cub/device/device_topk.cuh>
#include <cuda/iterator>
#include <cuda/std/execution>

namespace {
struct Magnitude {
    __host__ __device__ float operator()(float v) const { return fabsf(v); }
};

template <typename Void>
cudaError_t run(Void* temp, size_t& bytes, const float* x, long long n, long long k, float* keys_out,
                long long* positions_out, cudaStream_t stream) {
    auto magnitudes = cuda::transform_iterator(x, Magnitude{});
    auto positions = cuda::counting_iterator<long long>(0);
    auto requirements = cuda::execution::require(cuda::execution::determinism::not_guaranteed,
                                                 cuda::execution::output_ordering::unsorted);
    auto env = cuda::std::execution::env{cuda::stream_ref{stream}, requirements};
    return cub::DeviceTopK::MaxPairs(temp, bytes, magnitudes, keys_out, positions, positions_out, n, k, env);
}
}  // namespace

extern "C" {
// Bytes of scratch a call on n entries for k needs (0 on error).
size_t cub_topk_scratch(long long n, long long k) {
    size_t bytes = 0;
    return run<void>(nullptr, bytes, nullptr, n, k, nullptr, nullptr, nullptr) == cudaSuccess ? bytes : 0;
}

// The k largest |x| and their positions, unordered; cudaError_t as int.
int cub_topk(void* scratch, size_t bytes, const float* x, long long n, long long k, float* keys_out,
             long long* positions_out, void* stream) {
    return static_cast<int>(run<void>(scratch, bytes, x, n, k, keys_out, positions_out,
                                      static_cast<cudaStream_t>(stream)));
}
}
