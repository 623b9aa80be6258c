// y = x @ W.T with W held as GGUF blocks (Q4_0, Q4_1, Q8_0) for the CPU, llama.cpp's way: each
// block of 32 activations is rounded to int8 with its own float32 scale (dx = max|x| / 127, as
// llama.cpp's Q8_0/Q8_1 activations are), and each block's product is an integer dot product
// (AVX512-VNNI's vpdpbusd, or AVX2's vpmaddubsw and vpmaddwd), scaled in float32.
//
// The weights are laid out for it at load (paged_attention/modeling/quantized.py, GGUFLinearWeights): per
// group of 16 output rows and per block of 32 inputs, `qs` holds the 32 x 16 quants, four
// consecutive inputs of one row per 32-bit lane (so one vector is four inputs of 16 rows):
//   Q4_0, Q4_1  256 bytes: byte 64 i + 4 r + t holds input 4 i + t of row r in its low nibble and
//               input 16 + 4 i + t in its high nibble (i in 0..3), the q in 0..15;
//   Q8_0        512 bytes: byte 64 i + 4 r + t is input 4 i + t of row r (i in 0..7), int8.
// and `scales` (int16, 64 bytes) the 16 rows' d (the file's float16), then a second field per
// row, from which the kernel takes e, where a block's product is
//   d * dx * dot(q, qx) + e * s
// with qx the int8 activations and s:
//   Q4_1  field m (float16): e = m, s = dx * sum(qx);
//   Q4_0  (w = d (q - 8)) field d again: e = d, s = -8 dx * sum(qx);
//   Q8_0  the activations enter vpdpbusd unsigned, as qx + 128: field sum(q) (an int16, the
//         row's quants summed over the block): e = -128 d * sum(q), s = dx.
// So a block of 16 rows reads 2 bytes per row beside its quants for Q4_0 and Q4_1, as the file
// does, and 4 for Q8_0 (2 in the file): fewer bytes per decoded token than float32 fields.
//
// Variants: "vnni" (AVX-512 with VNNI, usable when torch's capability and the CPU say AVX-512
// and the CPU has VNNI, see variants.h), "avx2" (AVX2 with FMA and F16C, usable when torch's
// capability is AVX2 or AVX-512) and "reference", the portable scalar loop of the same
// arithmetic; "auto" picks the first usable of these. Output rows are split over torch's
// intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu/variants.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PA_HAVE_GGUF_SIMD 1
#define PA_GGUF_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define PA_GGUF_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#endif

namespace paged_attention::cpu {
namespace {

constexpr int64_t kGroup = 32;  // inputs per block
constexpr int64_t kRows = 16;   // output rows per group
constexpr int64_t kTile = 4;    // activation rows that share one read of the weights

enum class Format { kQ4_0, kQ4_1, kQ8_0 };

Format parse_format(const std::string& name) {
  if (name == "Q4_0") return Format::kQ4_0;
  if (name == "Q4_1") return Format::kQ4_1;
  TORCH_CHECK_VALUE(name == "Q8_0", "gguf_linear: format must be Q4_0, Q4_1 or Q8_0, got ", name);
  return Format::kQ8_0;
}

int64_t quant_bytes(Format format) { return format == Format::kQ8_0 ? 512 : 256; }

// The activations of `rows` rows, per block: int8 quants (unsigned, +128, for Q8_0), dx and s.
struct QuantizedActivations {
  std::vector<uint8_t> q;  // rows x k
  std::vector<float> dx;   // rows x blocks
  std::vector<float> s;    // rows x blocks
};

// v rounded to the nearest integer, ties to even, for |v| <= 2^22: adding 1.5 * 2^23 leaves no
// fraction bits, so float addition rounds (in the default rounding mode, as nearbyint would);
// std::nearbyint is a library call on baseline x86-64, a fixed cost of microseconds per call here.
inline float round_to_nearest_even(float v) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  return (v + kShift) - kShift;  // kept as written: the build does not allow reassociation
}

// Fills `a` with the activations of x (rows x k, contiguous, float or bfloat16), quantized per
// block; blocks split over torch's threads when there are many (a prefill).
template <typename scalar_t>
void quantize_activations(const scalar_t* x, int64_t rows, int64_t k, Format format,
                          QuantizedActivations& a) {
  const int64_t blocks = k / kGroup;
  a.q.resize(rows * k);
  a.dx.resize(rows * blocks);
  a.s.resize(rows * blocks);
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    float xb[kGroup];
    for (int64_t i = begin; i < end; ++i) {
      float amax = 0.0f;
      bool finite = true;
      for (int j = 0; j < kGroup; ++j) {
        xb[j] = static_cast<float>(x[i * kGroup + j]);
        finite = finite && std::isfinite(xb[j]);
        amax = std::max(amax, std::fabs(xb[j]));
      }
      if (!finite) {
        // A NaN would be lost to the max above and an infinity has no int8 step (converting
        // either to int is undefined): the block's quants are zero and its scale NaN, so every
        // output of the row is NaN, as a float product with such an input is NaN or infinite.
        const uint8_t zero = format == Format::kQ8_0 ? 128 : 0;
        std::fill(a.q.begin() + i * kGroup, a.q.begin() + (i + 1) * kGroup, zero);
        a.dx[i] = a.s[i] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      // A block too small for 127 / amax in float (below about 4e-37) rounds to zero steps: its
      // products are below the error bound's float32 margin.
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      const float dx = std::isfinite(inverse) ? amax / 127.0f : 0.0f;
      int sum = 0;
      for (int j = 0; j < kGroup; ++j) {
        const int q = dx > 0.0f ? static_cast<int>(round_to_nearest_even(xb[j] * inverse)) : 0;
        sum += q;
        a.q[i * kGroup + j] = static_cast<uint8_t>(format == Format::kQ8_0 ? q + 128 : q);
      }
      a.dx[i] = dx;
      // Q4_0's -8 goes to this side, so that its second field is the file's d, exactly.
      const float weight_offset = format == Format::kQ4_0 ? -8.0f : 1.0f;
      a.s[i] = format == Format::kQ8_0 ? dx : weight_offset * dx * static_cast<float>(sum);
    }
  });
}

