// Fused fp32 -> bf16 casts for the CPU: one pass over a shard, the counter-based noise hashed in
// registers, the served bits written in place, and the two counts the caller needs (elements whose
// bits changed against the buffer's previous contents, non-finite outputs) gathered on the way.
//
// The specification is faircast_ds/casts.py (and faircast_ds/noise.py for the hash); the tests
// compare every mode bit for bit. Everything here is integer arithmetic except error feedback's
// fp32 add, subtract and compares, which must behave exactly like torch's: this file is built
// without -ffast-math and with -ffp-contract=off, so nothing is reassociated or fused.
//
// The arithmetic is written once, on vectors as wide as the machine's registers (GCC/Clang vector
// extensions; -march=native picks 16 lanes with AVX-512, 8 with AVX2, else 4). A block's last
// partial vector goes through the same code from a zero-padded copy: zeros cast to zeros, so the
// padding lanes count neither as changed nor as non-finite.
//
// Why it is shaped this way (measured on a 2-core AMD EPYC with AVX-512, see benchmarks/): the
// hash alone is 4 vector multiplies and ~10 shifts per vector, which keeps the vector ports about
// as busy as DRAM is streaming the bytes, so everything else must be nearly free. The selects for
// near-overflow values, Inf and NaN run only for vectors that hold such a lane (one compare and a
// predictable branch decide); "changed" is a mask popcount on the scalar ports where AVX-512BW
// has masks; "non-finite" is counted only in vectors that took the exact path.

#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef uint32_t u32v __attribute__((vector_size(4 * kLanes)));
typedef int32_t i32v __attribute__((vector_size(4 * kLanes)));
typedef float f32v __attribute__((vector_size(4 * kLanes)));
typedef uint16_t u16v __attribute__((vector_size(2 * kLanes)));
typedef int16_t i16v __attribute__((vector_size(2 * kLanes)));

constexpr uint32_t kM1 = 0x21F0AAADu;
constexpr uint32_t kM2 = 0x735A2D97u;
constexpr uint32_t kAbs = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kRnOverflow = 0x7F7F8000u;  // smallest |x| bits that round-to-nearest sends to Inf
constexpr uint32_t kInf16 = 0x7F80u;
constexpr uint32_t kQuiet16 = 0x0040u;

// Blocks end at multiples of kBlock in the element index: the high word of the index and the high
// half of its low word stay constant over a block (see Noise), and the lane counters fit 16 bits.
constexpr int64_t kBlock = int64_t{1} << 16;
constexpr int64_t kGrain = int64_t{1} << 15;  // what ATen's own elementwise kernels use

enum Mode : int64_t { kNearest = 0, kStochastic = 1, kDither = 2, kErrorFeedback = 3 };

template <class V>
[[gnu::always_inline]] inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof v);  // unaligned load: shards start at any element
  return v;
}

template <class V>
[[gnu::always_inline]] inline void store(void* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

template <class To, class From>
[[gnu::always_inline]] inline To bits(const From& v) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &v, sizeof t);
  return t;
}

[[gnu::always_inline]] inline u32v mix32(u32v x) {
  x ^= x >> 16;
  x *= kM1;  // unsigned lanes: wraps mod 2^32, as the specification says
  x ^= x >> 15;
  x *= kM2;
  x ^= x >> 15;
  return x;
}

// mix32 without its first step (x ^= x >> 16), for an x whose high half is known to the caller.
[[gnu::always_inline]] inline u32v mix32_after_first_step(u32v x) {
  x *= kM1;
  x ^= x >> 15;
  x *= kM2;
  x ^= x >> 15;
  return x;
}

[[gnu::always_inline]] inline u32v splat(uint32_t v) { return u32v{} + v; }

// Whether any lane of v is >= t (unsigned). One compare and a mask test where the ISA has them.
[[gnu::always_inline]] inline bool any_at_least(const u32v& v, uint32_t t) {
#if defined(__AVX512F__)
  __m512i a;
  std::memcpy(&a, &v, sizeof a);
  return _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(t))) != 0;
