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
// hash is 4 vector multiplies and ~10 shifts per vector, and with the rounding it keeps the
// vector ports busy for about as long as DRAM needs to stream the bytes. The two counts must not
// add to that: "changed" is a mask popcount on the scalar ports where AVX-512BW has the masks,
// and "non-finite" is one running max per vector, recounted exactly only for a block whose max
// says it holds a NaN or Inf (rare).

#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#if defined(__AVX512BW__) && defined(__AVX512VL__)
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

// Elements per inner call: keeps the high word of the index constant and the counters in 32 bits.
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

[[gnu::always_inline]] inline u32v splat(uint32_t v) { return u32v{} + v; }

// Gathers the two counts of one block.
class Counts {
 public:
  [[gnu::always_inline]] void add(const u16v& old16, const u16v& new16) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    static_assert(kLanes == 16);
    __m256i a, b;
    std::memcpy(&a, &old16, sizeof a);
    std::memcpy(&b, &new16, sizeof b);
    changed_ += __builtin_popcount(_mm256_cmpneq_epu16_mask(a, b));
#else
    changed_lanes_ -= old16 != new16;  // -1 in lanes that differ; at most kBlock / kLanes per lane
#endif
    const u16v magnitude = new16 & 0x7FFFu;
    top_ = top_ > magnitude ? top_ : magnitude;
  }

  // The block's counts, once its outputs are in `out[0, n)`.
  void finish(const uint16_t* out, int64_t n, int64_t& changed, int64_t& nonfinite) const {
    int64_t ch = changed_;
    uint16_t top = 0;
    for (int i = 0; i < kLanes; ++i) {
      ch += static_cast<uint16_t>(changed_lanes_[i]);  // counts up to 65536 / kLanes fit 16 bits
      top = std::max<uint16_t>(top, top_[i]);
    }
    changed += ch;
    if (top >= kInf16) {  // some output is NaN or Inf: count them exactly
      for (int64_t k = 0; k < n; ++k) nonfinite += (out[k] & kInf16) == kInf16;
    }
  }

 private:
  int64_t changed_ = 0;
  i16v changed_lanes_{};
  u16v top_{};
};

// Round-to-nearest-even, as torch's fp32 -> bf16 conversion; NaN becomes `nan16` (torch's choice,
// probed by the caller: the specification leaves the bits of a nearest-mode NaN open).
struct Nearest {
  uint32_t nan16;

  u32v operator()(const u32v& b) const {
    const u32v o = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    return (b & kAbs) > kInfBits ? splat(nan16) : o;
  }
};

// Stochastic rounding and dither (casts.round_with_noise): add the element's 16 noise bits to the
// magnitude and truncate; where round-to-nearest stays finite the carry may not reach Inf.
struct Noise {
  uint32_t key;
  uint32_t hi;  // high word of the element index, constant over a block

  u32v operator()(const u32v& b, const u32v& index_lo) const {
    const u32v noise = mix32(mix32(index_lo ^ key) ^ hi) >> 16;
    const u32v mag = b & kAbs;
    // Below the overflow threshold the sum may not pass 0x7F7FFFFF (a carry there could only make
    // 0x7F80 = Inf, where the specification keeps mag >> 16 = 0x7F7F); at or above it (Inf and
    // NaN included) the limit is all ones and never binds. mag < 2^31, so the sign of
    // mag + 0x808000 says which side of 0x7F7F8000 mag is on.
    const u32v limit = splat(0x7F7FFFFFu) | bits<u32v>(bits<i32v>(mag + 0x00808000u) >> 31);
    const u32v sum = mag + noise;
    const u32v r = (sum < limit ? sum : limit) >> 16;
    const u32v top = b >> 16;
    return mag > kInfBits ? (top | kQuiet16) : ((top & 0x8000u) | r);
  }
};

// Error feedback (casts.error_feedback_step): served = RN(x + e) clamped to x's two bf16
// neighbours, e <- x + e - served. The clamp breaks ties as torch's vectorized clamp does
// (max(a, b) = a > b ? a : b; min(a, b) = a < b ? a : b): it only shows with signed zeros.
struct ErrorFeedback {
  uint32_t nan16;

  u32v operator()(const u32v& b, f32v& residual) const {
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
    s = ((bits<u32v>(s) & kAbs) == kInfBits) & (mag < kRnOverflow) ? lo : s;
    const f32v r_new = y - s;
    const i32v keep = (mag < kInfBits) & ((bits<u32v>(r_new) & kInfBits) != kInfBits);  // NaN y: NaN r_new
    residual = bits<f32v>(bits<u32v>(r_new) & bits<u32v>(keep));                           // r_new or +0.0
    const u32v served = (yb & kAbs) > kInfBits ? splat(nan16) : bits<u32v>(s) >> 16;
    const u32v special = mag > kInfBits ? (t | kQuiet16) : t;  // NaN master: quiet NaN; Inf: Inf
    return mag < kInfBits ? served : special;
  }
};

