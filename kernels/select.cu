// Exact top-k selection on a GPU, as a fixed sequence of launches that never
// waits for the host (loaded by select_cuda.py, ordered by device_select.py).
//
// Every figure a step needs from the one before (the floor, how many the
// gather admitted, the k-th key, how many of its ties are wanted) stays in
// the selection's state on the device, so the host only launches. A step that
// would branch reads the state instead: the radix select and the marking run
// over the gathered candidates when the gather admitted at least k and no more
// than its room, else over the whole array, so an unlucky floor costs passes,
// never correctness. The answer comes out in ascending positions by way of two
// bitmaps (keys above the k-th key, and keys equal to it), compacted in order.
//
// Keys are the magnitude keys of magnitude.py: the float's bits with the sign
// cleared, every NaN clamped to one key above Inf. Key is the unsigned type
// the keys fit in (32 bits for float16 and float32, 64 for float64); Bits is
// the float's own width. select_numba.py holds the same kernels in numba-cuda,
// under the same names and arguments, for Numba's CUDA simulator.

// Slots of the state (unsigned long long) a selection keeps on the device.
// select_plan.py's STATE lists the same names in the same order.
enum Slot {
    FLOOR,        // the gather takes every key at or above it
    COUNT,        // how many keys the gather admitted (also past its room)
    SOURCE,       // 1: the radix select and the marking (before them, the bisection's
                  // later passes) read the candidates; 0: the whole array
    CANDIDATES,   // how many candidates they read
    PREFIX,       // the radix select's prefix; after its last pass, the k-th largest key
    PREFIX_MASK,  // the bits of the prefix chosen so far
    WANTED,       // how many keys equal to the prefix are still wanted
    LO,           // the bisection's bracket [LO, HI) of floors
    HI,
    PREVIOUS,     // the last call's k-th key (the warm start's), NO_KEY before one
};
#define NO_KEY 0xffffffffffffffffULL
#define FULL_WARP 0xffffffffu
// Threads of the compaction's blocks, and bitmap words each of them reads.
#define COMPACT_THREADS 256
#define WORDS 8
// Floors a bisection pass counts: 8 halvings a pass (steer's block has a thread for each).
#define FLOORS 255
// Entries a thread of the gather takes a tile (16 used 107 registers a thread).
#define GATHER_ITEMS 8

// The magnitude key of one entry.
template <typename Bits, typename Key>
__device__ __forceinline__ Key magnitude_key(Bits bits, Key mask, Key nan_key) {
    Key key = static_cast<Key>(bits) & mask;
    return key < nan_key ? key : nan_key;
}

// The magnitude of a finite key (float16 decoded by hand: no half type is needed).
__device__ __forceinline__ double magnitude_of(unsigned short b) {
    int exponent = (b >> 10) & 31, mantissa = b & 1023;
    return exponent ? ldexp(1024.0 + mantissa, exponent - 25) : ldexp(static_cast<double>(mantissa), -24);
}
__device__ __forceinline__ double magnitude_of(unsigned int b) { return __uint_as_float(b & 0x7fffffffu); }
__device__ __forceinline__ double magnitude_of(unsigned long long b) {
    return __longlong_as_double(static_cast<long long>(b & 0x7fffffffffffffffULL));
}

