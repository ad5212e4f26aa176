// dede-vmgen: seeded generator of VM-like raw disk images.
//
// Every image is built from one shared "golden OS" image, then made to
// diverge the way cloned VM disks do:
//
//   layout   The golden image is a sequence of extents (1..256 blocks of
//            4 KiB). Each extent is OS content (shared by all images, with a
//            few blocks repeated inside the golden image itself), per-image
//            data (unique to each image), or free space (zero blocks).
//   diverge  Runs of blocks are overwritten by unique content (patches,
//            logs, swap): a fraction D of the image.
//   copy     Some golden "files" (runs of OS blocks) are copied to other
//            4 KiB-aligned offsets, different in every image.
//   age      Random runs are overwritten by unique content, and ranges are
//            deleted (zeroed).
//
// A block is described by a 64-bit content id (0 = zero block) and rendered
// by a fast PRNG seeded with that id, so equal ids give equal blocks and
// different ids give different blocks. Everything is a function of --seed:
// two runs with the same arguments write byte-identical images. Zero blocks
// are left as holes (sparse files) unless --dense is given.
//
// Exit codes: 0 success, 1 I/O error, 2 usage error (one line on stderr).

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/program_options.hpp>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace po = boost::program_options;

namespace {

constexpr uint64_t kBlockSize = 4096;
constexpr size_t kWordsPerBlock = kBlockSize / sizeof(uint64_t);
constexpr size_t kWriteBufferBlocks = 2048;  // 8 MiB per write

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct IoError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// SplitMix64: seeding and id mixing.
constexpr uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Small deterministic PRNG for layout decisions (independent of the C++
// library's distributions, so images are the same on every platform).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(Mix64(seed)) {}
  uint64_t Next() {
    s_ += 0x9e3779b97f4a7c15ULL;
    uint64_t z = s_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n > 0.
  uint64_t Below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(Next()) * n) >> 64);
  }
  // Uniform in [lo, hi].
  uint64_t Between(uint64_t lo, uint64_t hi) { return lo + Below(hi - lo + 1); }
  // Uniform in [0, 1).
  double Unit() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t s_;
};

// Content id namespaces; the id is never 0 for a non-zero block.
enum class Kind : uint8_t { kZero = 0, kGolden = 1, kMoved = 2, kUnique = 3 };

uint64_t ContentId(uint64_t seed, uint64_t space, uint64_t a, uint64_t b) {
  uint64_t id = Mix64(seed ^ Mix64(space ^ Mix64(a ^ Mix64(b))));
  return id == 0 ? 1 : id;
}

// Fill one 4 KiB block from a content id (wyrand: fast, good enough).
void RenderBlock(uint64_t id, uint64_t* out) {
  uint64_t s = id;
  for (size_t i = 0; i < kWordsPerBlock; ++i) {
    s += 0xa0761d6478bd642fULL;
    unsigned __int128 m = static_cast<unsigned __int128>(s) * (s ^ 0xe7037ed1a0b428dbULL);
    out[i] = static_cast<uint64_t>(m >> 64) ^ static_cast<uint64_t>(m);
  }
}

struct Params {
  std::string out;
  uint64_t images = 0;
  uint64_t size = 0;
  uint64_t seed = 0;
  double common = 0.6;
  double divergence = 0.1;
  double zero = 0.2;
  double internal_dup = 0.05;
  double aging = 0.02;
  bool dense = false;
};

uint64_t ParseSize(const std::string& text) {
  size_t pos = 0;
  while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') ++pos;
  if (pos == 0 || pos > 18)
    throw UsageError("--size: expected a number with an optional K/M/G/T suffix, got '" + text +
                     "'");
  uint64_t value = std::stoull(text.substr(0, pos));
  // Accepted suffixes: none, B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (all binary).
  std::string suffix = text.substr(pos);
  uint64_t mult = 1;
  if (!suffix.empty() && suffix != "B" && suffix != "b") {
    const std::string units = "kmgt";
    size_t unit =
        units.find(static_cast<char>(std::tolower(static_cast<unsigned char>(suffix[0]))));
    mult = unit == std::string::npos ? 0 : 1ULL << (10 * (unit + 1));
    std::string rest = suffix.substr(1);
    if (mult == 0 || !(rest.empty() || rest == "B" || rest == "iB"))
      throw UsageError("--size: unknown suffix in '" + text + "' (use K, M, G or T)");
  }
  if (value > (UINT64_MAX >> 1) / mult) throw UsageError("--size: '" + text + "' is too large");
  uint64_t bytes = value * mult;
  if (bytes == 0 || bytes % kBlockSize != 0)
    throw UsageError("--size: must be a positive multiple of 4 KiB, got '" + text + "'");
  return bytes;
}

