// Top-k selection kernels for CuPy arrays on a GPU (loaded by select_cuda.py).
//
// They do what the numba-cuda kernels of device_select.py do under the
// simulator, in fewer passes and with CuPy's cheap launches. Keys are the
// magnitude keys of magnitude.py: the float's bits with the sign cleared,
// every NaN clamped to one key above Inf. Key is the unsigned type the keys
// fit in (32 bits for float16 and float32, 64 for float64); Bits is the
// float's own width.

// The magnitude key of one entry.
template <typename Bits, typename Key>
__device__ __forceinline__ Key magnitude_key(Bits bits, Key mask, Key nan_key) {
    Key key = static_cast<Key>(bits) & mask;
    return key < nan_key ? key : nan_key;
}

// Every position whose key is at least `floor`, appended in any order: a warp
// votes, one lane reserves the warp's slots with one atomic. `count` ends
// with how many there are, also when that is more than `capacity` (then only
// the first `capacity` were written, and the caller runs again with more
// room). Each block walks tiles of blockDim.x * 4 entries, so every lane of
// a warp takes the same trips and the votes see the whole warp.
template <typename Bits, typename Key>
__global__ void at_least(const Bits* __restrict__ bits, long long n, Key mask, Key nan_key, Key floor,
                         long long* __restrict__ out, unsigned long long capacity,
                         unsigned long long* __restrict__ count) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned below = (1u << lane) - 1u;
    const long long tile = 4LL * blockDim.x;
    for (long long start = blockIdx.x * tile; start < n; start += gridDim.x * tile) {
        Bits b[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {  // four loads in flight before the first use
            long long i = start + u * blockDim.x + threadIdx.x;
            b[u] = i < n ? bits[i] : Bits(0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            long long i = start + u * blockDim.x + threadIdx.x;
            bool take = i < n && magnitude_key<Bits, Key>(b[u], mask, nan_key) >= floor;
            unsigned votes = __ballot_sync(0xffffffffu, take);
            if (votes == 0u) continue;
            unsigned long long first = 0;
            if (lane == static_cast<unsigned>(__ffs(votes) - 1))
                first = atomicAdd(count, static_cast<unsigned long long>(__popc(votes)));
            first = __shfl_sync(0xffffffffu, first, __ffs(votes) - 1);
            if (take) {
                unsigned long long slot = first + __popc(votes & below);
                if (slot < capacity) out[slot] = i;
            }
        }
    }
}

// counts[j] += #(key >= floors[j]) for the 63 ascending floors, in one read.
// A key at or above the lowest floor finds its bucket [f[j], f[j+1]) by a
// binary search and counts there in shared memory; the block adds the
// buckets' suffix sums. Keys below the lowest floor, the most of them after
// the first pass, cost one compare.
template <typename Bits, typename Key>
__global__ void count_at_least(const Bits* __restrict__ bits, long long n, Key mask, Key nan_key,
                               const Key* __restrict__ floors, unsigned long long* __restrict__ counts) {
    constexpr int Floors = 63;
    __shared__ Key f[Floors];
    __shared__ unsigned bucket[Floors];
    for (int j = threadIdx.x; j < Floors; j += blockDim.x) {
        f[j] = floors[j];
        bucket[j] = 0u;
    }
    __syncthreads();
    const Key lowest = f[0];
    const long long tile = 4LL * blockDim.x;
    for (long long start = blockIdx.x * tile; start < n; start += gridDim.x * tile) {
        Bits b[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            long long i = start + u * blockDim.x + threadIdx.x;
            b[u] = i < n ? bits[i] : Bits(0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            Key key = magnitude_key<Bits, Key>(b[u], mask, nan_key);
            if (start + u * blockDim.x + threadIdx.x < n && key >= lowest) {
                int j = 0;
                for (int step = 32; step > 0; step >>= 1)
                    if (j + step < Floors && f[j + step] <= key) j += step;
                atomicAdd(bucket + j, 1u);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long at_or_above = 0;
        for (int j = Floors - 1; j >= 0; --j) {
            at_or_above += bucket[j];
            if (at_or_above) atomicAdd(counts + j, at_or_above);
        }
    }
}

// One thread, after a counting pass: narrow the bracket search = [lo, hi) of
// key floors (lo: the highest floor that keeps more than k keys; hi: the
// lowest that keeps at most k), then spread the next pass's floors evenly
// inside it and clear the counts. With counts all zero and the bracket as
// given, it only spreads (the first pass).
template <typename Key>
__global__ void steer(Key* search, Key* floors, unsigned long long* counts, unsigned long long k, int narrow) {
    constexpr int Floors = 63;
    if (narrow) {
        for (int j = 0; j < Floors; ++j)
            if (counts[j] > k) search[0] = floors[j];
        for (int j = Floors - 1; j >= 0; --j)
            if (counts[j] <= k) search[1] = floors[j];
    }
    Key lo = search[0], width = search[1] - search[0];
    Key step = width / (Floors + 1), rest = width % (Floors + 1);
    for (int j = 0; j < Floors; ++j) {
        floors[j] = lo + (j + 1) * step + (j + 1) * rest / (Floors + 1);
        counts[j] = 0ULL;
    }
}

// The magnitude of a finite entry, from its bits (float16 decoded by hand:
// no half type is needed).
__device__ __forceinline__ double magnitude_of(unsigned short b) {
    int exponent = (b >> 10) & 31, mantissa = b & 1023;
    return exponent ? ldexp(1024.0 + mantissa, exponent - 25) : ldexp(static_cast<double>(mantissa), -24);
}
__device__ __forceinline__ double magnitude_of(unsigned int b) { return __uint_as_float(b & 0x7fffffffu); }
__device__ __forceinline__ double magnitude_of(unsigned long long b) {
    return __longlong_as_double(static_cast<long long>(b & 0x7fffffffffffffffULL));
}

// The sum of the finite magnitudes and how many entries are finite, in one read.
template <typename Bits, typename Key>
__global__ void finite_stats(const Bits* __restrict__ bits, long long n, Key mask, Key inf_key, double* stats) {
    double sum = 0.0;
    unsigned long long count = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        Bits b = bits[i];
        if ((static_cast<Key>(b) & mask) < inf_key) {
            sum += magnitude_of(b);
            count += 1;
        }
    }
    for (int d = 16; d > 0; d >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, d);
        count += __shfl_down_sync(0xffffffffu, count, d);
    }
    if ((threadIdx.x & 31u) == 0u) {
        atomicAdd(stats, sum);
        atomicAdd(stats + 1, static_cast<double>(count));  // exact below 2^53 entries
    }
}

// Radix select, one byte a pass: count, per byte at `shift`, the keys that
// share the prefix state[0] under the mask state[1]. A block counts in shared
// memory, then adds its 256 counts.
template <typename Bits, typename Key>
__global__ void histogram(const Bits* __restrict__ bits, long long n, Key mask, Key nan_key,
                          const unsigned long long* __restrict__ state, int shift, unsigned long long* hist) {
    __shared__ unsigned local[256];
    for (int b = threadIdx.x; b < 256; b += blockDim.x) local[b] = 0u;
    __syncthreads();
    const Key prefix = static_cast<Key>(state[0]), prefix_mask = static_cast<Key>(state[1]);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        Key key = magnitude_key<Bits, Key>(bits[i], mask, nan_key);
        if ((key & prefix_mask) == prefix) atomicAdd(local + ((key >> shift) & 255u), 1u);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += blockDim.x)
        if (local[b]) atomicAdd(hist + b, static_cast<unsigned long long>(local[b]));
}

// One thread: the byte that holds the state[2]-th largest key of the
// histogram; extend the prefix by it, keep how many are still wanted, and
// clear the histogram for the next pass.
__global__ void choose_byte(unsigned long long* hist, unsigned long long* state, int shift) {
    unsigned long long wanted = state[2], above = 0;
    bool found = false;
    for (int b = 255; b >= 0; --b) {
        if (!found && above + hist[b] >= wanted) {
            state[0] |= static_cast<unsigned long long>(b) << shift;
            state[1] |= 255ULL << shift;
            state[2] = wanted - above;
            found = true;
        }
        above += hist[b];
        hist[b] = 0ULL;
    }
}

// The exact pick's sort keys for 16- and 32-bit floats: (key << 32) | ~position,
// so that in an ascending sort the last k are the top k, by key and then by
// ascending position (the contract's ties). Positions fit 32 bits here.
template <typename Bits>
__global__ void rank_keys(const Bits* __restrict__ bits, const long long* __restrict__ positions, long long m,
                          unsigned mask, unsigned nan_key, unsigned long long* __restrict__ out) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < m) {
        long long p = positions[i];
        unsigned key = magnitude_key<Bits, unsigned>(bits[p], mask, nan_key);
        out[i] = (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<unsigned>(p));
    }
}