#elif defined(__AVX2__)
  __m256i a;
  std::memcpy(&a, &v, sizeof a);
  const __m256i bias = _mm256_set1_epi32(static_cast<int>(0x80000000u));  // unsigned compare via signed
  const __m256i ge = _mm256_cmpgt_epi32(_mm256_xor_si256(a, bias),
                                        _mm256_set1_epi32(static_cast<int>((t - 1u) ^ 0x80000000u)));
  return !_mm256_testz_si256(ge, ge);
#else
  bool any = false;
  for (int i = 0; i < kLanes; ++i) any |= v[i] >= t;
  return any;
#endif
}

// Lanes whose magnitude bits reach this may round to Inf, be Inf or NaN: vectors holding one take
// the exact path of the specification; all other vectors skip its selects (and cannot produce a
// non-finite output, so they need no non-finite count). 0x7F7F0000 is below every such value.
constexpr uint32_t kRare = 0x7F7F0000u;

// Gathers the two counts of one block.
class Counts {
 public:
  [[gnu::always_inline]] void add(const u16v& old16, const u16v& new16, bool rare) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    static_assert(kLanes == 16);
    __m256i a, b;
    std::memcpy(&a, &old16, sizeof a);
    std::memcpy(&b, &new16, sizeof b);
    changed_ += __builtin_popcount(_mm256_cmpneq_epu16_mask(a, b));  // on the scalar ports
#else
    changed_lanes_ -= old16 != new16;  // -1 in lanes that differ; at most kBlock / kLanes per lane
#endif
    if (__builtin_expect(rare, 0)) {
      for (int i = 0; i < kLanes; ++i) nonfinite_ += (new16[i] & kInf16) == kInf16;
    }
  }

  void finish(int64_t& changed, int64_t& nonfinite) const {
    int64_t ch = changed_;
    for (int i = 0; i < kLanes; ++i) ch += static_cast<uint16_t>(changed_lanes_[i]);  // fits 16 bits
    changed += ch;
    nonfinite += nonfinite_;
  }

 private:
  int64_t changed_ = 0;
  int64_t nonfinite_ = 0;
  i16v changed_lanes_{};
};

// Round-to-nearest-even, as torch's fp32 -> bf16 conversion; NaN becomes `nan16` (torch's choice,
// probed by the caller: the specification leaves the bits of a nearest-mode NaN open).
struct Nearest {
  uint32_t nan16;

  [[gnu::always_inline]] u32v operator()(const u32v& b, bool& rare) const {
    const u32v o = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    const u32v mag = b & kAbs;
    rare = any_at_least(mag, kRare);
    return rare ? (mag > kInfBits ? splat(nan16) : o) : o;
  }
};

// Stochastic rounding and dither (casts.round_with_noise): add the element's 16 noise bits to the
// magnitude and truncate; where round-to-nearest stays finite the carry may not reach Inf.
struct Noise {
  // A block never crosses a multiple of 2^16 in the element index, so over a block the high half
  // of (index_lo ^ key) is constant and mix32's first step, x ^= x >> 16, is one XOR with
  // `key_folded` = key ^ ((index_lo ^ key) >> 16).
  uint32_t key_folded;
  uint32_t hi;  // high word of the element index

  [[gnu::always_inline]] u32v operator()(const u32v& b, const u32v& index_lo, bool& rare) const {
    const u32v noise = mix32(mix32_after_first_step(index_lo ^ key_folded) ^ hi) >> 16;
    const u32v mag = b & kAbs;
    const u32v top = b >> 16;
    const u32v sum = mag + noise;
    rare = any_at_least(mag, kRare);
    if (__builtin_expect(!rare, 1)) return (top & 0x8000u) | (sum >> 16);  // no carry can reach Inf
    // Below the overflow threshold the sum may not pass 0x7F7FFFFF (a carry there could only make
    // 0x7F80 = Inf, where the specification keeps mag >> 16 = 0x7F7F); at or above it (Inf and
    // NaN included) the limit is all ones and never binds. mag < 2^31, so the sign of
    // mag + 0x808000 says which side of 0x7F7F8000 mag is on.
    const u32v limit = splat(0x7F7FFFFFu) | bits<u32v>(bits<i32v>(mag + 0x00808000u) >> 31);
    const u32v r = (sum < limit ? sum : limit) >> 16;
    return mag > kInfBits ? (top | kQuiet16) : ((top & 0x8000u) | r);
  }
};