// The least key whose magnitude is at least v >= 0 (inf_key when none is),
// so that key >= key_at_least(t) means |x| >= t: by bisection over the keys,
// which are monotone in the magnitude.
template <typename Bits, typename Key>
__device__ Key key_at_least(double v, Key inf_key) {
    Key lo = 0, hi = inf_key;
    while (lo < hi) {
        Key mid = lo + (hi - lo) / 2;
        if (magnitude_of(static_cast<Bits>(mid)) >= v) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// An inclusive scan of one value per thread across a COMPACT_THREADS block.
__device__ __forceinline__ unsigned long long block_scan(unsigned long long v, unsigned long long* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int step = 1; step < COMPACT_THREADS; step <<= 1) {
        unsigned long long add = threadIdx.x >= step ? buf[threadIdx.x - step] : 0ULL;
        __syncthreads();
        buf[threadIdx.x] += add;
        __syncthreads();
    }
    unsigned long long mine = buf[threadIdx.x];
    __syncthreads();
    return mine;
}

// One thread: a slot cleared (a gather's count before it, the source, the largest key).
__global__ void clear_slot(unsigned long long* state, int slot) { state[slot] = 0ULL; }

// One thread: the floor from another slot (the sample's radix select), or a value when slot < 0.
__global__ void set_floor(unsigned long long* state, int slot, unsigned long long value) {
    state[FLOOR] = slot < 0 ? value : state[slot];
}

// Every key at or above the floor, with its position, appended in any order.
// A block takes tiles of GATHER_ITEMS * blockDim.x entries; the warps count
// their votes, and one atomic a tile reserves the block's slots (one counter,
// so one atomic a warp would queue behind each other at 1% density, and the
// block waits for each reservation: large tiles make them few). COUNT ends
// with how many there are, also when that is more than `capacity` (then only
// the first `capacity` were written, and the radix select reads the whole
// array).
// Requires blockDim.x a multiple of 32, at most 1024.
template <typename Bits, typename Key>
__global__ void gather_at_least(const Bits* __restrict__ bits, long long n, Key mask, Key nan_key,
                                unsigned long long* state, Key* __restrict__ keys, long long* __restrict__ positions,
                                unsigned long long capacity) {
    __shared__ unsigned long long warp_first[32];
    __shared__ unsigned long long block_first;
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const unsigned below = (1u << lane) - 1u;
    const Key floor = static_cast<Key>(state[FLOOR]);
    const long long tile = static_cast<long long>(GATHER_ITEMS) * blockDim.x;
    for (long long start = blockIdx.x * tile; start < n; start += gridDim.x * tile) {  // the same trips for the block
        Bits b[GATHER_ITEMS];
#pragma unroll
        for (int u = 0; u < GATHER_ITEMS; ++u) {  // every load in flight before the first use
            long long i = start + u * blockDim.x + threadIdx.x;
            b[u] = i < n ? bits[i] : Bits(0);
        }
        unsigned votes[GATHER_ITEMS], taken = 0u;
#pragma unroll
        for (int u = 0; u < GATHER_ITEMS; ++u) {
            long long i = start + u * blockDim.x + threadIdx.x;
            votes[u] = __ballot_sync(FULL_WARP, i < n && magnitude_key<Bits, Key>(b[u], mask, nan_key) >= floor);
            taken += __popc(votes[u]);
        }
        if (lane == 0u) warp_first[warp] = taken;
        __syncthreads();
        if (threadIdx.x == 0) {  // the warps' offsets, and the block's slots
            unsigned long long total = 0;
            for (unsigned w = 0; w < warps; ++w) {
                unsigned long long here = warp_first[w];
                warp_first[w] = total;
                total += here;
            }
            block_first = total ? atomicAdd(state + COUNT, total) : 0ULL;
        }
        __syncthreads();
        unsigned long long slot = block_first + warp_first[warp];
#pragma unroll
        for (int u = 0; u < GATHER_ITEMS; ++u) {
            if ((votes[u] >> lane) & 1u) {
                unsigned long long mine = slot + __popc(votes[u] & below);
                if (mine < capacity) {
                    long long i = start + u * blockDim.x + threadIdx.x;
                    keys[mine] = magnitude_key<Bits, Key>(b[u], mask, nan_key);
                    positions[mine] = i;
                }
            }
            slot += __popc(votes[u]);
        }
        __syncthreads();  // the shared offsets are read before the next tile writes them
    }
}

// One thread: start a radix select of the k-th largest key, over the
// candidates if there are at least k of them and all were kept (`given`: how
// many; < 0 for the gather's COUNT), else over the whole array. The
// bisection's later passes choose what they count over by the same rule,
// with a k of 0: the candidates whenever all were kept.
__global__ void begin_radix(unsigned long long* state, unsigned long long k, unsigned long long capacity,
                            long long given) {
    unsigned long long m = given >= 0 ? static_cast<unsigned long long>(given) : state[COUNT];
    bool candidates = m >= k && m <= capacity;
    state[SOURCE] = candidates;
    state[CANDIDATES] = candidates ? m : 0ULL;
    state[PREFIX] = 0ULL;
    state[PREFIX_MASK] = 0ULL;
    state[WANTED] = k;
}

// Blocks of a grid-stride kernel that work on m entries: enough for about 8
// entries a thread (the candidates are few, the array many); the others return.
__device__ __forceinline__ unsigned blocks_for(long long m) {
    long long wanted = (m + 8LL * blockDim.x - 1) / (8LL * blockDim.x);
    return static_cast<unsigned>(wanted < 1 ? 1 : (wanted < gridDim.x ? wanted : gridDim.x));
}

// Radix select, one byte a pass: count, per byte at `shift`, the keys that
// share the prefix chosen so far. A block counts in shared memory, then adds
// its 256 counts. Over the candidates, the lanes of a warp that share a byte
// add once: they cluster in few bytes (the first pass's byte is the
// exponent's); over the whole array (measured on an H200) that match costs
// more than it saves.
template <typename Bits, typename Key>
__global__ void histogram(const Bits* __restrict__ bits, long long n, Key mask, Key nan_key,
                          const Key* __restrict__ keys, const unsigned long long* __restrict__ state, int shift,
                          unsigned long long* hist) {
    const bool candidates = state[SOURCE] != 0ULL;
    const long long m = candidates ? static_cast<long long>(state[CANDIDATES]) : n;
    const unsigned used = blocks_for(m);
    if (blockIdx.x >= used) return;
    __shared__ unsigned local[256];
    for (int b = threadIdx.x; b < 256; b += blockDim.x) local[b] = 0u;
    __syncthreads();
    const unsigned lane = threadIdx.x & 31u;
    const Key prefix = static_cast<Key>(state[PREFIX]), prefix_mask = static_cast<Key>(state[PREFIX_MASK]);
    for (long long base = blockIdx.x * (long long)blockDim.x; base < m; base += (long long)used * blockDim.x) {
        long long i = base + threadIdx.x;  // every lane of a warp takes the same trips
        Key key = i >= m ? Key(0) : candidates ? keys[i] : magnitude_key<Bits, Key>(bits[i], mask, nan_key);
        bool take = i < m && (key & prefix_mask) == prefix;
        unsigned byte = take ? static_cast<unsigned>((key >> shift) & 255u) : 256u + lane;
        if (!candidates) {  // over the whole array, the match below costs more than the contention it saves
            if (take) atomicAdd(local + byte, 1u);
            continue;
        }
        unsigned peers = __match_any_sync(FULL_WARP, byte);
        if (take && lane == static_cast<unsigned>(__ffs(peers) - 1)) atomicAdd(local + byte, __popc(peers));
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += blockDim.x)
        if (local[b]) atomicAdd(hist + b, static_cast<unsigned long long>(local[b]));
}

// One block of COMPACT_THREADS (256) threads, a thread a byte: the byte that
// holds the WANTED-th largest key of the histogram, by a scan from the top;
// extend the prefix by it, keep how many are still wanted, and clear the
// histogram for the next pass.
__global__ void choose_byte(unsigned long long* hist, unsigned long long* state, int shift) {
    static_assert(COMPACT_THREADS == 256, "choose_byte's block has a thread for each of the 256 bytes");
    __shared__ unsigned long long buf[COMPACT_THREADS];
    const unsigned b = 255u - threadIdx.x;  // thread 0 holds the top byte: the scan sums from the top
    const unsigned long long wanted = state[WANTED], here = hist[b];
    const unsigned long long at_or_above = block_scan(here, buf), above = at_or_above - here;
    if (above < wanted && wanted <= at_or_above) {  // one byte holds the wanted key
        state[PREFIX] |= static_cast<unsigned long long>(b) << shift;
        state[PREFIX_MASK] |= 255ULL << shift;
        state[WANTED] = wanted - above;
    }
    hist[b] = 0ULL;
}

// Mark, after the radix select, every position whose key is above the k-th
// key in `above` and every one equal to it in `at` (bitmaps, cleared before).
// Over the whole array a warp's 32 entries are one word of each bitmap, so a
// vote writes it; candidates come in any order, so they set bits atomically.
template <typename Bits, typename Key>
__global__ void mark(const Bits* __restrict__ bits, long long n, Key mask, Key nan_key, const Key* __restrict__ keys,
                     const long long* __restrict__ positions, const unsigned long long* __restrict__ state,
                     unsigned* __restrict__ above, unsigned* __restrict__ at) {
    const Key kth = static_cast<Key>(state[PREFIX]);
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (state[SOURCE] != 0ULL) {
        const long long m = static_cast<long long>(state[CANDIDATES]);
        const unsigned used = blocks_for(m);
        if (blockIdx.x >= used) return;
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < m; i += (long long)used * blockDim.x) {
            Key key = keys[i];
            long long p = positions[i];
            if (key > kth) atomicOr(above + (p >> 5), 1u << (p & 31));
            else if (key == kth) atomicOr(at + (p >> 5), 1u << (p & 31));
        }
        return;
    }
    const unsigned lane = threadIdx.x & 31u;
    for (long long base = blockIdx.x * (long long)blockDim.x + (threadIdx.x & ~31u); base < n; base += stride) {
        long long i = base + lane;
        Key key = i < n ? magnitude_key<Bits, Key>(bits[i], mask, nan_key) : Key(0);
        unsigned over = __ballot_sync(FULL_WARP, i < n && key > kth);
        unsigned tied = __ballot_sync(FULL_WARP, i < n && key == kth);
        if (lane == 0u) {
            if (over) above[base >> 5] = over;
            if (tied) at[base >> 5] = tied;
        }
    }
}