// The quant of input j (0..31) of row r in one block of `qs`.
int weight_quant(Format format, const uint8_t* qs, int r, int j) {
  if (format == Format::kQ8_0) return static_cast<int8_t>(qs[64 * (j / 4) + 4 * r + j % 4]);
  const int low = j % 16;
  const uint8_t byte = qs[64 * (low / 4) + 4 * r + low % 4];
  return j < 16 ? byte & 15 : byte >> 4;
}

struct Problem {
  Format format;
  const uint8_t* qs;
  const uint16_t* scales;
  int64_t k, n;
  const QuantizedActivations* a;
  void* y;  // rows x n, float or bfloat16
  bool bf16;

  void store(int64_t index, const float* values, int count) const {
    if (bf16) {
      auto* out = static_cast<c10::BFloat16*>(y) + index;
      for (int i = 0; i < count; ++i) out[i] = c10::BFloat16(values[i]);
    } else {
      std::memcpy(static_cast<float*>(y) + index, values, count * sizeof(float));
    }
  }
};

float half_to_float(uint16_t bits) { return c10::Half(bits, c10::Half::from_bits()); }

// e of the block product (see the top of this file) from a row's d and its second field.
float second_factor(Format format, float d, uint16_t field) {
  if (format == Format::kQ8_0) return -128.0f * d * static_cast<float>(static_cast<int16_t>(field));
  return half_to_float(field);
}

// Output groups [begin, end) of activation rows [row0, row0 + rows).
void groups_reference(const Problem& p, int64_t row0, int64_t rows, int64_t begin, int64_t end) {
  const int64_t blocks = p.k / kGroup, bytes = quant_bytes(p.format);
  for (int64_t g = begin; g < end; ++g) {
    for (int64_t row = row0; row < row0 + rows; ++row) {
      for (int r = 0; r < kRows; ++r) {
        float sum = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* qs = p.qs + (g * blocks + b) * bytes;
          const uint16_t* fields = p.scales + (g * blocks + b) * 2 * kRows;
          const uint8_t* qx = p.a->q.data() + row * p.k + b * kGroup;
          int32_t dot = 0;
          for (int j = 0; j < kGroup; ++j) {
            const int x = p.format == Format::kQ8_0 ? qx[j] : static_cast<int8_t>(qx[j]);
            dot += weight_quant(p.format, qs, r, j) * x;
          }
          const float dx = p.a->dx[row * blocks + b], s = p.a->s[row * blocks + b];
          const float d = half_to_float(fields[r]);
          const float e = second_factor(p.format, d, fields[kRows + r]);
          sum += d * dx * static_cast<float>(dot) + e * s;
        }
        p.store(row * p.n + g * kRows + r, &sum, 1);
      }
    }
  }
}

#ifdef PA_HAVE_GGUF_SIMD