// Error feedback (casts.error_feedback_step): served = RN(x + e) clamped to x's two bf16
// neighbours, e <- x + e - served. The clamp breaks ties as torch's vectorized clamp does
// (max(a, b) = a > b ? a : b; min(a, b) = a < b ? a : b): it only shows with signed zeros.
struct ErrorFeedback {
  uint32_t nan16;

  [[gnu::always_inline]] u32v operator()(const u32v& b, f32v& residual, bool& rare) const {
    const f32v xv = bits<f32v>(b);
    const u32v mag = b & kAbs;
    const u32v t = b >> 16;
    const f32v lo = bits<f32v>(t << 16);
    const f32v hi = bits<f32v>((t + 1u) << 16);
    const f32v mn = lo < hi ? lo : hi;
    const f32v mx = lo > hi ? lo : hi;
    const f32v y = residual == 0.0f ? xv : xv + residual;  // keeps -0.0 when there is nothing to add
    const u32v yb = bits<u32v>(y);
    const f32v yr = bits<f32v>((yb + 0x7FFFu + ((yb >> 16) & 1u)) & 0xFFFF0000u);  // RN(y) as fp32
    f32v s = yr > mn ? yr : mn;
    s = s < mx ? s : mx;
    // With |x| and |x + e| below kRare every value here is finite: no Inf, no NaN to handle.
    rare = any_at_least(mag | (yb & kAbs), kRare);
    if (__builtin_expect(!rare, 1)) {
      const f32v r_new = y - s;
      const i32v keep = (bits<u32v>(r_new) & kInfBits) != kInfBits;  // y - s can still overflow
      residual = bits<f32v>(bits<u32v>(r_new) & bits<u32v>(keep));
      return bits<u32v>(s) >> 16;
    }
    s = ((bits<u32v>(s) & kAbs) == kInfBits) & (mag < kRnOverflow) ? lo : s;
    const f32v r_new = y - s;
    const i32v keep = (mag < kInfBits) & ((bits<u32v>(r_new) & kInfBits) != kInfBits);  // NaN y: NaN r_new
    residual = bits<f32v>(bits<u32v>(r_new) & bits<u32v>(keep));                           // r_new or +0.0
    const u32v served = (yb & kAbs) > kInfBits ? splat(nan16) : bits<u32v>(s) >> 16;
    const u32v special = mag > kInfBits ? (t | kQuiet16) : t;  // NaN master: quiet NaN; Inf: Inf
    return mag < kInfBits ? served : special;
  }
};

// Change marks (faircast_ds/casting/marks.py): a 1 ORed into the little-endian bitmap at every element
// whose bits the cast changed; never a 0. One Marker per thread: it gathers a vector's changed lanes
// into the current 64-bit word of the bitmap and writes the word when the thread moves past it. A
// word wholly inside the thread's span [lo, hi) of bits is its own: a plain OR. A word at the span's
// edge may be shared with the thread next door: its bytes are ORed atomically, one by one (and only
// the bytes of the bitmap: its length is whole 32-bit words, not 64).
class Marker {
 public:
  Marker(uint8_t* marks, int64_t lo, int64_t hi) : marks_(marks), lo_(lo), hi_(hi) {}
  ~Marker() { flush(); }