void CheckFraction(const char* name, double v) {
  if (!(v >= 0.0 && v <= 1.0))
    throw UsageError(std::string("--") + name + ": must be between 0 and 1");
}

std::string HumanSize(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

struct Extent {
  uint64_t start;
  uint64_t len;
};

// The golden image: content ids and kinds per block, shared by all images.
struct Golden {
  std::vector<uint64_t> id;  // 0 = zero; per-image data blocks hold 0 too
  std::vector<Kind> kind;    // kZero, kGolden, or kUnique (= per-image data)
  std::vector<Extent> os;    // OS extents, sources for file copies
};

Golden MakeGolden(const Params& p, uint64_t nblocks) {
  Golden g;
  g.id.assign(nblocks, 0);
  g.kind.assign(nblocks, Kind::kZero);
  Rng rng(p.seed ^ 0x676f6c64656e00ULL);  // "golden"
  std::vector<uint64_t> os_blocks;        // indices of OS blocks, for internal repeats
  uint64_t max_shift = 0;
  while (max_shift < 8 && (2ULL << max_shift) <= nblocks / 16) ++max_shift;
  double placed[3] = {0, 0, 0};  // blocks given to zero, OS, per-image data
  uint64_t i = 0;
  while (i < nblocks) {
    // Extent lengths: 1..256 blocks, log-uniform (many small, some large);
    // at most 1/16 of the image so small images still get the fractions.
    uint64_t len = (1ULL << rng.Below(max_shift + 1));
    len = rng.Between((len + 1) / 2, len);
    len = std::min(len, nblocks - i);
    // Kind of the extent: random, weighted by how far each kind is behind
    // its target fraction, so even small images get close to the fractions.
    const double target[3] = {p.zero, p.common, std::max(0.0, 1.0 - p.zero - p.common)};
    double weight[3], total = 0;
    for (int k = 0; k < 3; ++k) {
      weight[k] = std::max(0.0, target[k] * static_cast<double>(i + len) - placed[k]);
      total += weight[k];
    }
    if (total <= 0) {
      for (int k = 0; k < 3; ++k) total += (weight[k] = target[k]);
    }
    double r = rng.Unit() * total;
    int pick = 0;
    while (pick < 2 && (r -= weight[pick]) >= 0) ++pick;
    while (target[pick] <= 0) pick = (pick + 1) % 3;  // never a kind with no share
    placed[pick] += static_cast<double>(len);
    const Kind k = pick == 0 ? Kind::kZero : (pick == 1 ? Kind::kGolden : Kind::kUnique);
    for (uint64_t b = i; b < i + len; ++b) {
      g.kind[b] = k;
      if (k != Kind::kGolden) continue;
      if (!os_blocks.empty() && rng.Unit() < p.internal_dup) {
        g.id[b] = g.id[os_blocks[rng.Below(os_blocks.size())]];  // repeated inside the OS
      } else {
        g.id[b] = ContentId(p.seed, 1, b, 0);
      }
      os_blocks.push_back(b);
    }
    if (k == Kind::kGolden) g.os.push_back({i, len});
    i += len;
  }
  return g;
}

struct ImageStats {
  uint64_t golden = 0, moved = 0, unique = 0, zero = 0;
};

// Overwrite random runs (1..16 blocks) until about `fraction` of the image
// has been covered; `fn(block)` is applied to each block of each run.
template <typename Fn>
void RandomRuns(Rng& rng, uint64_t nblocks, double fraction, Fn fn) {
  uint64_t target = static_cast<uint64_t>(std::llround(fraction * static_cast<double>(nblocks)));
  uint64_t done = 0;
  while (done < target) {
    uint64_t len = std::min<uint64_t>(rng.Between(1, 16), target - done);
    uint64_t start = rng.Below(nblocks - len + 1);
    for (uint64_t b = start; b < start + len; ++b) fn(b);
    done += len;
  }
}

class Writer {
 public:
  Writer(const std::string& path, bool dense) : path_(path), dense_(dense) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) Fail("open");
    buf_.resize(kWriteBufferBlocks * kWordsPerBlock);
  }
  ~Writer() {
    if (fd_ >= 0) ::close(fd_);
  }
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  void Add(uint64_t id) {
    if (id == 0 && !dense_) {
      Flush();
      ++pos_;  // leave a hole
      buf_start_ = pos_;
      return;
    }
    uint64_t* dst = &buf_[buffered_ * kWordsPerBlock];
    if (id == 0) {
      std::memset(dst, 0, kBlockSize);
    } else {
      RenderBlock(id, dst);
    }
    ++buffered_;
    ++pos_;
    if (buffered_ == kWriteBufferBlocks) Flush();
  }

  void Finish() {
    Flush();
    if (::ftruncate(fd_, static_cast<off_t>(pos_ * kBlockSize)) != 0) Fail("ftruncate");
    if (::close(fd_) != 0) {
      fd_ = -1;
      Fail("close");
    }
    fd_ = -1;
  }

 private:
  void Flush() {
    const char* p = reinterpret_cast<const char*>(buf_.data());
    uint64_t left = buffered_ * kBlockSize;
    off_t off = static_cast<off_t>(buf_start_ * kBlockSize);
    while (left > 0) {
      ssize_t n = ::pwrite(fd_, p, left, off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) Fail("write");
      p += n;
      off += n;
      left -= static_cast<uint64_t>(n);
    }
    buffered_ = 0;
    buf_start_ = pos_;
  }
  [[noreturn]] void Fail(const char* what) {
    int err = errno;
    throw IoError(path_ + ": " + what + ": " + std::strerror(err));
  }

  std::string path_;
  bool dense_;
  int fd_ = -1;
  std::vector<uint64_t> buf_;
  uint64_t buffered_ = 0;   // blocks in buf_
  uint64_t buf_start_ = 0;  // block index of buf_[0]
  uint64_t pos_ = 0;        // next block index
};

