// dede-bench-monitor: CPU cost of the write monitor per GiB written
// (kmod/writemon). Simulates dedupd's write path and its log flusher without
// NBD or a volume:
//
//   writer:  WriteMonitor::OnWrite for every write (fingerprints + buffering)
//   flusher: every --tick-mib MiB written (one thread) or every --tick-ms
//            (two threads), DueFiles(false), then for every due file Take()
//            and the flusher's encoding (EncodedWriteLogBytes +
//            EncodeWriteLogFrames; no volume, the frames are discarded), or
//            with --volume EncodedWriteLogBytes + AppendToWriteLog to a
//            volume on a MemDevice, as LogFlusher does.
//            At the end DueFiles(true) and the same for the rest.
//
// Patterns: "seq" = 64 KiB sequential writes over a --seq-gib GiB file
// (wrapping around); "shuffled" = the same writes reaching the monitor in
// a shuffled order within each run of 16 (what dedupd's workers hand it for
// one sequential writer at iodepth 16: never increasing, never a rewrite);
// "rand" = 4 KiB writes at random blocks of a --rand-gib GiB file. "hash"
// rows are the bare ComputeFingerprint loop over the same blocks: the
// floor any monitor has to pay.
//
// Times are per-thread CPU (CLOCK_THREAD_CPUTIME_ID). The write buffer is
// reused (one word of each block changes per write), so it is cache-warm
// like a just-received NBD payload. Repetitions alternate the phases and
// the median is reported: the machines are shared and noisy.
//
// Exit status: 0 success, 1 operational error, 2 usage error.
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/program_options.hpp>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kmod/writemon/write_log.h"
#include "kmod/writemon/write_monitor.h"
#include "util/fingerprint.h"
#include "volume/lock_manager.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

#include "tools/bench/bench_util.h"

