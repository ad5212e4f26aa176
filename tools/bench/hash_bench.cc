// dede-bench-hash: CPU cost of dede's block fingerprints (docs/BENCHMARKS.md,
// "NBD data path"). Hashes 4 KiB blocks with ComputeFingerprint -- the call
// the write monitor makes for every fully written block -- for each hash
// function a volume can be formatted with (XXH3-128, SHA-256), and reports
// CPU seconds per GiB hashed and GB/s per CPU second.
//
// Two buffer sizes: a small one that stays in the CPU caches (the monitor
// hashes an NBD request payload it has just received, so it is warm) and a
// large one that streams from memory. Algorithms and buffers alternate
// within each repetition (xxh128, sha256, xxh128, sha256, ...) and the
// median over the repetitions is reported: the machines are shared and
// noisy. Time is the process's CPU time (CLOCK_PROCESS_CPUTIME_ID); the tool
// is single-threaded, so that is the hashing thread's CPU time plus noise.
//
// Exit status: 0 success, 1 operational error, 2 usage error.
#include <time.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "util/fingerprint.h"

#include "tools/bench/bench_util.h"

namespace dede::bench {
namespace {

namespace po = boost::program_options;
using json = nlohmann::json;

constexpr size_t kBlock = 4096;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double CpuSeconds() { return ClockSeconds(CLOCK_PROCESS_CPUTIME_ID); }

double WallSeconds() { return ClockSeconds(CLOCK_MONOTONIC); }

// Pseudo-random, incompressible content (splitmix64): no two blocks equal.
void Fill(uint8_t* p, size_t n, uint64_t seed) {
  uint64_t x = seed;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(p + i, &z, 8);
  }
}

// Every fingerprint is folded into this, and the result printed, so the
// compiler cannot drop the hashing.
volatile uint64_t g_sink = 0;

struct Phase {
  uint64_t bytes = 0;
  double cpu = 0;
  double wall = 0;
};

// Hashes the buffer block by block, pass after pass, until at least
// `min_cpu` CPU seconds and `min_bytes` bytes are done.
Phase Run(HashAlgo algo, const uint8_t* buf, size_t len, double min_cpu, uint64_t min_bytes) {
  Phase r;
  uint64_t acc = 0;
  const double c0 = CpuSeconds();
  const double w0 = WallSeconds();
  double c = c0;
  while (r.bytes < min_bytes || c - c0 < min_cpu) {
    for (size_t off = 0; off + kBlock <= len; off += kBlock) {
      Fingerprint f = ComputeFingerprint(algo, buf + off, kBlock);
      uint64_t w;
      std::memcpy(&w, f.bytes.data(), 8);
      acc += w ^ f.size;
    }
    r.bytes += len / kBlock * kBlock;
    c = CpuSeconds();
  }
  r.cpu = c - c0;
  r.wall = WallSeconds() - w0;
  g_sink = g_sink + acc;
  return r;
}

int Usage(const std::string& msg, const po::options_description& desc) {
  std::cerr << "dede-bench-hash: " << msg << "\nusage: dede-bench-hash [options]\n" << desc;
  return 2;
}

int Main(int argc, char** argv) {
  po::options_description desc("options");
  int reps = 5;
  double seconds = 0.5;
  size_t small_kib = 256;
  size_t large_mib = 256;
  std::string algos_text = "xxh128,sha256";
  std::string json_path;
  desc.add_options()("help,h", "show this help and exit")(
      "reps", po::value<int>(&reps)->default_value(5),
      "repetitions of each (algorithm, buffer) phase; the median is reported")(
      "seconds", po::value<double>(&seconds)->default_value(0.5),
      "minimum CPU seconds per phase (at least one pass over the buffer)")(
      "small-kib", po::value<size_t>(&small_kib)->default_value(256),
      "cache-resident buffer size in KiB (0: skip)")(
      "large-mib", po::value<size_t>(&large_mib)->default_value(256),
      "memory-streaming buffer size in MiB (0: skip)")(
      "algos", po::value<std::string>(&algos_text)->default_value("xxh128,sha256"),
      "comma-separated hash functions")(
      "json", po::value<std::string>(&json_path), "also write the results as JSON to FILE");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    return Usage(e.what(), desc);
  }
  if (vm.count("help")) {
    std::cout << "usage: dede-bench-hash [options]\n\n"
                 "CPU seconds per GiB of ComputeFingerprint over 4 KiB blocks, per hash\n"
                 "function, cache-resident and streaming buffers, median of --reps.\n\n"
              << desc;
    return 0;
  }
  if (reps < 1 || reps > 99) return Usage("--reps must be 1..99", desc);
  if (!(seconds > 0)) return Usage("--seconds must be positive", desc);
  if (small_kib * 1024 % kBlock || small_kib * 1024 > (size_t{1} << 30)) {
    return Usage("--small-kib must be a multiple of 4, at most 1 GiB", desc);
  }
  if (large_mib > 16384) return Usage("--large-mib must be at most 16384", desc);
  if (small_kib == 0 && large_mib == 0) return Usage("nothing to do", desc);
  std::vector<HashAlgo> algos;
  for (size_t pos = 0; pos <= algos_text.size();) {
    size_t comma = algos_text.find(',', pos);
    if (comma == std::string::npos) comma = algos_text.size();
    std::string name = algos_text.substr(pos, comma - pos);
    auto a = ParseHashAlgo(name);
    if (!a) return Usage("unknown hash function '" + name + "'", desc);
    algos.push_back(*a);
    pos = comma + 1;
  }