// The bits each thread of a compaction block owns: WORDS consecutive words,
// counted as (above, at).
__device__ __forceinline__ void count_words(const unsigned* above, const unsigned* at, long long first,
                                            long long words, unsigned long long* over, unsigned long long* tied) {
    *over = 0ULL;
    *tied = 0ULL;
    for (int u = 0; u < WORDS; ++u) {
        long long w = first + u;
        if (w < words) {
            *over += __popc(above[w]);
            *tied += __popc(at[w]);
        }
    }
}

// Per compaction block: how many bits of each bitmap its words hold
// (sums[b] and sums[blocks + b]).
__global__ void word_sums(const unsigned* __restrict__ above, const unsigned* __restrict__ at, long long words,
                          unsigned long long* __restrict__ sums, long long blocks) {
    __shared__ unsigned long long buf[COMPACT_THREADS];
    unsigned long long over, tied;
    count_words(above, at, (blockIdx.x * (long long)COMPACT_THREADS + threadIdx.x) * WORDS, words, &over, &tied);
    over = block_scan(over, buf);
    tied = block_scan(tied, buf);
    if (threadIdx.x == COMPACT_THREADS - 1) {
        sums[blockIdx.x] = over;
        sums[blocks + blockIdx.x] = tied;
    }
}

// One block: both halves of sums made exclusive prefix sums, in place.
__global__ void scan_sums(unsigned long long* sums, long long blocks) {
    __shared__ unsigned long long buf[COMPACT_THREADS];
    for (int half = 0; half < 2; ++half) {
        unsigned long long* a = sums + half * blocks;
        unsigned long long carry = 0ULL;
        for (long long start = 0; start < blocks; start += COMPACT_THREADS) {
            long long i = start + threadIdx.x;
            unsigned long long v = i < blocks ? a[i] : 0ULL;
            unsigned long long inclusive = block_scan(v, buf);
            unsigned long long total = buf[COMPACT_THREADS - 1];
            __syncthreads();  // every thread has read the total before the next chunk's scan
            if (i < blocks) a[i] = carry + inclusive - v;
            carry += total;
        }
    }
}