  // Lanes i < valid of one vector, the first at bit `pos`.
  [[gnu::always_inline]] void add(int64_t pos, const u16v& old16, const u16v& new16, int valid) {
    static_assert(kLanes <= 64, "a vector's lanes fit one 64-bit word");
    uint64_t m;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    __m256i a, b;  // 16 lanes of 16 bits: one mask compare
    std::memcpy(&a, &old16, sizeof a);
    std::memcpy(&b, &new16, sizeof b);
    m = _mm256_cmpneq_epu16_mask(a, b);
#elif defined(__AVX2__)
    static_assert(kLanes == 8);
    __m128i a, b;  // 8 lanes of 16 bits: compare, narrow to bytes, one bit per lane
    std::memcpy(&a, &old16, sizeof a);
    std::memcpy(&b, &new16, sizeof b);
    const __m128i eq = _mm_cmpeq_epi16(a, b);
    m = ~static_cast<uint64_t>(_mm_movemask_epi8(_mm_packs_epi16(eq, eq))) & 0xFFu;
#else
    m = 0;
    for (int i = 0; i < kLanes; ++i) m |= static_cast<uint64_t>(old16[i] != new16[i]) << i;
#endif
    if (valid < kLanes) m &= (uint64_t{1} << valid) - 1;
    // no early return on m == 0: at a few percent changed, about half the vectors hold a change, and
    // a branch on that mispredicts; ORing a zero costs nothing
    const int64_t w = pos >> 6;
    const int sh = static_cast<int>(pos & 63);
    put(w, m << sh);
    if (sh + kLanes > 64) put(w + 1, m >> (64 - sh));  // the vector crosses into the next word
  }

  void flush() {
    if (acc_ == 0) return;
    const int64_t first = word_ << 6;
    uint8_t* p = marks_ + (word_ << 3);
    if (first >= lo_ && first + 64 <= hi_) {  // wholly this thread's
      uint64_t v;
      std::memcpy(&v, p, sizeof v);
      v |= acc_;
      std::memcpy(p, &v, sizeof v);
    } else {
      for (uint64_t m = acc_; m; m >>= 8, ++p) {
        const uint8_t byte = static_cast<uint8_t>(m & 0xFFu);
        if (byte) __atomic_fetch_or(p, byte, __ATOMIC_RELAXED);
      }
    }
    acc_ = 0;
  }

 private:
  [[gnu::always_inline]] void put(int64_t w, uint64_t bits) {
    if (w != word_) {
      flush();
      word_ = w;
    }
    acc_ |= bits;
  }

  uint8_t* marks_;
  int64_t lo_, hi_;
  int64_t word_ = -1;
  uint64_t acc_ = 0;
};

// One block of n contiguous elements. Full vectors straight from memory; the rest through a
// zero-padded copy of one vector. `marks` (may be null): the change marks, element 0 of the block
// at bit `mark_pos`.
template <class Op>
void run_block(const Op& op, const float* x, uint16_t* out, float* res, int64_t n, uint32_t index_lo,
               int64_t& changed, int64_t& nonfinite, Marker* marks, int64_t mark_pos) {
  Counts c;
  u32v index = splat(index_lo);
  for (int i = 0; i < kLanes; ++i) index[i] += static_cast<uint32_t>(i);
  int64_t k = 0;
  auto step = [&](const float* xp, uint16_t* op16, float* rp, int valid) {
    const u32v b = load<u32v>(xp);
    const u16v old16 = load<u16v>(op16);
    u32v o;
    bool rare;
    if constexpr (std::is_same_v<Op, Noise>) {
      o = op(b, index, rare);
    } else if constexpr (std::is_same_v<Op, ErrorFeedback>) {
      f32v r = load<f32v>(rp);
      o = op(b, r, rare);
      store(rp, r);
    } else {
      o = op(b, rare);
    }
    const u16v o16 = __builtin_convertvector(o, u16v);
    c.add(old16, o16, rare);
    if (marks) marks->add(mark_pos + k, old16, o16, valid);
    store(op16, o16);
    index += static_cast<uint32_t>(kLanes);
  };
  for (; k + kLanes <= n; k += kLanes) step(x + k, out + k, res ? res + k : nullptr, kLanes);
  if (k < n) {
    alignas(64) float xb[kLanes] = {};
    alignas(64) float rb[kLanes] = {};
    alignas(64) uint16_t ob[kLanes] = {};
    const int64_t m = n - k;
    std::memcpy(xb, x + k, m * sizeof(float));
    std::memcpy(ob, out + k, m * sizeof(uint16_t));
    if (res) std::memcpy(rb, res + k, m * sizeof(float));
    step(xb, ob, rb, static_cast<int>(m));
    std::memcpy(out + k, ob, m * sizeof(uint16_t));
    if (res) std::memcpy(res + k, rb, m * sizeof(float));
  }
  c.finish(changed, nonfinite);
}