  struct Buffer {
    std::string name;
    size_t bytes;
    std::unique_ptr<uint8_t, FreeDeleter> data;
  };
  std::vector<Buffer> buffers;
  if (small_kib) buffers.push_back({"cache", small_kib * 1024, nullptr});
  if (large_mib) buffers.push_back({"memory", large_mib << 20, nullptr});
  for (Buffer& b : buffers) {
    b.data.reset(static_cast<uint8_t*>(std::aligned_alloc(kBlock, b.bytes)));
    if (!b.data) {
      std::fprintf(stderr, "dede-bench-hash: cannot allocate %zu bytes\n", b.bytes);
      return 1;
    }
    Fill(b.data.get(), b.bytes, 42 + b.bytes);
  }

  std::printf("4 KiB blocks, ComputeFingerprint, %d reps, >= %.2f CPU s per phase\n", reps,
              seconds);
  std::fflush(stdout);
  // results[algo][buffer] = phases
  std::vector<std::vector<std::vector<Phase>>> results(
      algos.size(), std::vector<std::vector<Phase>>(buffers.size()));
  for (int rep = 0; rep < reps; rep++) {
    for (size_t b = 0; b < buffers.size(); b++) {
      for (size_t a = 0; a < algos.size(); a++) {
        const Buffer& buf = buffers[b];
        Phase p = Run(algos[a], buf.data.get(), buf.bytes, seconds, buf.bytes);
        results[a][b].push_back(p);
        std::printf("  rep %d %-7s %-6s %8.3f GiB in %6.3f CPU s (%6.3f wall s): %7.3f CPU s/GiB"
                    " %7.2f GB/s\n",
                    rep + 1, HashAlgoName(algos[a]), buf.name.c_str(), p.bytes / kGiB, p.cpu,
                    p.wall, p.cpu / (p.bytes / kGiB), p.bytes / 1e9 / p.cpu);
        std::fflush(stdout);
      }
    }
  }

  json out;
  out["block_bytes"] = kBlock;
  out["reps"] = reps;
  out["min_cpu_seconds_per_phase"] = seconds;
  out["clock"] = "CLOCK_PROCESS_CPUTIME_ID";
  std::printf("\n%-8s %-16s %14s %10s %14s\n", "hash", "buffer", "CPU s/GiB", "GB/s",
              "per-rep s/GiB");
  for (size_t a = 0; a < algos.size(); a++) {
    for (size_t b = 0; b < buffers.size(); b++) {
      std::vector<double> spg, gbs;
      json reps_j = json::array();
      std::string per;
      for (const Phase& p : results[a][b]) {
        double s = p.cpu / (p.bytes / kGiB);
        spg.push_back(s);
        gbs.push_back(p.bytes / 1e9 / p.cpu);
        reps_j.push_back({{"bytes", p.bytes}, {"cpu_seconds", p.cpu}, {"wall_seconds", p.wall}});
        char t[16];
        std::snprintf(t, sizeof t, "%s%.3f", per.empty() ? "" : " ", s);
        per += t;
      }
      const Buffer& buf = buffers[b];
      std::string bufname = buf.name + " (" +
                            (buf.bytes >= (1u << 20) ? std::to_string(buf.bytes >> 20) + " MiB"
                                                     : std::to_string(buf.bytes >> 10) + " KiB") +
                            ")";
      std::printf("%-8s %-16s %14.4f %10.2f   %s\n", HashAlgoName(algos[a]), bufname.c_str(),
                  Median(spg), Median(gbs), per.c_str());
      json j;
      j["buffer_bytes"] = buf.bytes;
      j["cpu_seconds_per_gib"] = Median(spg);
      j["gb_per_cpu_second"] = Median(gbs);
      j["reps"] = reps_j;
      out["results"][HashAlgoName(algos[a])][buf.name] = j;
    }
  }
  std::printf("(medians over reps; GB/s = 10^9 bytes per CPU second; checksum %016" PRIx64 ")\n",
              static_cast<uint64_t>(g_sink));
  out["checksum"] = static_cast<uint64_t>(g_sink);
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << out.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "dede-bench-hash: cannot write %s\n", json_path.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace dede::bench

int main(int argc, char** argv) {
  try {
    return dede::bench::Main(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "dede-bench-hash: " << e.what() << std::endl;
    return 1;
  }
}