// Write the answer in ascending positions: every bit of `above`, and the
// first WANTED bits of `at`. A position's slot is how many of both come
// before it: the above bits before it, plus the tied bits before it, at most
// WANTED of them.
__global__ void write_positions(const unsigned* __restrict__ above, const unsigned* __restrict__ at, long long words,
                                const unsigned long long* __restrict__ sums, long long blocks,
                                const unsigned long long* __restrict__ state, long long* __restrict__ out) {
    __shared__ unsigned long long buf[COMPACT_THREADS];
    const long long first = (blockIdx.x * (long long)COMPACT_THREADS + threadIdx.x) * WORDS;
    unsigned long long over, tied;
    count_words(above, at, first, words, &over, &tied);
    unsigned long long over_before = sums[blockIdx.x] + block_scan(over, buf) - over;
    unsigned long long tied_before = sums[blocks + blockIdx.x] + block_scan(tied, buf) - tied;
    const unsigned long long wanted = state[WANTED];
    for (int u = 0; u < WORDS; ++u) {
        long long w = first + u;
        if (w >= words) break;
        unsigned a = above[w], t = at[w], both = a | t;
        while (both) {
            int j = __ffs(both) - 1;
            both &= both - 1u;
            long long position = w * 32 + j;
            if ((a >> j) & 1u) {
                out[over_before + (tied_before < wanted ? tied_before : wanted)] = position;
                ++over_before;
            } else {
                if (tied_before < wanted) out[over_before + tied_before] = position;
                ++tied_before;
            }
        }
    }
}

// -- where the floor comes from -------------------------------------------------------------

// The keys of a strided sample: keys[i] = key(bits[i * stride]), i < m.
template <typename Bits, typename Key>
__global__ void sample_keys(const Bits* __restrict__ bits, Key mask, Key nan_key, long long stride, long long m,
                            Key* __restrict__ keys) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < m; i += (long long)gridDim.x * blockDim.x)
        keys[i] = magnitude_key<Bits, Key>(bits[i * stride], mask, nan_key);
}