ImageStats MakeImage(const Params& p, const Golden& g, uint64_t image, const std::string& path) {
  const uint64_t n = g.id.size();
  std::vector<uint64_t> id = g.id;
  std::vector<Kind> kind = g.kind;
  Rng rng(Mix64(p.seed) ^ Mix64(0x696d616765ULL + image));  // "image"
  uint64_t serial = 0;
  auto unique = [&](uint64_t b) {
    id[b] = ContentId(p.seed, 2, image, serial++);
    kind[b] = Kind::kUnique;
  };

  // Per-image data blocks of the layout.
  for (uint64_t b = 0; b < n; ++b)
    if (kind[b] == Kind::kUnique) unique(b);

  // Divergence: unique content overwrites a fraction D.
  RandomRuns(rng, n, p.divergence, unique);

  // Files copied to other offsets: about 1 block in 64 of the image, in
  // files of 4..128 blocks taken from OS extents.
  if (!g.os.empty()) {
    uint64_t budget = std::max<uint64_t>(1, n / 64);
    while (budget > 0) {
      const Extent& e = g.os[rng.Below(g.os.size())];
      uint64_t len = std::min({rng.Between(4, 128), e.len, budget, n});
      uint64_t src = e.start + rng.Below(e.len - len + 1);
      uint64_t dst = rng.Below(n - len + 1);
      for (uint64_t k = 0; k < len; ++k) {
        id[dst + k] = g.id[src + k];
        kind[dst + k] = dst + k == src + k ? Kind::kGolden : Kind::kMoved;
      }
      budget -= len;
    }
  }

  // Aging: rewrites, then deletions (zeroed ranges).
  RandomRuns(rng, n, p.aging, unique);
  RandomRuns(rng, n, p.aging, [&](uint64_t b) {
    id[b] = 0;
    kind[b] = Kind::kZero;
  });

  ImageStats st;
  Writer w(path, p.dense);
  for (uint64_t b = 0; b < n; ++b) {
    w.Add(id[b]);
    switch (kind[b]) {
      case Kind::kZero:
        ++st.zero;
        break;
      case Kind::kGolden:
        ++st.golden;
        break;
      case Kind::kMoved:
        ++st.moved;
        break;
      case Kind::kUnique:
        ++st.unique;
        break;
    }
  }
  w.Finish();
  return st;
}