// One block's int32 dot products of 16 rows with one activation row: four independent chains.
template <Format kFormat>
PA_GGUF_VNNI_TARGET inline __m512i block_dot(const __m512i* w, const uint8_t* qx) {
  __m512i chains[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                       _mm512_setzero_si512()};
  for (int i = 0; i < 8; ++i) {
    // Vector i holds inputs 4 i .. 4 i + 3 of the 16 rows (Q4: i >= 4 are the high nibbles,
    // inputs 16 + 4 (i - 4) .., which is 4 i again).
    int32_t quad;
    std::memcpy(&quad, qx + 4 * i, sizeof(quad));
    const __m512i x = _mm512_set1_epi32(quad);
    if constexpr (kFormat == Format::kQ8_0) {
      chains[i % 4] = _mm512_dpbusd_epi32(chains[i % 4], x, w[i]);  // x unsigned, w signed
    } else {
      chains[i % 4] = _mm512_dpbusd_epi32(chains[i % 4], w[i], x);  // w unsigned, x signed
    }
  }
  return _mm512_add_epi32(_mm512_add_epi32(chains[0], chains[1]),
                          _mm512_add_epi32(chains[2], chains[3]));
}

template <Format kFormat, int kTileRows>
PA_GGUF_VNNI_TARGET void groups_vnni(const Problem& p, int64_t row0, int64_t begin, int64_t end) {
  constexpr int64_t kBytes = kFormat == Format::kQ8_0 ? 512 : 256;
  const int64_t blocks = p.k / kGroup;
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int64_t g = begin; g < end; ++g) {
    __m512 acc[kTileRows][2];
    for (auto& pair : acc) pair[0] = pair[1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* qs = p.qs + (g * blocks + b) * kBytes;
      const uint16_t* fields = p.scales + (g * blocks + b) * 2 * kRows;
      __m512i w[8];
      if constexpr (kFormat == Format::kQ8_0) {
        for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(qs + 64 * i);
      } else {
        for (int i = 0; i < 4; ++i) {
          const __m512i bytes = _mm512_loadu_si512(qs + 64 * i);
          w[i] = _mm512_and_si512(bytes, nibble);
          w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
        }
      }
      const auto* halves = reinterpret_cast<const __m256i*>(fields);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(halves));
      const __m256i second = _mm256_loadu_si256(halves + 1);  // the 16 rows' second fields
      __m512 e;
      if constexpr (kFormat == Format::kQ8_0) {
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(second));
        e = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(-128.0f)), sums);
      } else {
        e = _mm512_cvtph_ps(second);
      }
      for (int r = 0; r < kTileRows; ++r) {
        const int64_t row = row0 + r;
        const __m512i dot = block_dot<kFormat>(w, p.a->q.data() + row * p.k + b * kGroup);
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(p.a->dx[row * blocks + b]));
        acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(e, _mm512_set1_ps(p.a->s[row * blocks + b]), acc[r][1]);
      }
    }
    for (int r = 0; r < kTileRows; ++r) {
      alignas(64) float sums[kRows];
      _mm512_store_ps(sums, _mm512_add_ps(acc[r][0], acc[r][1]));
      p.store((row0 + r) * p.n + g * kRows, sums, kRows);
    }
  }
}


// AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned by signed bytes and adds each pair of
// products into a saturating int16, vpmaddwd by ones adds the pairs into the row's int32 lane.
// A vector holds 8 rows, so a group of 16 rows is two halves, each a 32-byte half of the
// layout's 64-byte vectors.
//
// One block's int32 dot products of 8 rows (one half) with one activation row.
template <Format kFormat>
PA_GGUF_AVX2_TARGET inline __m256i block_dot_avx2(const __m256i* w, const uint8_t* qx) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kFormat == Format::kQ8_0) {
    // The activations are kept as qx + 128 (for vpdpbusd); signed again here. The products are
    // taken as |w| times x with w's sign, so each pair stays within int16: |w| <= 128 and
    // |x| <= 127 give at most 32512. So this dot is of the signed activations: the block's
    // offset term, which undoes the + 128, is not added (groups_avx2).
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {
      int32_t quad;
      std::memcpy(&quad, qx + 4 * i, sizeof(quad));
      const __m256i x = _mm256_xor_si256(_mm256_set1_epi32(quad), flip);
      const __m256i pairs =
          _mm256_maddubs_epi16(_mm256_abs_epi8(w[i]), _mm256_sign_epi8(x, w[i]));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
    }
    return sum;
  } else {
    // q in 0..15 and |x| <= 127: a pair is at most 3810, eight pairs 30480, within int16, so
    // the pairs of all 8 vectors add up before one widening.
    __m256i pairs = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {
      int32_t quad;
      std::memcpy(&quad, qx + 4 * i, sizeof(quad));
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(quad)));
    }
    return _mm256_madd_epi16(pairs, ones);
  }
}