// One block of n contiguous elements. Full vectors straight from memory; the rest through a
// zero-padded copy of one vector.
template <class Op>
void run_block(const Op& op, const float* x, uint16_t* out, float* res, int64_t n, uint32_t index_lo,
               int64_t& changed, int64_t& nonfinite) {
  Counts c;
  u32v index = splat(index_lo);
  for (int i = 0; i < kLanes; ++i) index[i] += static_cast<uint32_t>(i);
  int64_t k = 0;
  auto step = [&](const float* xp, uint16_t* op16, float* rp) {
    const u32v b = load<u32v>(xp);
    const u16v old16 = load<u16v>(op16);
    u32v o;
    if constexpr (std::is_same_v<Op, Noise>) {
      o = op(b, index);
    } else if constexpr (std::is_same_v<Op, ErrorFeedback>) {
      f32v r = load<f32v>(rp);
      o = op(b, r);
      store(rp, r);
    } else {
      o = op(b);
    }
    const u16v o16 = __builtin_convertvector(o, u16v);
    c.add(old16, o16);
    store(op16, o16);
    index += static_cast<uint32_t>(kLanes);
  };
  for (; k + kLanes <= n; k += kLanes) step(x + k, out + k, res ? res + k : nullptr);
  if (k < n) {
    alignas(64) float xb[kLanes] = {};
    alignas(64) float rb[kLanes] = {};
    alignas(64) uint16_t ob[kLanes] = {};
    const int64_t m = n - k;
    std::memcpy(xb, x + k, m * sizeof(float));
    std::memcpy(ob, out + k, m * sizeof(uint16_t));
    if (res) std::memcpy(rb, res + k, m * sizeof(float));
    step(xb, ob, rb);
    std::memcpy(out + k, ob, m * sizeof(uint16_t));
    if (res) std::memcpy(res + k, rb, m * sizeof(float));
  }
  c.finish(out, n, changed, nonfinite);
}

// Casts elements [0, n) of a contiguous shard holding indices [start, start + n) of one parameter.
// Pointers come from tensors the Python side has checked (dtype, length, contiguity, device).
pybind11::tuple cast_into(int64_t mode, uintptr_t out_ptr, uintptr_t x_ptr, uintptr_t res_ptr, int64_t n,
                          int64_t start, int64_t key, int64_t nan16) {
  if (mode < kNearest || mode > kErrorFeedback) throw std::invalid_argument("unknown cast mode");
  if (mode == kErrorFeedback && res_ptr == 0) throw std::invalid_argument("error feedback needs a residual");
  auto* out = reinterpret_cast<uint16_t*>(out_ptr);
  const auto* x = reinterpret_cast<const float*>(x_ptr);
  auto* res = mode == kErrorFeedback ? reinterpret_cast<float*>(res_ptr) : nullptr;
  std::atomic<int64_t> changed{0}, nonfinite{0};
  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      int64_t ch = 0, nf = 0;
      for (int64_t p = begin; p < end;) {
        const auto index = static_cast<uint64_t>(start + p);
        const uint64_t lo = index & 0xFFFFFFFFu;
        const int64_t m = std::min<int64_t>({end - p, kBlock, static_cast<int64_t>((uint64_t{1} << 32) - lo)});
        float* r = res ? res + p : nullptr;
        switch (mode) {
          case kNearest:
            run_block(Nearest{static_cast<uint32_t>(nan16)}, x + p, out + p, r, m, 0, ch, nf);
            break;
          case kStochastic:
          case kDither:
            run_block(Noise{static_cast<uint32_t>(key), static_cast<uint32_t>(index >> 32)}, x + p, out + p, r, m,
                      static_cast<uint32_t>(lo), ch, nf);
            break;
          case kErrorFeedback:
            run_block(ErrorFeedback{static_cast<uint32_t>(nan16)}, x + p, out + p, r, m, 0, ch, nf);
            break;
        }
        p += m;
      }
      changed += ch;
      nonfinite += nf;
    });
  }
  return pybind11::make_tuple(changed.load(), nonfinite.load());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "faircast-ds fused fp32 -> bf16 casts (CPU)";
  m.def("cast_into", &cast_into, "Cast a contiguous fp32 shard into a contiguous bf16 buffer in place");
  m.def("lanes", [] { return kLanes; }, "Vector lanes this build computes with");
  m.def("mask_counts", [] {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return true;
#else
    return false;
#endif
  }, "Whether 'changed' is counted with AVX-512 mask popcounts (else with generic vector code)");
}