// The sum of the finite magnitudes and how many entries are finite (stats,
// cleared before), and the largest finite key (into HI, cleared before), in
// one read.
template <typename Bits, typename Key>
__global__ void finite_stats(const Bits* __restrict__ bits, long long n, Key mask, Key inf_key, double* stats,
                             unsigned long long* state) {
    double sum = 0.0;
    unsigned long long count = 0, top = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        Bits b = bits[i];
        unsigned long long key = static_cast<Key>(b) & mask;
        if (key < inf_key) {
            sum += magnitude_of(b);
            count += 1;
            top = key > top ? key : top;
        }
    }
    for (int d = 16; d > 0; d >>= 1) {
        sum += __shfl_down_sync(FULL_WARP, sum, d);
        count += __shfl_down_sync(FULL_WARP, count, d);
        unsigned long long other = __shfl_down_sync(FULL_WARP, top, d);
        top = other > top ? other : top;
    }
    if ((threadIdx.x & 31u) == 0u) {
        atomicAdd(stats, sum);
        atomicAdd(stats + 1, static_cast<double>(count));  // exact below 2^53 entries
        atomicMax(state + HI, top);
    }
}

// One thread: the bisection's bracket, the paper's [mean, max]: from the key
// of the mean finite magnitude (0 when none is finite) to just above the
// largest finite key. NaN and Inf lie above every floor in it, and count at each.
// A float64 mean of values that nearly all tie at the top can round above
// the largest: LO is clamped to it, so that the bracket is never empty.
template <typename Bits, typename Key>
__global__ void mean_bracket(const double* stats, unsigned long long* state, Key inf_key) {
    const unsigned long long top = state[HI];
    const unsigned long long mean = stats[1] > 0.0 ? key_at_least<Bits, Key>(stats[0] / stats[1], inf_key) : Key(0);
    state[LO] = mean < top ? mean : top;
    state[HI] = top + 1ULL;
}

// The bucket [f[j], f[j+1]) of a key at or above the lowest floor, by a
// binary search, counted in shared memory.
template <typename Key>
__device__ __forceinline__ void count_in_bucket(Key key, const Key* f, unsigned* bucket) {
    int j = 0;
    for (int step = (FLOORS + 1) / 2; step > 0; step >>= 1)
        if (j + step < FLOORS && f[j + step] <= key) j += step;
    atomicAdd(bucket + j, 1u);
}

// counts[j] += #(key >= floors[j]) for the FLOORS ascending floors, in one
// read of the candidates (when the state says so: the bisection's later
// passes, whose floors all lie at or above the one the candidates were
// gathered at) or of the array. A key at or above the lowest floor counts in
// its bucket; the block adds the buckets' suffix sums. Keys below the lowest
// floor, the most of them in the array, cost one compare. (Counting the
// lowest buckets in registers instead was slower on an H200.)
template <typename Bits, typename Key>
__global__ void count_at_least(const Bits* __restrict__ bits, long long n, Key mask, Key nan_key,
                               const Key* __restrict__ keys, const unsigned long long* __restrict__ state,
                               const Key* __restrict__ floors, unsigned long long* __restrict__ counts) {
    __shared__ Key f[FLOORS];
    __shared__ unsigned bucket[FLOORS];
    for (int j = threadIdx.x; j < FLOORS; j += blockDim.x) {
        f[j] = floors[j];
        bucket[j] = 0u;
    }
    __syncthreads();
    const Key lowest = f[0];
    if (state[SOURCE] != 0ULL) {
        const long long m = static_cast<long long>(state[CANDIDATES]);
        const unsigned used = blocks_for(m);
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; blockIdx.x < used && i < m;
             i += (long long)used * blockDim.x)
            if (keys[i] >= lowest) count_in_bucket<Key>(keys[i], f, bucket);
    } else {
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
                if (start + u * blockDim.x + threadIdx.x < n && key >= lowest) count_in_bucket<Key>(key, f, bucket);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long at_or_above = 0;
        for (int j = FLOORS - 1; j >= 0; --j) {
            at_or_above += bucket[j];
            if (at_or_above) atomicAdd(counts + j, at_or_above);
        }
    }
}