namespace dede::bench {
namespace {

namespace po = boost::program_options;

constexpr size_t kBlock = 4096;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double ThreadCpu() { return ClockSeconds(CLOCK_THREAD_CPUTIME_ID); }

uint64_t SplitMix(uint64_t* x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

volatile uint64_t g_sink = 0;

struct Config {
  double gib = 4;           // written per phase
  uint64_t seq_file = 4;    // GiB
  uint64_t rand_file = 1;   // GiB
  int threads = 1;
  uint64_t tick_bytes = uint64_t{64} << 20;
  int tick_ms = 20;
  size_t cap_mib = 64;
  bool volume = false;
  bool verbose = false;  // append to a write log on a MemDevice volume
};

struct Result {
  double written = 0;  // bytes
  double hash = 0;     // hash-only phase CPU s
  double onwrite = 0;  // OnWrite CPU s
  double due = 0;      // DueFiles CPU s
  double take = 0;     // Take CPU s
  double encode = 0;   // EncodedWriteLogBytes + EncodeWriteLogFrames CPU s
  uint64_t takes = 0;
  uint64_t records = 0;  // records taken
  uint64_t dropped = 0;
};

enum class Pat { kSeq, kShuffled, kRand };

const char* PatName(Pat p) {
  return p == Pat::kSeq ? "seq" : p == Pat::kShuffled ? "shuffled" : "rand";
}

// The writes of a pattern: (offset, length) generator.
class Pattern {
 public:
  static constexpr size_t kShuffleRun = 16;
  Pattern(Pat pat, uint64_t file_bytes) : pat_(pat), file_bytes_(file_bytes) {}
  size_t len() const { return pat_ == Pat::kRand ? kBlock : 64 * 1024; }
  uint64_t Next() {
    switch (pat_) {
      case Pat::kSeq:
        return NextSeq();
      case Pat::kShuffled:
        if (run_used_ == kShuffleRun) {
          for (size_t i = 0; i < kShuffleRun; i++) run_[i] = NextSeq();
          for (size_t i = kShuffleRun - 1; i > 0; i--) {
            std::swap(run_[i], run_[SplitMix(&rng_) % (i + 1)]);
          }
          run_used_ = 0;
        }
        return run_[run_used_++];
      case Pat::kRand:
        break;
    }
    return SplitMix(&rng_) % (file_bytes_ / kBlock) * kBlock;
  }

 private:
  uint64_t NextSeq() {
    const uint64_t off = pos_;
    pos_ += len();
    if (pos_ >= file_bytes_) pos_ = 0;
    return off;
  }
  Pat pat_;
  uint64_t file_bytes_;
  uint64_t pos_ = 0;
  uint64_t rng_ = 12345;
  uint64_t run_[kShuffleRun] = {};
  size_t run_used_ = kShuffleRun;
};

// Changes one word per block so fingerprints differ from write to write.
void Mutate(uint8_t* buf, size_t len, uint64_t n) {
  for (size_t o = 0; o < len; o += kBlock) std::memcpy(buf + o, &n, sizeof n);
}

uint64_t FileBytes(const Config& c, Pat p) {
  return (p == Pat::kRand ? c.rand_file : c.seq_file) << 30;
}

double HashOnly(const Config& c, Pat p, uint8_t* buf) {
  Pattern pat(p, FileBytes(c, p));
  const uint64_t writes = static_cast<uint64_t>(c.gib * kGiB) / pat.len();
  uint64_t acc = 0;
  const double t0 = ThreadCpu();
  for (uint64_t i = 0; i < writes; i++) {
    acc += pat.Next();
    Mutate(buf, pat.len(), i);
    for (size_t o = 0; o < pat.len(); o += kBlock) {
      Fingerprint f = ComputeFingerprint(HashAlgo::kXxh128, buf + o, kBlock);
      uint64_t w;
      std::memcpy(&w, f.bytes.data(), 8);
      acc += w;
    }
  }
  const double t = ThreadCpu() - t0;
  g_sink = g_sink + acc;
  return t;
}

// An in-memory volume for the write logs (--volume).
struct MemVolume {
  MemDevice dev{uint64_t{512} << 20};
  std::unique_ptr<Volume> vol;
  bool Open() {
    if (!FormatVolume(&dev, FormatOptions{}, false).ok()) return false;
    const std::string p = "/tmp/dede-bench-monitor-locks-" + std::to_string(getpid());
    auto lm = OpenLocalLockManager(p);
    if (!lm.ok()) return false;
    ::unlink(p.c_str());
    OpenOptions oo;
    oo.locks = std::shared_ptr<LockManager>(std::move(lm.value()));
    auto v = Volume::Open(&dev, oo);
    if (!v.ok()) return false;
    vol = std::move(v.value());
    return true;
  }
};

// One flusher round; adds its CPU to *r.
void Flush(WriteMonitor* mon, Volume* vol, bool all, Result* r) {
  static const Uuid kUuid{};
  double t0 = ThreadCpu();
  const std::vector<FileId> due = mon->DueFiles(all);
  double t1 = ThreadCpu();
  r->due += t1 - t0;
  for (FileId id : due) {
    t0 = ThreadCpu();
    MonitorBatch b = mon->Take(id);
    t1 = ThreadCpu();
    r->take += t1 - t0;
    if (b.empty()) continue;
    uint64_t bytes = EncodedWriteLogBytes(b, mon->algo());
    if (vol != nullptr) {
      Status st = AppendToWriteLog(vol, b);
      if (!st.ok()) {
        std::fprintf(stderr, "dede-bench-monitor: %s\n", st.ToString().c_str());
        std::exit(1);
      }
    } else {
      std::vector<uint8_t> frames = EncodeWriteLogFrames(b, 1, mon->algo(), kUuid, 0);
      bytes += frames.size() + frames[kBlock / 2];
    }
    const double t2 = ThreadCpu();
    r->encode += t2 - t1;
    r->takes++;
    r->records += b.records.size();
    g_sink = g_sink + bytes;
  }
}

Result RunMonitor(const Config& c, Pat p, uint8_t* buf) {
  Result r;
  WriteMonitorOptions opts;
  opts.memory_cap_bytes = c.cap_mib << 20;
  WriteMonitor mon(opts);
  FileId id{100, 1};
  std::unique_ptr<MemVolume> mv;
  Volume* vol = nullptr;
  if (c.volume) {
    mv = std::make_unique<MemVolume>();
    if (!mv->Open()) {
      std::fprintf(stderr, "dede-bench-monitor: cannot set up the in-memory volume\n");
      std::exit(1);
    }
    vol = mv->vol.get();
    auto created = vol->Create("vm", c.seq_file << 30);
    if (!created.ok()) {
      std::fprintf(stderr, "dede-bench-monitor: %s\n", created.status().ToString().c_str());
      std::exit(1);
    }
    id = created.value();
  }
  mon.AddFile(id, true);
  Pattern pat(p, FileBytes(c, p));
  const uint64_t writes = static_cast<uint64_t>(c.gib * kGiB) / pat.len();
  r.written = static_cast<double>(writes * pat.len());

  if (c.threads == 1) {
    // Paired with the hash-only loop slice by slice (same writes, same
    // buffer), so noise from the shared machine hits both alike.
    const uint64_t tick_writes = std::max<uint64_t>(1, c.tick_bytes / pat.len());
    Pattern hpat = pat;
    uint64_t acc = 0;
    for (uint64_t i = 0; i < writes;) {
      const uint64_t n = std::min(tick_writes, writes - i);
      const double t0 = ThreadCpu();
      for (uint64_t k = i; k < i + n; k++) {
        acc += hpat.Next();
        Mutate(buf, pat.len(), k);
        for (size_t o = 0; o < pat.len(); o += kBlock) {
          Fingerprint f = ComputeFingerprint(HashAlgo::kXxh128, buf + o, kBlock);
          uint64_t w;
          std::memcpy(&w, f.bytes.data(), 8);
          acc += w;
        }
      }
      const double t1 = ThreadCpu();
      for (uint64_t k = i; k < i + n; k++) {
        const uint64_t off = pat.Next();
        Mutate(buf, pat.len(), k);
        mon.OnWrite(id, off, buf, pat.len());
      }
      const double t2 = ThreadCpu();
      r.hash += t1 - t0;
      r.onwrite += t2 - t1;
      i += n;
      if (i % tick_writes == 0) Flush(&mon, vol, false, &r);
    }
    g_sink = g_sink + acc;
    Flush(&mon, vol, true, &r);
  } else {
    std::atomic<bool> done{false};
    std::thread flusher([&] {
      while (!done.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(c.tick_ms));
        Flush(&mon, vol, false, &r);
      }
      Flush(&mon, vol, true, &r);
    });
    const double t0 = ThreadCpu();
    for (uint64_t i = 0; i < writes; i++) {
      const uint64_t off = pat.Next();
      Mutate(buf, pat.len(), i);
      mon.OnWrite(id, off, buf, pat.len());
    }
    r.onwrite = ThreadCpu() - t0;
    done = true;
    flusher.join();
  }
  r.dropped = mon.Stats().dropped_records;
  return r;
}

int Usage(const std::string& msg, const po::options_description& desc) {
  std::cerr << "dede-bench-monitor: " << msg << "\nusage: dede-bench-monitor [options]\n" << desc;
  return 2;
}

int Main(int argc, char** argv) {
  po::options_description desc("options");
  Config c;
  int reps = 3;
  std::string patterns = "seq,rand";  // the defaults kept from before "shuffled"
  uint64_t tick_mib = 64;
  desc.add_options()("help,h", "show this help and exit")(
      "reps", po::value<int>(&reps)->default_value(3), "repetitions; the median is reported")(
      "gib", po::value<double>(&c.gib)->default_value(4), "GiB written per phase")(
      "patterns", po::value<std::string>(&patterns)->default_value("seq,rand"),
      "comma-separated: seq, shuffled, rand")(
      "threads", po::value<int>(&c.threads)->default_value(1),
      "1: the writer flushes every --tick-mib; 2: a flusher thread every --tick-ms")(
      "tick-mib", po::value<uint64_t>(&tick_mib)->default_value(64),
      "one thread: MiB written between flusher rounds")(
      "tick-ms", po::value<int>(&c.tick_ms)->default_value(20),
      "two threads: ms between flusher rounds (dedupd: 1000, at NBD speed)")(
      "verbose,v", po::bool_switch(&c.verbose), "print every repetition")(
      "volume", po::bool_switch(&c.volume),
      "append the batches to write logs on an in-memory volume (MemDevice) instead of only "
      "encoding them")(
      "cap-mib", po::value<size_t>(&c.cap_mib)->default_value(64), "monitor memory cap")(
      "seq-gib", po::value<uint64_t>(&c.seq_file)->default_value(4), "seq file size")(
      "rand-gib", po::value<uint64_t>(&c.rand_file)->default_value(1), "rand file size");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    return Usage(e.what(), desc);
  }
  if (vm.count("help")) {
    std::cout << "usage: dede-bench-monitor [options]\n\n" << desc;
    return 0;
  }
  if (reps < 1 || reps > 99) return Usage("--reps must be 1..99", desc);
  if (c.threads != 1 && c.threads != 2) return Usage("--threads must be 1 or 2", desc);
  if (!(c.gib > 0) || c.seq_file == 0 || c.rand_file == 0) return Usage("sizes must be > 0", desc);
  c.tick_bytes = tick_mib << 20;
  std::vector<Pat> pats;
  {
    std::string rest = patterns + ",";
    for (size_t at; (at = rest.find(',')) != std::string::npos; rest.erase(0, at + 1)) {
      const std::string name = rest.substr(0, at);
      if (name == "seq") {
        pats.push_back(Pat::kSeq);
      } else if (name == "shuffled") {
        pats.push_back(Pat::kShuffled);
      } else if (name == "rand") {
        pats.push_back(Pat::kRand);
      } else if (!name.empty()) {
        return Usage("unknown pattern '" + name + "'", desc);
      }
    }
  }
  if (pats.empty()) return Usage("no pattern", desc);