// Casts elements [p, p + m) of the shard, whose parameter indices are [index, index + m), cut into
// blocks that never cross a multiple of kBlock in the index (see Noise).
// `marks` (may be null): the change marks, shard element 0 at bit `mark_base`.
void cast_span(int64_t mode, uint16_t* out, const float* x, float* res, int64_t p, int64_t m, uint64_t index,
               uint32_t key, uint32_t nan16, int64_t& ch, int64_t& nf, Marker* marks, int64_t mark_base) {
  while (m > 0) {
    const uint64_t lo = index & 0xFFFFFFFFu;
    const int64_t b = std::min<int64_t>(m, kBlock - static_cast<int64_t>(index % kBlock));
    float* r = res ? res + p : nullptr;
    switch (mode) {
      case kNearest:
        run_block(Nearest{nan16}, x + p, out + p, r, b, 0, ch, nf, marks, mark_base + p);
        break;
      case kStochastic:
      case kDither:
        run_block(Noise{key ^ ((static_cast<uint32_t>(lo) ^ key) >> 16), static_cast<uint32_t>(index >> 32)},
                  x + p, out + p, r, b, static_cast<uint32_t>(lo), ch, nf, marks, mark_base + p);
        break;
      case kErrorFeedback:
        run_block(ErrorFeedback{nan16}, x + p, out + p, r, b, 0, ch, nf, marks, mark_base + p);
        break;
    }
    p += b;
    index += static_cast<uint64_t>(b);
    m -= b;
  }
}

void check_mode(int64_t mode, uintptr_t res_ptr) {
  if (mode < kNearest || mode > kErrorFeedback) throw std::invalid_argument("unknown cast mode");
  if (mode == kErrorFeedback && res_ptr == 0) throw std::invalid_argument("error feedback needs a residual");
}

// Casts elements [0, n) of a contiguous shard holding indices [start, start + n) of one parameter.
// Pointers come from tensors the Python side has checked (dtype, length, contiguity, device).
pybind11::tuple cast_into(int64_t mode, uintptr_t out_ptr, uintptr_t x_ptr, uintptr_t res_ptr, int64_t n,
                          int64_t start, int64_t key, int64_t nan16, uintptr_t marks_ptr, int64_t mark_base) {
  check_mode(mode, res_ptr);
  auto* out = reinterpret_cast<uint16_t*>(out_ptr);
  const auto* x = reinterpret_cast<const float*>(x_ptr);
  auto* res = mode == kErrorFeedback ? reinterpret_cast<float*>(res_ptr) : nullptr;
  auto* marks = reinterpret_cast<uint8_t*>(marks_ptr);
  std::atomic<int64_t> changed{0}, nonfinite{0};
  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      int64_t ch = 0, nf = 0;
      Marker marker(marks, mark_base + begin, mark_base + end);
      cast_span(mode, out, x, res, begin, end - begin, static_cast<uint64_t>(start + begin),
                static_cast<uint32_t>(key), static_cast<uint32_t>(nan16), ch, nf, marks ? &marker : nullptr,
                mark_base);
      marker.flush();
      changed += ch;
      nonfinite += nf;
    });
  }
  return pybind11::make_tuple(changed.load(), nonfinite.load());
}