// Every key at or above the floor among the candidates (or, when they are
// not all there, in the array), with its position, appended in any order to
// keys_out and positions_out; COUNT (cleared before) ends with how many, also
// past `capacity`. The bisection's last floor applied to what its first pass
// gathered: a warp takes its slots with one atomic.
// Requires blockDim.x a multiple of 32.
template <typename Bits, typename Key>
__global__ void regather(const Bits* __restrict__ bits, long long n, Key mask, Key nan_key,
                         const Key* __restrict__ keys, const long long* __restrict__ positions,
                         unsigned long long* state, Key* __restrict__ keys_out, long long* __restrict__ positions_out,
                         unsigned long long capacity) {
    const bool candidates = state[SOURCE] != 0ULL;
    const long long m = candidates ? static_cast<long long>(state[CANDIDATES]) : n;
    const Key floor = static_cast<Key>(state[FLOOR]);
    const unsigned lane = threadIdx.x & 31u, below = (1u << lane) - 1u;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long base = blockIdx.x * (long long)blockDim.x + (threadIdx.x & ~31u); base < m; base += stride) {
        long long i = base + lane;  // every lane of a warp takes the same trips
        Key key = i >= m ? Key(0) : candidates ? keys[i] : magnitude_key<Bits, Key>(bits[i], mask, nan_key);
        bool take = i < m && key >= floor;
        unsigned vote = __ballot_sync(FULL_WARP, take);
        if (vote == 0u) continue;
        unsigned long long first = 0ULL;
        if (lane == 0u) first = atomicAdd(state + COUNT, static_cast<unsigned long long>(__popc(vote)));
        first = __shfl_sync(FULL_WARP, first, 0);
        unsigned long long mine = first + __popc(vote & below);
        if (take && mine < capacity) {
            keys_out[mine] = key;
            positions_out[mine] = candidates ? positions[i] : i;
        }
    }
}

// One block of COMPACT_THREADS threads, a thread a floor. After a counting
// pass (`narrow`): narrow the bracket [LO, HI) (LO: the highest floor that
// keeps more than k keys; HI: the lowest that keeps at most k, or the top of
// the bracket when none does; the counts fall as the floors rise, so the
// floors that keep more than k are a prefix). Then spread the next pass's
// floors evenly inside it, ascending and none below LO, clear the counts, and
// make LO the floor.
template <typename Key>
__global__ void steer(unsigned long long* state, Key* floors, unsigned long long* counts, unsigned long long k,
                      int narrow) {
    constexpr int Floors = FLOORS;
    const int j = threadIdx.x;
    if (narrow) {
        const int more = __syncthreads_count(j < Floors && counts[j] > k);
        if (more > 0 && j == more - 1) state[LO] = floors[j];
        if (more < Floors && j == more) state[HI] = floors[j];
        __syncthreads();
    }
    const unsigned long long lo = state[LO], width = state[HI] - lo;
    const unsigned long long step = width / (Floors + 1), rest = width % (Floors + 1);
    if (j < Floors) {
        floors[j] = static_cast<Key>(lo + (j + 1) * step + (j + 1) * rest / (Floors + 1));
        counts[j] = 0ULL;
    }
    if (j == 0) state[FLOOR] = lo;
}

// One thread: the warm start's floor, the last k-th magnitude times the
// margin (rounded up to a key), when that magnitude is above 0 and finite;
// else a floor above every key, which sends the radix select to the whole array.
template <typename Bits, typename Key>
__global__ void warm_floor(unsigned long long* state, const double* margin_of, Key inf_key, Key nan_key) {
    unsigned long long previous = state[PREVIOUS];
    double margin = margin_of[0];
    state[FLOOR] = previous != NO_KEY && previous > 0ULL && previous < inf_key
                       ? key_at_least<Bits, Key>(magnitude_of(static_cast<Bits>(previous)) * margin, inf_key)
                       : static_cast<unsigned long long>(nan_key) + 1ULL;
}

// One thread, after a selection: keep its k-th key for the next call and, with
// `adapt`, move the margin by the rule of threshold.adapted_margin (squared
// when the k-th key fell below the floor, its square root when the floor
// admitted more than 1.5k); a floor above every key moves nothing.
__global__ void settle(unsigned long long* state, double* margin, unsigned long long k, unsigned long long no_floor,
                       int adapt) {
    unsigned long long kth = state[PREFIX], floor = state[FLOOR];
    if (adapt && floor != no_floor) {
        if (kth < floor) margin[0] = margin[0] * margin[0];
        else if (state[COUNT] > 3ULL * k / 2ULL) margin[0] = sqrt(margin[0]);
    }
    state[PREVIOUS] = kth;
}