  std::vector<uint8_t> buf(64 * 1024);
  uint64_t seed = 42;
  for (size_t i = 0; i + 8 <= buf.size(); i += 8) {
    const uint64_t v = SplitMix(&seed);
    std::memcpy(&buf[i], &v, 8);
  }

  std::printf("write monitor, xxh128, %.1f GiB per phase, %d thread(s), %d reps (median)\n", c.gib,
              c.threads, reps);
  std::fflush(stdout);
  for (Pat p : pats) {
    std::vector<double> hash, onwrite, due, take, encode, total;
    Result last;
    for (int rep = 0; rep < reps; rep++) {
      Result r = RunMonitor(c, p, buf.data());
      const double h = c.threads == 1 ? r.hash : HashOnly(c, p, buf.data());
      const double g = r.written / kGiB;
      hash.push_back(h / g);
      onwrite.push_back(r.onwrite / g);
      due.push_back(r.due / g);
      take.push_back(r.take / g);
      encode.push_back(r.encode / g);
      total.push_back((r.onwrite + r.due + r.take + r.encode) / g);
      last = r;
      if (c.verbose) {
        std::printf("  rep %d %s: hash %.4f onwrite %.4f due %.4f take %.4f encode %.4f\n", rep + 1,
                    PatName(p), hash.back(), onwrite.back(), due.back(), take.back(),
                    encode.back());
        std::fflush(stdout);
      }
    }
    const double h = Median(hash), w = Median(onwrite);
    std::printf("\n%s (%s over a %" PRIu64 " GiB file), CPU s/GiB written:\n", PatName(p),
                p == Pat::kSeq        ? "64 KiB sequential"
                : p == Pat::kShuffled ? "64 KiB sequential, shuffled in runs of 16"
                                      : "4 KiB random",
                FileBytes(c, p) >> 30);
    std::printf("  %-28s %8.4f\n", "hash only (ComputeFingerprint)", h);
    std::printf("  %-28s %8.4f\n", "OnWrite total", w);
    std::printf("  %-28s %8.4f\n", "  OnWrite - hash", w - h);
    std::printf("  %-28s %8.4f\n", "DueFiles", Median(due));
    std::printf("  %-28s %8.4f\n", "Take (+coalesce)", Median(take));
    std::printf("  %-28s %8.4f\n", c.volume ? "encode + append" : "encode", Median(encode));
    std::printf("  %-28s %8.4f\n", "monitor total", Median(total));
    std::printf("  %-28s %8.4f\n", "monitor total - hash", Median(total) - h);
    std::printf("  (last rep: %" PRIu64 " takes, %" PRIu64 " records taken, %" PRIu64
                " dropped)\n",
                last.takes, last.records, last.dropped);
    std::fflush(stdout);
  }
  return g_sink == 1 ? 1 : 0;
}

}  // namespace
}  // namespace dede::bench

int main(int argc, char** argv) { return dede::bench::Main(argc, argv); }