// Half h of each group is a pass over the group's blocks of its own, so that the 8 weight
// vectors and the tile's accumulators fit AVX2's 16 registers; the second pass reads the
// group's weights (4.5 KB at 576 inputs) from L1.
template <Format kFormat, int kTileRows>
PA_GGUF_AVX2_TARGET void groups_avx2(const Problem& p, int64_t row0, int64_t begin, int64_t end) {
  constexpr int64_t kBytes = kFormat == Format::kQ8_0 ? 512 : 256;
  const int64_t blocks = p.k / kGroup;
  const __m256i nibble = _mm256_set1_epi8(15);
  for (int64_t g = begin; g < end; ++g) {
    for (int h = 0; h < 2; ++h) {
      __m256 acc[kTileRows];
      for (auto& sum : acc) sum = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* qs = p.qs + (g * blocks + b) * kBytes + 32 * h;
        const uint16_t* fields = p.scales + (g * blocks + b) * 2 * kRows + 8 * h;
        __m256i w[8];
        if constexpr (kFormat == Format::kQ8_0) {
          for (int i = 0; i < 8; ++i) w[i] = _mm256_loadu_si256((const __m256i*)(qs + 64 * i));
        } else {
          for (int i = 0; i < 4; ++i) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i*)(qs + 64 * i));
            w[i] = _mm256_and_si256(bytes, nibble);
            w[i + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
          }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)fields));
        for (int r = 0; r < kTileRows; ++r) {
          const int64_t row = row0 + r;
          const __m256i dot = block_dot_avx2<kFormat>(w, p.a->q.data() + row * p.k + b * kGroup);
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(p.a->dx[row * blocks + b]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
          if constexpr (kFormat != Format::kQ8_0) {
            const __m256 e = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(fields + kRows)));
            acc[r] = _mm256_fmadd_ps(e, _mm256_set1_ps(p.a->s[row * blocks + b]), acc[r]);
          }
        }
      }
      for (int r = 0; r < kTileRows; ++r) {
        alignas(32) float sums[8];
        _mm256_store_ps(sums, acc[r]);
        p.store((row0 + r) * p.n + g * kRows + 8 * h, sums, 8);
      }
    }
  }
}

using GroupsFn = void (*)(const Problem&, int64_t, int64_t, int64_t);

template <Format kFormat, int kTileRows>
GroupsFn groups_for(bool vnni) {
  return vnni ? &groups_vnni<kFormat, kTileRows> : &groups_avx2<kFormat, kTileRows>;
}

template <Format kFormat>
GroupsFn groups_for(bool vnni, int64_t tile_rows) {
  switch (tile_rows) {
    case 1:
      return groups_for<kFormat, 1>(vnni);
    case 2:
      return groups_for<kFormat, 2>(vnni);
    case 3:
      return groups_for<kFormat, 3>(vnni);
    default:
      return groups_for<kFormat, 4>(vnni);
  }
}

// The SIMD variant's function for a format and a tile of activation rows.
GroupsFn groups_for(bool vnni, Format format, int64_t tile_rows) {
  switch (format) {
    case Format::kQ4_0:
      return groups_for<Format::kQ4_0>(vnni, tile_rows);
    case Format::kQ4_1:
      return groups_for<Format::kQ4_1>(vnni, tile_rows);
    default:
      return groups_for<Format::kQ8_0>(vnni, tile_rows);
  }
}

#endif  // PA_HAVE_GGUF_SIMD

enum class Variant { kReference, kAvx2, kVnni };