std::optional<Params> ParseArgs(int argc, char** argv) {
  Params p;
  std::string size;
  po::options_description opts(
      "Usage: dede-vmgen --out DIR --images N --size SIZE --seed S [options]\n"
      "Writes N seeded VM-like raw disk images DIR/vm-00.img ... sharing a golden OS image.\n"
      "Options");
  // clang-format off
  opts.add_options()
    ("help,h", "show this help")
    ("out", po::value(&p.out)->required(), "output directory (created if missing)")
    ("images", po::value(&p.images)->required(), "number of images")
    ("size", po::value(&size)->required(), "size of each image, multiple of 4K (K/M/G/T suffixes)")
    ("seed", po::value(&p.seed)->required(), "seed; same seed and options give identical images")
    ("common-fraction", po::value(&p.common)->default_value(0.6, "0.6"),
     "fraction of the layout that is golden OS content shared by all images")
    ("divergence", po::value(&p.divergence)->default_value(0.1, "0.1"),
     "fraction of each image overwritten by unique blocks")
    ("zero-fraction", po::value(&p.zero)->default_value(0.2, "0.2"),
     "fraction of the layout that is free space (runs of zero blocks)")
    ("internal-dup", po::value(&p.internal_dup)->default_value(0.05, "0.05"),
     "fraction of OS blocks that repeat other OS blocks")
    ("aging", po::value(&p.aging)->default_value(0.02, "0.02"),
     "fraction rewritten, and fraction deleted (zeroed), by aging")
    ("dense", po::bool_switch(&p.dense), "write zero blocks instead of leaving holes");
  // clang-format on
  po::variables_map vm;
  try {
    if (argc <= 1) throw UsageError("missing arguments: --out DIR --images N --size SIZE --seed S");
    po::positional_options_description no_positional;
    po::store(po::command_line_parser(argc, argv).options(opts).positional(no_positional).run(),
              vm);
    if (vm.count("help")) {
      std::cout << opts << "\n";
      return std::nullopt;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(e.what());
  }
  p.size = ParseSize(size);
  if (p.images == 0 || p.images > 100000)
    throw UsageError("--images: must be between 1 and 100000");
  CheckFraction("common-fraction", p.common);
  CheckFraction("divergence", p.divergence);
  CheckFraction("zero-fraction", p.zero);
  CheckFraction("internal-dup", p.internal_dup);
  CheckFraction("aging", p.aging);
  if (p.common + p.zero > 1.0 + 1e-9)
    throw UsageError("--common-fraction plus --zero-fraction must not exceed 1");
  return p;
}

std::string ImageName(uint64_t i, uint64_t count) {
  int width = 2;
  for (uint64_t c = count - 1; c >= 100; c /= 10) ++width;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "vm-%0*llu.img", width, static_cast<unsigned long long>(i));
  return buf;
}

double Pct(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::optional<Params> parsed = ParseArgs(argc, argv);
    if (!parsed) return 0;
    const Params& p = *parsed;
    std::error_code ec;
    std::filesystem::create_directories(p.out, ec);
    if (ec) throw IoError(p.out + ": " + ec.message());

    const uint64_t nblocks = p.size / kBlockSize;
    Golden golden = MakeGolden(p, nblocks);
    for (uint64_t i = 0; i < p.images; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      std::string name = ImageName(i, p.images);
      std::string path = (std::filesystem::path(p.out) / name).string();
      ImageStats st = MakeImage(p, golden, i, path);
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf(
          "%s: %s, %llu blocks: golden %.1f%%, moved %.1f%%, unique %.1f%%, zero %.1f%% "
          "(%.2f s)\n",
          path.c_str(), HumanSize(p.size).c_str(), static_cast<unsigned long long>(nblocks),
          Pct(st.golden, nblocks), Pct(st.moved, nblocks), Pct(st.unique, nblocks),
          Pct(st.zero, nblocks), secs);
      std::fflush(stdout);
    }
    return 0;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "dede-vmgen: %s (try --help)\n", e.what());
    return 2;
  } catch (const IoError& e) {
    std::fprintf(stderr, "dede-vmgen: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dede-vmgen: %s\n", e.what());
    return 1;
  }
}