// Casts elements [0, n) of a contiguous shard made of runs of one parameter: run r holds shard elements
// [offsets[r], offsets[r + 1]) and parameter indices [starts[r], starts[r] + offsets[r + 1] - offsets[r]).
// offsets (nruns + 1 of them, from 0 up to n, non-decreasing) and starts (nruns, non-negative) come
// checked from the Python side (faircast_ds/runs.py). One parallel loop over the whole shard: each thread
// finds the run its first element is in, then walks the runs.
pybind11::tuple cast_runs_into(int64_t mode, uintptr_t out_ptr, uintptr_t x_ptr, uintptr_t res_ptr, int64_t n,
                               uintptr_t offsets_ptr, uintptr_t starts_ptr, int64_t nruns, int64_t key,
                               int64_t nan16, uintptr_t marks_ptr, int64_t mark_base) {
  check_mode(mode, res_ptr);
  if (nruns < 1) throw std::invalid_argument("cast_runs_into needs at least one run");
  auto* out = reinterpret_cast<uint16_t*>(out_ptr);
  const auto* x = reinterpret_cast<const float*>(x_ptr);
  auto* res = mode == kErrorFeedback ? reinterpret_cast<float*>(res_ptr) : nullptr;
  const auto* offsets = reinterpret_cast<const int64_t*>(offsets_ptr);
  const auto* starts = reinterpret_cast<const int64_t*>(starts_ptr);
  auto* marks = reinterpret_cast<uint8_t*>(marks_ptr);
  if (offsets[0] != 0 || offsets[nruns] != n) throw std::invalid_argument("the runs do not cover the shard");
  std::atomic<int64_t> changed{0}, nonfinite{0};
  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      int64_t ch = 0, nf = 0;
      Marker marker(marks, mark_base + begin, mark_base + end);
      // the last run starting at or before `begin` (a non-empty one: it reaches past `begin`)
      int64_t r = std::upper_bound(offsets, offsets + nruns + 1, begin) - offsets - 1;
      for (int64_t p = begin; p < end; ++r) {
        const int64_t stop = std::min(offsets[r + 1], end);
        cast_span(mode, out, x, res, p, stop - p, static_cast<uint64_t>(starts[r] + (p - offsets[r])),
                  static_cast<uint32_t>(key), static_cast<uint32_t>(nan16), ch, nf, marks ? &marker : nullptr,
                  mark_base);
        p = std::max(p, stop);
      }
      changed += ch;
      nonfinite += nf;
    });
  }
  return pybind11::make_tuple(changed.load(), nonfinite.load());
}

// The guard's block digests (faircast_ds/guard.py, block_digests): for each block of `block` 16-bit
// patterns, the sum of each pattern times the fixed weight of its position (weights below 2^31: a
// block of 4,096 stays below 2^59, so the sum is exact and its order does not matter). One read of
// the bits; the weights stay in cache.
void block_digests(uintptr_t bits_ptr, int64_t n, uintptr_t out_ptr, uintptr_t weights_ptr, int64_t block) {
  if (block < 1 || block > 4096) throw std::invalid_argument("digest blocks hold 1 to 4096 elements");
  const auto* bits = reinterpret_cast<const uint16_t*>(bits_ptr);
  auto* out = reinterpret_cast<int64_t*>(out_ptr);
  const auto* w = reinterpret_cast<const uint32_t*>(weights_ptr);
  const int64_t blocks = (n + block - 1) / block;
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, blocks, std::max<int64_t>(1, kGrain / block), [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) {
      const uint16_t* b = bits + k * block;
      const int64_t m = std::min(block, n - k * block);
      uint64_t acc = 0;
      for (int64_t i = 0; i < m; ++i) acc += uint64_t{b[i]} * uint64_t{w[i]};
      out[k] = static_cast<int64_t>(acc);
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "faircast-ds fused fp32 -> bf16 casts (CPU)";
  m.def("cast_into", &cast_into, "Cast a contiguous fp32 shard into a contiguous bf16 buffer in place");
  m.def("cast_runs_into", &cast_runs_into,
        "The same for a shard made of runs of the parameter (run starts and shard offsets given)");
  m.def("block_digests", &block_digests, "The guard's weighted sums of blocks of 16-bit patterns");
  m.def("lanes", [] { return kLanes; }, "Vector lanes this build computes with");
  m.def("mask_counts", [] {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return true;
#else
    return false;
#endif
  }, "Whether 'changed' is counted with AVX-512 mask popcounts (else with generic vector code)");
}