bool vnni_usable() {
#ifdef PA_HAVE_GGUF_SIMD
  return selected_isa() == Isa::kAvx512 && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool avx2_usable() {
#ifdef PA_HAVE_GGUF_SIMD
  return selected_isa() != Isa::kBaseline && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

}  // namespace

// The variants this CPU (and torch's chosen capability) runs, best first: "auto" runs the
// first. Also read by Python, to pick the quantized layers' kernel.
std::vector<std::string> gguf_linear_usable_variants() {
  std::vector<std::string> names;
  if (vnni_usable()) names.emplace_back("vnni");
  if (avx2_usable()) names.emplace_back("avx2");
  names.emplace_back("reference");
  return names;
}

namespace {

Variant chosen_variant(const std::string& variant) {
  if (variant == "auto") {
    return vnni_usable() ? Variant::kVnni : avx2_usable() ? Variant::kAvx2 : Variant::kReference;
  }
  if (variant == "reference") return Variant::kReference;
  if (variant == "vnni") {
    TORCH_CHECK(vnni_usable(), "gguf_linear: variant vnni needs AVX-512 with VNNI (avx512_vnni) ",
                "and torch's AVX-512 kernels");
    return Variant::kVnni;
  }
  TORCH_CHECK_VALUE(variant == "avx2",
                    "gguf_linear: variant must be auto, vnni, avx2 or reference, got ", variant);
  TORCH_CHECK(avx2_usable(), "gguf_linear: variant avx2 needs AVX2, FMA and F16C and torch's ",
              "AVX2 or AVX-512 kernels");
  return Variant::kAvx2;
}

void check_arguments(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                     Format format) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && qs.device().is_cpu() && scales.device().is_cpu(),
                    "gguf_linear: x, qs and scales must be CPU tensors");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "gguf_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_TYPE(qs.scalar_type() == at::kByte, "gguf_linear: qs must be uint8, got ",
                   qs.scalar_type());
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kShort, "gguf_linear: scales must be int16, got ",
                   scales.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, "gguf_linear: x must be 2-d (rows, in features), got ", x.dim(),
                    " dimensions");
  TORCH_CHECK_VALUE(qs.dim() == 3 && qs.is_contiguous() && qs.size(2) == quant_bytes(format),
                    "gguf_linear: qs must be a contiguous (groups, blocks, ", quant_bytes(format),
                    ") tensor, got shape ", qs.sizes());
  TORCH_CHECK_VALUE(scales.dim() == 4 && scales.is_contiguous() && scales.size(0) == qs.size(0) &&
                        scales.size(1) == qs.size(1) && scales.size(2) == 2 &&
                        scales.size(3) == kRows,
                    "gguf_linear: scales must be a contiguous (groups, blocks, 2, 16) tensor ",
                    "matching qs, got shape ", scales.sizes());
  TORCH_CHECK_VALUE(x.size(1) == qs.size(1) * kGroup, "gguf_linear: x has ", x.size(1),
                    " input features, the weight ", qs.size(1) * kGroup);
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                       const std::string& format_name, const std::string& variant) {
  const Format format = parse_format(format_name);
  check_arguments(x, qs, scales, format);
  const Variant chosen = chosen_variant(variant);
  const int64_t m = x.size(0), k = x.size(1), groups = qs.size(0), n = groups * kRows;
  at::Tensor y = at::empty({m, n}, x.options());
  if (k == 0) return y.zero_();  // a weight of no blocks
  if (m > 0 && n > 0) {
    const at::Tensor xc = x.contiguous();
    // Reused by the calls of this thread: a decode step makes hundreds of small calls.
    thread_local QuantizedActivations a;
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    if (bf16) {
      quantize_activations(xc.const_data_ptr<c10::BFloat16>(), m, k, format, a);
    } else {
      quantize_activations(xc.const_data_ptr<float>(), m, k, format, a);
    }
    const auto* fields = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<int16_t>());
    const Problem p{format, qs.const_data_ptr<uint8_t>(), fields, k, n, &a, y.data_ptr(), bf16};
    // 4 groups (64 output rows) per task at least: fewer cost more to schedule than they share.
    at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
      for (int64_t row = 0; row < m; row += kTile) {
        const int64_t tile = std::min<int64_t>(kTile, m - row);
#ifdef PA_HAVE_GGUF_SIMD
        if (chosen != Variant::kReference) {
          groups_for(chosen == Variant::kVnni, format, tile)(p, row, begin, end);
          continue;
        }
#endif
        groups_reference(p, row, tile, begin, end);
      }
    });
  }
  return y;
}

}  // namespace
}  // namespace paged_attention::cpu

TORCH_LIBRARY_FRAGMENT(paged_attention, m) {
  m.def("_gguf_linear_usable_variants() -> str[]",
        &paged_attention::cpu::gguf_linear_usable_variants);
  m.def(
      "gguf_linear(Tensor x, Tensor qs, Tensor scales, str format, str variant=\"auto\") -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(paged_attention, CPU, m) {
  m.impl("gguf_linear", &paged_attention::cpu::gguf_linear);
}
