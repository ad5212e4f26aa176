// dede-bench-index: the index and the dedup pass (issue 4; docs/BENCHMARKS.md,
// "Index and dedup (issue 4)").
//
// Everything runs on one path-backed volume in a sparse file under --dir
// (O_DIRECT when the file system allows it, so the page cache plays no
// part). The file is written once before measuring (no first-allocation
// cost of the host file system) and removed at the end.
//
//  1. Merge-scan rate. A shard version of --entries entries (sorted random
//     XXH3-128 fingerprints, Unique entries) is written with ShardWriter,
//     and an ordinary volume file of the same size with File::Write. Then,
//     alternating (scan, read) --reps times: stream the shard with
//     ShardReader (entries/s, bytes/s), and read the ordinary file with
//     File::Read in 1 MiB requests (the device's sequential read bandwidth
//     through the volume, measured next to the scan on the same machine
//     state). Reported: the median of the per-pair ratio scan/read.
//     Then a real pass: a few hundred fresh records, RunDedupPass with
//     force=true, which merge-scans the whole shard and rewrites it.
//  2. New shared blocks: a file of --blocks distinct random blocks written
//     with File::Write through a WriteMonitor whose batches go to the write
//     log (as `dede import` does), then a second file with the same
//     content, then one pass (unique -> shared for every block). Then a
//     third copy and another pass (shared -> shared).
//  3. Unique-only records: a file of --blocks distinct blocks, one pass.
//  4. Peak memory: every pass runs in a forked child, which resets its
//     peak RSS (/proc/self/clear_refs) right before RunDedupPass and reads
//     VmHWM after it; peak - RSS before = the pass's memory.
//
// Exit status: 0 success, 1 operational error, 2 usage error.
#include <fcntl.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/statfs.h>
#include <sys/sysinfo.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
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
#include <type_traits>
#include <vector>

#include "agent/dedup_pass.h"
#include "index/shard_format.h"
#include "index/shard_io.h"
#include "kmod/writemon/write_log.h"
#include "kmod/writemon/write_monitor.h"
#include "volume/block_device.h"
#include "volume/mem_device.h"
#include "volume/volume.h"

#include "tools/bench/bench_env.h"
#include "tools/bench/bench_util.h"

namespace dede::bench {
namespace {

namespace po = boost::program_options;
using json = nlohmann::json;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

constexpr uint64_t kMiB = 1ull << 20;
constexpr size_t kChunk = 1 << 20;  // write / sequential read request
constexpr uint64_t kLogFlushBytes = 256ull << 20;  // as `dede import`

// The targets.
constexpr double kScanTarget = 0.50;       // scan bytes/s vs sequential read
constexpr double kShareTargetMBps = 200;   // new shared blocks, path backend
constexpr double kDedeSharedMBps = 2.6;    // DeDe's prototype (paper)

double Now() { return ClockSeconds(CLOCK_MONOTONIC); }
double Cpu() { return ClockSeconds(CLOCK_PROCESS_CPUTIME_ID); }

// ------------------------------------------------------------ device

// Counts the device commands below the volume (thread-safe: the volume may
// issue I/O from more than one thread).
class CountingDevice : public BlockDevice {
 public:
  explicit CountingDevice(BlockDevice* d) : d_(d) {}
  uint64_t size_bytes() const override { return d_->size_bytes(); }
  Status Read(uint64_t off, void* buf, size_t len) override {
    const double t0 = Now();
    Status s = d_->Read(off, buf, len);
    Add(&reads_, &read_bytes_, &read_ns_, len, t0);
    return s;
  }
  Status Write(uint64_t off, const void* buf, size_t len) override {
    const double t0 = Now();
    Status s = d_->Write(off, buf, len);
    Add(&writes_, &write_bytes_, &write_ns_, len, t0);
    return s;
  }
  Status Flush() override {
    const double t0 = Now();
    Status s = d_->Flush();
    flushes_++;
    flush_ns_ += uint64_t((Now() - t0) * 1e9);
    return s;
  }
  Status Discard(uint64_t off, uint64_t len) override { return d_->Discard(off, len); }
  std::string name() const override { return d_->name(); }
  std::string local_lock_path() const override { return d_->local_lock_path(); }

  struct Counts {
    uint64_t reads = 0, writes = 0, flushes = 0, read_bytes = 0, write_bytes = 0;
    uint64_t read_ns = 0, write_ns = 0, flush_ns = 0;
    Counts operator-(const Counts& o) const {
      return {reads - o.reads,           writes - o.writes,   flushes - o.flushes,
              read_bytes - o.read_bytes, write_bytes - o.write_bytes,
              read_ns - o.read_ns,       write_ns - o.write_ns, flush_ns - o.flush_ns};
    }
    double device_seconds() const { return double(read_ns + write_ns + flush_ns) / 1e9; }
    json ToJson() const {
      return json{{"reads", reads},           {"writes", writes},
                  {"flushes", flushes},       {"read_bytes", read_bytes},
                  {"write_bytes", write_bytes}, {"read_seconds", read_ns / 1e9},
                  {"write_seconds", write_ns / 1e9}, {"flush_seconds", flush_ns / 1e9}};
    }
  };
  Counts counts() const {
    return {reads_.load(),      writes_.load(),      flushes_.load(),
            read_bytes_.load(), write_bytes_.load(), read_ns_.load(),
            write_ns_.load(),   flush_ns_.load()};
  }

 private:
  static void Add(std::atomic<uint64_t>* n, std::atomic<uint64_t>* bytes,
                  std::atomic<uint64_t>* ns, size_t len, double t0) {
    (*n)++;
    *bytes += len;
    *ns += uint64_t((Now() - t0) * 1e9);
  }
  BlockDevice* d_;
  std::atomic<uint64_t> reads_{0}, writes_{0}, flushes_{0}, read_bytes_{0}, write_bytes_{0};
  std::atomic<uint64_t> read_ns_{0}, write_ns_{0}, flush_ns_{0};
};

// ------------------------------------------------------------ helpers

struct Env {
  CountingDevice* dev = nullptr;
  std::unique_ptr<Volume> vol;
};

Status OpenVol(Env* env) {
  ASSIGN_OR_RETURN(env->vol, Volume::Open(env->dev, OpenOptions{}));
  return Status::Ok();
}

Status Reformat(Env* env) {
  env->vol.reset();
  RETURN_IF_ERROR(FormatVolume(env->dev, FormatOptions{}, /*force=*/true));
  return OpenVol(env);
}

// Writes blocks [0, n) of content set `set` into a new regular file `name`
// of n blocks with File::Write in 1 MiB requests, feeding a WriteMonitor and
// appending its batch to the file's write log every 256 MiB and at the end
// (as `dede import` does). Returns seconds.
Result<double> WriteMonitoredFile(Volume* vol, const std::string& name, uint64_t n,
                                  uint64_t set) {
  const double t0 = Now();
  ASSIGN_OR_RETURN(FileId fid, vol->Create(name, n * kBlockSize));
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, vol->OpenFile(name));
  WriteMonitorOptions mo;
  mo.algo = vol->superblock().hash_algo;
  mo.memory_cap_bytes = size_t{256} << 20;
  WriteMonitor monitor(mo);
  monitor.AddFile(fid, true);
  AlignedBuf buf = NewAligned(kChunk);
  const uint64_t per = kChunk / kBlockSize;
  uint64_t since = 0;
  for (uint64_t b = 0; b < n; b += per) {
    const uint64_t k = std::min(per, n - b);
    for (uint64_t j = 0; j < k; j++) FillBlock(buf.get() + j * kBlockSize, set, b + j);
    RETURN_IF_ERROR(f->Write(b * kBlockSize, buf.get(), k * kBlockSize));
    monitor.OnWrite(fid, b * kBlockSize, buf.get(), k * kBlockSize);
    since += k * kBlockSize;
    if (since >= kLogFlushBytes) {
      RETURN_IF_ERROR(AppendToWriteLog(vol, monitor.Take(fid)));
      since = 0;
    }
  }
  RETURN_IF_ERROR(AppendToWriteLog(vol, monitor.Take(fid)));
  f.reset();
  RETURN_IF_ERROR(vol->Sync());
  return Now() - t0;
}

// Plain file of `bytes` (multiple of 1 MiB) written in 1 MiB requests.
Status WritePlainFile(Volume* vol, const std::string& name, uint64_t bytes) {
  RETURN_IF_ERROR(vol->Create(name, bytes).status());
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, vol->OpenFile(name));
  AlignedBuf buf = NewAligned(kChunk);
  for (uint64_t off = 0; off < bytes; off += kChunk) {
    for (size_t j = 0; j < kChunk / kBlockSize; j++) {
      FillBlock(buf.get() + j * kBlockSize, 99, off / kBlockSize + j);
    }
    RETURN_IF_ERROR(f->Write(off, buf.get(), kChunk));
  }
  return vol->Sync();
}

// /proc/self/status field in KiB; 0 if absent.
uint64_t ProcStatusKiB(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') {
      return std::strtoull(line.c_str() + n + 1, nullptr, 10);
    }
  }
  return 0;
}

// ------------------------------------------------------------ passes in a child

struct ChildResult {
  int ok = 0;
  char error[512] = {};
  DedupStats stats;
  double wall_s = 0;     // around RunDedupPass
  double cpu_s = 0;      // process CPU during the pass
  uint64_t rss_before_kib = 0;
  uint64_t hwm_kib = 0;  // VmHWM after the pass (reset just before it)
  bool hwm_reset = false;
  uint64_t maxrss_kib = 0;  // getrusage ru_maxrss after the pass
  CountingDevice::Counts dev;
};
static_assert(std::is_trivially_copyable_v<ChildResult>);

struct PassRun {
  ChildResult r;
  double mem_mib() const {
    const uint64_t base = r.rss_before_kib;
    const uint64_t peak = r.hwm_reset ? r.hwm_kib : r.maxrss_kib;
    return peak > base ? double(peak - base) / 1024.0 : 0.0;
  }
  double mib_per_m_records() const {
    return r.stats.log_records ? mem_mib() / (double(r.stats.log_records) / 1e6) : 0.0;
  }
  json ToJson() const {
    const DedupStats& s = r.stats;
    json j;
    j["seconds"] = r.wall_s;
    j["cpu_seconds"] = r.cpu_s;
    j["gather_seconds"] = s.gather_ns / 1e9;
    j["merge_seconds"] = s.merge_ns / 1e9;
    j["log_records"] = s.log_records;
    j["unique_added"] = s.unique_added;
    j["shared_new"] = s.shared_new;
    j["shared_hits"] = s.shared_hits;
    j["already_shared"] = s.already_shared;
    j["stale_records"] = s.stale_records;
    j["stale_entries"] = s.stale_entries;
    j["busy_targets"] = s.busy_targets;
    j["records_parked_busy"] = s.records_parked_busy;
    j["gc_unique_entries"] = s.gc_unique_entries;
    j["shards_rewritten"] = s.shards_rewritten;
    j["shards_deferred"] = s.shards_deferred;
    j["shards_split"] = s.shards_split;
    j["entries_scanned"] = s.entries_scanned;
    j["entries_written"] = s.entries_written;
    j["index_bytes_read"] = s.index_bytes_read;
    j["index_bytes_written"] = s.index_bytes_written;
    j["rss_before_kib"] = r.rss_before_kib;
    j["peak_rss_kib"] = r.hwm_reset ? r.hwm_kib : r.maxrss_kib;
    j["peak_source"] = r.hwm_reset ? "VmHWM after clear_refs" : "ru_maxrss";
    j["pass_memory_mib"] = mem_mib();
    j["device"] = r.dev.ToJson();
    return j;
  }
};

// Runs one dedup pass in a forked child on the (closed) volume of `env`.
Result<PassRun> RunPassInChild(Env* env, const DedupOptions& opts) {
  env->vol.reset();  // the child opens the volume itself (and its locks)
  std::fflush(stdout);
  std::fflush(stderr);
  malloc_trim(0);  // freed heap pages of the parent do not hide the child's growth
  int fds[2];
  if (::pipe(fds) != 0) return Status::FromErrno("pipe", errno);
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int e = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    return Status::FromErrno("fork", e);
  }
  if (pid == 0) {
    ::close(fds[0]);
    ChildResult res;
    auto fail = [&](const Status& st) {
      std::snprintf(res.error, sizeof res.error, "%s", st.ToString().c_str());
    };
    Result<std::unique_ptr<Volume>> v = Volume::Open(env->dev, OpenOptions{});
    if (!v.ok()) {
      fail(v.status());
    } else {
      std::unique_ptr<Volume> vol = std::move(v.value());
      {
        VolumeFileAccess access(vol.get());
        malloc_trim(0);
        {
          std::ofstream cr("/proc/self/clear_refs");
          cr << "5";
          cr.flush();
          res.hwm_reset = static_cast<bool>(cr);
        }
        res.rss_before_kib = ProcStatusKiB("VmRSS");
        const CountingDevice::Counts c0 = env->dev->counts();
        const double t0 = Now(), cpu0 = Cpu();
        Result<DedupStats> st = RunDedupPass(vol.get(), &access, opts);
        res.wall_s = Now() - t0;
        res.cpu_s = Cpu() - cpu0;
        res.dev = env->dev->counts() - c0;
        res.hwm_kib = ProcStatusKiB("VmHWM");
        struct rusage ru {};
        ::getrusage(RUSAGE_SELF, &ru);
        res.maxrss_kib = uint64_t(ru.ru_maxrss);
        if (st.ok()) {
          res.stats = *st;
          res.ok = 1;
        } else {
          fail(st.status());
        }
      }
      vol.reset();
    }
    const char* p = reinterpret_cast<const char*>(&res);
    size_t left = sizeof res;
    while (left > 0) {
      ssize_t n = ::write(fds[1], p, left);
      if (n <= 0) break;
      p += n;
      left -= size_t(n);
    }
    ::_exit(res.ok ? 0 : 1);
  }
  ::close(fds[1]);
  PassRun run;
  char* p = reinterpret_cast<char*>(&run.r);
  size_t got = 0;
  while (got < sizeof run.r) {
    ssize_t n = ::read(fds[0], p + got, sizeof run.r - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += size_t(n);
  }
  ::close(fds[0]);
  int wst = 0;
  while (::waitpid(pid, &wst, 0) < 0 && errno == EINTR) {
  }
  RETURN_IF_ERROR(OpenVol(env));
  if (got != sizeof run.r) {
    return Status::IoError("dedup pass child died (wait status " + std::to_string(wst) + ")");
  }
  if (!run.r.ok) return Status::IoError(std::string("dedup pass: ") + run.r.error);
  return run;
}

// ------------------------------------------------------------ figure 1

struct ScanSample {
  double seconds = 0, cpu = 0;
  double dev = 0;  // seconds inside the device's Read (pread)
  uint64_t entries = 0, bytes = 0;
  double entries_per_s() const { return seconds > 0 ? entries / seconds : 0; }
  double mbps() const { return seconds > 0 ? bytes / seconds / 1e6 : 0; }
};

// Streams the whole shard version `name` with ShardReader.
Result<ScanSample> ScanShard(Volume* vol, CountingDevice* dev, const std::string& name) {
  ScanSample s;
  const CountingDevice::Counts d0 = dev->counts();
  const double t0 = Now(), c0 = Cpu();
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, vol->OpenFile(name));
  ASSIGN_OR_RETURN(std::unique_ptr<ShardReader> r,
                   ShardReader::Open(f.get(), vol->superblock().uuid, name));
  IndexEntry e;
  uint64_t sum = 0;
  while (true) {
    ASSIGN_OR_RETURN(bool more, r->Next(&e));
    if (!more) break;
    sum += e.block;
    s.entries++;
  }
  s.seconds = Now() - t0;
  s.cpu = Cpu() - c0;
  s.dev = (dev->counts() - d0).device_seconds();
  const ShardHeader& h = r->header();
  s.bytes = (1 + h.entry_blocks + h.file_blocks) * kBlockSize;
  if (r->stats().corrupt_blocks || s.entries != h.entry_count) {
    return Status::Corruption(name + ": scanned " + std::to_string(s.entries) + " of " +
                              std::to_string(h.entry_count) + " entries, " +
                              std::to_string(r->stats().corrupt_blocks) + " corrupt blocks");
  }
  (void)sum;
  return s;
}

// Reads the whole file `name` front to back in 1 MiB requests into `buf`.
Result<ScanSample> ReadFileSeq(Volume* vol, CountingDevice* dev, const std::string& name,
                               uint8_t* buf) {
  ScanSample s;
  const CountingDevice::Counts d0 = dev->counts();
  const double t0 = Now(), c0 = Cpu();
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, vol->OpenFile(name));
  const uint64_t size = f->size();
  for (uint64_t off = 0; off < size; off += kChunk) {
    const size_t len = size_t(std::min<uint64_t>(kChunk, size - off));
    RETURN_IF_ERROR(f->Read(off, buf, len));
  }
  s.seconds = Now() - t0;
  s.cpu = Cpu() - c0;
  s.dev = (dev->counts() - d0).device_seconds();
  s.bytes = size;
  return s;
}

// Writes shard version `shard` (depth 0) of `entries` Unique entries with
// ShardWriter: sorted, distinct random fingerprints (entry i's 64-bit prefix
// lies in the i-th of `entries` equal slices of the prefix space), naming
// blocks of `ref`. Returns seconds.
Result<double> WriteBigShard(Volume* vol, const std::string& shard, uint64_t entries, FileId ref,
                             uint64_t ref_blocks) {
  RETURN_IF_ERROR(vol->Create(shard, 0, FileKind::kIndexShard).status());
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, vol->OpenFile(shard));
  ShardHeader proto;
  proto.range = ShardRange{0, 0};
  proto.version = 1;
  proto.algo = vol->superblock().hash_algo;
  proto.host_id = vol->host_id();
  const double t0 = Now();
  ShardWriter w(vol, f.get(), proto);
  Rng rng{7};
  const uint64_t slice = ~0ull / entries;
  IndexEntry e;
  e.kind = EntryKind::kUnique;
  e.file = ref;
  for (uint64_t i = 0; i < entries; i++) {
    const uint64_t prefix = i * slice + rng.Next() % slice;
    const uint64_t low = rng.Next();
    for (int k = 0; k < 8; k++) {
      e.fp[size_t(k)] = uint8_t(prefix >> (56 - 8 * k));
      e.fp[size_t(8 + k)] = uint8_t(low >> (56 - 8 * k));
    }
    e.block = i % ref_blocks;
    RETURN_IF_ERROR(w.Add(e));
  }
  RETURN_IF_ERROR(w.Finish(0, 0));
  return Now() - t0;
}

// Random 4 KiB File::Read requests (QD1, aligned buffer) over the file for
// about `seconds`: the device's random read rate through the volume, the
// bound on anything that reads blocks one at a time.
Result<ScanSample> ReadFileRandom(Volume* vol, const std::string& name, double seconds) {
  ScanSample s;
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, vol->OpenFile(name));
  const uint64_t blocks = f->size() / kBlockSize;
  AlignedBuf b = NewAligned(kBlockSize);
  Rng rng{42};
  const double t0 = Now(), c0 = Cpu();
  while (Now() - t0 < seconds) {
    for (int k = 0; k < 64; k++) {
      RETURN_IF_ERROR(f->Read(rng.Next() % blocks * kBlockSize, b.get(), kBlockSize));
      s.entries++;
    }
  }
  s.seconds = Now() - t0;
  s.cpu = Cpu() - c0;
  s.bytes = s.entries * kBlockSize;
  return s;
}

// ------------------------------------------------------------ main

struct Args {
  std::string dir = "/var/tmp";
  uint64_t entries = 6'000'000;
  uint64_t blocks = 64 * 1024;
  uint64_t few = 256;
  int reps = 5;
  int pass_reps = 1;
  bool skip_scan = false;
  bool skip_passes = false;
  std::string json_path;
};

int Usage(const std::string& msg, const po::options_description& desc) {
  std::cerr << "dede-bench-index: " << msg << "\n"
            << "usage: dede-bench-index [options]\n"
            << desc;
  return kExitUsage;
}

int Fail(const Status& st) {
  std::cerr << "dede-bench-index: " << st.ToString() << std::endl;
  return kExitError;
}

void PrintPass(const char* what, int rep, const PassRun& p) {
  const DedupStats& s = p.r.stats;
  const CountingDevice::Counts& d = p.r.dev;
  std::printf(
      "  %-26s rep %d: %7.2f s (gather %.2f, merge %.2f; cpu %.2f s, in device %.0f%%)  "
      "records %" PRIu64 "  unique+ %" PRIu64 "  shared_new %" PRIu64 "  shared_hits %" PRIu64
      "  stale %" PRIu64 "/%" PRIu64 "  scanned %" PRIu64 "  written %" PRIu64
      "  dev r/w/f %" PRIu64 "/%" PRIu64 "/%" PRIu64 "  mem %.1f MiB\n",
      what, rep + 1, p.r.wall_s, s.gather_ns / 1e9, s.merge_ns / 1e9, p.r.cpu_s,
      p.r.wall_s > 0 ? 100 * d.device_seconds() / p.r.wall_s : 0.0, s.log_records,
      s.unique_added, s.shared_new, s.shared_hits, s.stale_records, s.stale_entries,
      s.entries_scanned, s.entries_written, d.reads, d.writes, d.flushes, p.mem_mib());
  std::fflush(stdout);
}

std::string List(const std::vector<double>& v, const char* fmt) {
  std::string out;
  for (double x : v) {
    char b[32];
    std::snprintf(b, sizeof b, fmt, x);
    if (!out.empty()) out += " ";
    out += b;
  }
  return out;
}

int Main(int argc, char** argv) {
  Args a;
  po::options_description desc("options");
  desc.add_options()("help,h", "show this help and exit")(
      "dir", po::value<std::string>(&a.dir)->default_value(a.dir),
      "directory for the sparse device file (disk-backed; not tmpfs)")(
      "entries", po::value<uint64_t>(&a.entries)->default_value(a.entries),
      "entries of the shard version merge-scanned in figure 1")(
      "blocks", po::value<uint64_t>(&a.blocks)->default_value(a.blocks),
      "distinct 4 KiB blocks per file in figures 2-4 (records per file)")(
      "few", po::value<uint64_t>(&a.few)->default_value(a.few),
      "fresh records of the forced pass over the big shard")(
      "reps", po::value<int>(&a.reps)->default_value(a.reps),
      "scan/read pairs and forced passes in figure 1 (medians reported)")(
      "pass-reps", po::value<int>(&a.pass_reps)->default_value(a.pass_reps),
      "repetitions of the unique / new-shared / shared-hit passes (each reformats)")(
      "skip-scan", po::bool_switch(&a.skip_scan), "skip figure 1")(
      "skip-passes", po::bool_switch(&a.skip_passes), "skip figures 2-4")(
      "json", po::value<std::string>(&a.json_path), "also write the results as JSON to FILE");
  po::variables_map vm;
  try {
    po::store(
        po::command_line_parser(argc, argv)
            .options(desc)
            .style(po::command_line_style::default_style & ~po::command_line_style::allow_guessing)
            .run(),
        vm);
    po::notify(vm);
  } catch (const po::error& e) {
    return Usage(e.what(), desc);
  }
  if (vm.count("help")) {
    std::cout
        << "usage: dede-bench-index [options]\n\n"
           "The index and the dedup pass on a path-backed volume in a sparse file under\n"
           "--dir (removed at the end):\n"
           "  1. merge-scan rate of a big shard version (ShardReader) vs. sequential\n"
           "     File::Read of an ordinary file of the same size, alternating, and the\n"
           "     scan inside a forced RunDedupPass;\n"
           "  2. MB/s of new shared blocks in a pass (two identical files), and of\n"
           "     shared -> shared (a third copy);\n"
           "  3. records/s of a pass over unique-only records;\n"
           "  4. peak memory of each pass (run in a forked child) per million records.\n\n"
        << desc;
    return kExitOk;
  }
  if (a.entries < 1000 || a.entries > (1ull << 32)) return Usage("--entries: 1000..2^32", desc);
  if (a.blocks < 256 || a.blocks > (1ull << 24)) return Usage("--blocks: 256..2^24", desc);
  if (a.few < 1 || a.few > a.blocks) return Usage("--few: 1..--blocks", desc);
  if (a.reps < 1 || a.reps > 99) return Usage("--reps must be 1..99", desc);
  if (a.pass_reps < 1 || a.pass_reps > 99) return Usage("--pass-reps must be 1..99", desc);

  // ---- sizes
  const HashAlgo algo = HashAlgo::kXxh128;  // FormatOptions default
  const ShardRange whole{0, 0};
  const uint32_t per_block = EntriesPerBlock(EntrySize(algo, whole));
  const uint64_t shard_blocks = 1 + (a.entries + per_block - 1) / per_block + 1;
  const uint64_t shard_bytes = shard_blocks * kBlockSize;
  const uint64_t seq_bytes = (shard_bytes + kMiB - 1) / kMiB * kMiB;
  // Figure 1: the shard, its rewrite by the forced pass, the read file.
  const uint64_t need_scan = a.skip_scan ? 0 : 2 * shard_bytes + seq_bytes + 64 * kMiB;
  // Figures 2-4: four files of --blocks blocks, their logs and the index.
  const uint64_t file_bytes = a.blocks * kBlockSize;
  const uint64_t need_pass = a.skip_passes ? 0 : 4 * file_bytes + 4 * file_bytes / 64 + 64 * kMiB;
  const uint64_t data = std::max(need_scan, need_pass);
  // Fixed metadata (~45 MiB for 8 hosts) and refcount/pointer blocks.
  // At least 1.25 GiB: below 1 GiB the volume gets a 256-block journal
  // instead of the default 1024 blocks, and the passes commit far more often.
  const uint64_t dev_bytes =
      std::max<uint64_t>(1280 * kMiB, (data + data / 16 + 128 * kMiB + kMiB - 1) / kMiB * kMiB);

  // ---- device
  auto scratch = ScratchFile::Create(a.dir + "/dede-bench-index.XXXXXX", dev_bytes);
  if (!scratch.ok()) return Fail(scratch.status());
  const std::string& path = (*scratch)->path();
  const std::string& fs_type = (*scratch)->fs_type();
  const bool direct = (*scratch)->o_direct();
  auto opened = OpenBlockDevice(path, DeviceOptions{});
  if (!opened.ok()) return Fail(opened.status());
  std::unique_ptr<BlockDevice> raw = std::move(opened.value());
  CountingDevice dev(raw.get());

  json out;
  out["machine"] = MachineJson();
  out["device"] = {{"path", path}, {"bytes", dev_bytes}, {"o_direct", direct},
                   {"file_system", fs_type}};
  out["args"] = {{"entries", a.entries}, {"blocks", a.blocks},     {"few", a.few},
                 {"reps", a.reps},       {"pass_reps", a.pass_reps}};
  std::printf("device   %s (%" PRIu64 " MiB sparse file, %s, %s)\n", path.c_str(),
              dev_bytes / kMiB, fs_type.c_str(),
              direct ? "O_DIRECT" : "buffered: O_DIRECT refused -- numbers measure the page cache");
  std::printf("params   entries %" PRIu64 " (%" PRIu64 " MiB shard, %u entries/block), blocks %" PRIu64
              " (%" PRIu64 " MiB per file), reps %d, pass-reps %d\n",
              a.entries, shard_bytes / kMiB, per_block, a.blocks, file_bytes / kMiB, a.reps,
              a.pass_reps);
  std::fflush(stdout);

  // ---- precondition: write the whole device once (1 MiB requests), so no
  // phase pays the host file system's first-allocation cost.
  {
    AlignedBuf buf = NewAligned(4 * kMiB);
    std::memset(buf.get(), 0, 4 * kMiB);
    const double t0 = Now();
    for (uint64_t off = 0; off < dev_bytes; off += 4 * kMiB) {
      const size_t len = size_t(std::min<uint64_t>(4 * kMiB, dev_bytes - off));
      if (Status s = raw->Write(off, buf.get(), len); !s.ok()) return Fail(s);
    }
    if (Status s = raw->Flush(); !s.ok()) return Fail(s);
    std::printf("precondition: wrote %" PRIu64 " MiB in %.1f s\n", dev_bytes / kMiB, Now() - t0);
    std::fflush(stdout);
  }

  Env env;
  env.dev = &dev;
  std::vector<std::pair<std::string, std::string>> table;  // label, value
  auto row = [&](const std::string& label, const std::string& value) {
    table.emplace_back(label, value);
  };
  char buf[512];

  // ================================================================ figure 1
  if (!a.skip_scan) {
    if (Status s = Reformat(&env); !s.ok()) return Fail(s);
    Volume* vol = env.vol.get();
    const Uuid uuid = vol->superblock().uuid;
    // Unique entries name blocks of this file (a hole of 4 GiB): they stay
    // valid in the forced pass, so it rewrites every one of them.
    const uint64_t ref_blocks = 1u << 20;
    auto ref = vol->Create("scan-ref", ref_blocks * kBlockSize);
    if (!ref.ok()) return Fail(ref.status());
    const std::string shard = ShardFileName(whole, 1);
    double write_s = 0;
    {
      auto w = WriteBigShard(vol, shard, a.entries, *ref, ref_blocks);
      if (!w.ok()) return Fail(w.status());
      write_s = *w;
      std::printf("shard    %s: %" PRIu64 " entries, %" PRIu64
                  " MiB written with ShardWriter in %.2f s (%.2f M entries/s)\n",
                  shard.c_str(), a.entries, shard_bytes / kMiB, write_s,
                  a.entries / write_s / 1e6);
    }
    if (Status s = WritePlainFile(vol, "seq-read", seq_bytes); !s.ok()) return Fail(s);
    std::printf("read     'seq-read': %" PRIu64 " MiB ordinary file\n", seq_bytes / kMiB);
    std::fflush(stdout);
    (void)uuid;

    AlignedBuf rbuf = NewAligned(kChunk);
    // The shard file read the way ShardReader reads it (1 MiB File::Read
    // into a 4 KiB-aligned buffer, no bounce), without decoding: the I/O
    // part of the scan.
    std::vector<double> scan_eps, scan_mbps, read_mbps, ratios, scan_cpu, scan_dev, raw_mbps;
    json pairs = json::array();
    for (int rep = 0; rep < a.reps; rep++) {
      auto sc = ScanShard(vol, &dev, shard);
      if (!sc.ok()) return Fail(sc.status());
      auto rd = ReadFileSeq(vol, &dev, "seq-read", rbuf.get());
      if (!rd.ok()) return Fail(rd.status());
      auto rs = ReadFileSeq(vol, &dev, shard, rbuf.get());
      if (!rs.ok()) return Fail(rs.status());
      scan_eps.push_back(sc->entries_per_s());
      scan_mbps.push_back(sc->mbps());
      read_mbps.push_back(rd->mbps());
      raw_mbps.push_back(rs->mbps());
      ratios.push_back(sc->mbps() / rd->mbps());
      scan_cpu.push_back(sc->cpu / sc->seconds);
      scan_dev.push_back(sc->dev / sc->seconds);
      std::printf("  rep %d: scan %" PRIu64 " entries in %.3f s = %.2f M entries/s, %.1f MB/s "
                  "(cpu %.0f%%, in pread %.0f%%) | seq read %.1f MB/s (cpu %.0f%%, in pread "
                  "%.0f%%) | shard read w/o decode %.1f MB/s | scan/read %.1f%%\n",
                  rep + 1, sc->entries, sc->seconds, sc->entries_per_s() / 1e6, sc->mbps(),
                  100 * sc->cpu / sc->seconds, 100 * sc->dev / sc->seconds, rd->mbps(),
                  100 * rd->cpu / rd->seconds, 100 * rd->dev / rd->seconds, rs->mbps(),
                  100 * ratios.back());
      std::fflush(stdout);
      pairs.push_back({{"scan_seconds", sc->seconds},
                       {"scan_cpu_seconds", sc->cpu},
                       {"scan_device_seconds", sc->dev},
                       {"scan_entries", sc->entries},
                       {"scan_bytes", sc->bytes},
                       {"read_seconds", rd->seconds},
                       {"read_cpu_seconds", rd->cpu},
                       {"read_device_seconds", rd->dev},
                       {"read_bytes", rd->bytes},
                       {"shard_read_no_decode_seconds", rs->seconds},
                       {"shard_read_no_decode_bytes", rs->bytes}});
    }
    // The same scan from a RAM device: the CPU cost of ShardReader alone.
    std::vector<double> ram_eps, ram_cpu_eps;  // per wall second, per CPU second
    {
      MemDevice mem(shard_bytes + 192 * kMiB, "ram");
      CountingDevice cmem(&mem);
      Env menv;
      menv.dev = &cmem;
      if (Status s = Reformat(&menv); !s.ok()) return Fail(s);
      auto mref = menv.vol->Create("scan-ref", ref_blocks * kBlockSize);
      if (!mref.ok()) return Fail(mref.status());
      auto w = WriteBigShard(menv.vol.get(), shard, a.entries, *mref, ref_blocks);
      if (!w.ok()) return Fail(w.status());
      for (int rep = 0; rep < a.reps; rep++) {
        auto sc = ScanShard(menv.vol.get(), &cmem, shard);
        if (!sc.ok()) return Fail(sc.status());
        ram_eps.push_back(sc->entries_per_s());
        ram_cpu_eps.push_back(sc->cpu > 0 ? sc->entries / sc->cpu : 0);
      }
      std::vector<double> m;
      for (double x : ram_eps) m.push_back(x / 1e6);
      std::vector<double> mc;
      for (double x : ram_cpu_eps) mc.push_back(x / 1e6);
      std::printf("  scan from a RAM device (CPU only): %s M entries/s; per CPU second %s\n",
                  List(m, "%.2f").c_str(), List(mc, "%.2f").c_str());
    }
    const double ratio = Median(ratios);
    out["scan"] = {{"entries", a.entries},
                   {"shard_bytes", shard_bytes},
                   {"shard_write_seconds", write_s},
                   {"pairs", pairs},
                   {"entries_per_s", Median(scan_eps)},
                   {"scan_mb_per_s", Median(scan_mbps)},
                   {"seq_read_mb_per_s", Median(read_mbps)},
                   {"scan_cpu_fraction", Median(scan_cpu)},
                   {"scan_device_fraction", Median(scan_dev)},
                   {"ram_device_entries_per_s", Median(ram_eps)},
                   {"ram_device_entries_per_cpu_s", Median(ram_cpu_eps)},
                   {"ram_device_mb_per_s", Median(ram_eps) * double(shard_bytes) / a.entries / 1e6},
                   {"shard_read_no_decode_mb_per_s", Median(raw_mbps)},
                   {"pair_ratios", ratios},
                   {"ratio", ratio},
                   {"target_ratio", kScanTarget},
                   {"target_met", ratio >= kScanTarget}};
    std::snprintf(buf, sizeof buf, "%.2f M entries/s (%.1f MB/s; reps %s)",
                  Median(scan_eps) / 1e6, Median(scan_mbps), List(scan_eps, "%.0f").c_str());
    row("1. index merge-scan (ShardReader, " + std::to_string(a.entries) + " entries)", buf);
    std::snprintf(buf, sizeof buf, "%.1f MB/s (reps %s)", Median(read_mbps),
                  List(read_mbps, "%.0f").c_str());
    row("   seq read, same volume (File::Read 1 MiB)", buf);
    std::snprintf(buf, sizeof buf, "%.1f MB/s; scan: cpu %.0f%%, in pread %.0f%% of its time",
                  Median(raw_mbps), 100 * Median(scan_cpu), 100 * Median(scan_dev));
    row("   shard file read without decoding (as ShardReader)", buf);
    std::snprintf(buf, sizeof buf,
                  "%.2f M entries/s (%.0f MB/s); per CPU second %.2f M (%.0f MB/s, %.0f ns/entry)",
                  Median(ram_eps) / 1e6, Median(ram_eps) * double(shard_bytes) / a.entries / 1e6,
                  Median(ram_cpu_eps) / 1e6,
                  Median(ram_cpu_eps) * double(shard_bytes) / a.entries / 1e6,
                  1e9 / Median(ram_cpu_eps));
    row("   scan from a RAM device (ShardReader CPU only)", buf);
    std::snprintf(buf, sizeof buf, "%.1f%% (pairs %s)  target >= %.0f%%: %s", 100 * ratio,
                  List(ratios, "%.2f").c_str(), 100 * kScanTarget,
                  ratio >= kScanTarget ? "met" : "MISSED");
    row("   scan bytes/s / seq read bytes/s", buf);

    // ---- the scan inside a real pass: a few fresh records, force=true.
    std::vector<double> pass_eps, pass_rw;
    json forced = json::array();
    for (int rep = 0; rep < a.reps; rep++) {
      // New content each time, so there are `few` fresh records.
      {
        std::string name = "few-" + std::to_string(rep);
        auto w = WriteMonitoredFile(env.vol.get(), name, a.few, 1000 + uint64_t(rep));
        if (!w.ok()) return Fail(w.status());
      }
      DedupOptions o;
      o.force = true;
      auto p = RunPassInChild(&env, o);
      if (!p.ok()) return Fail(p.status());
      PrintPass("forced pass (merge-scan)", rep, *p);
      const DedupStats& s = p->r.stats;
      const double merge_s = s.merge_ns / 1e9;
      pass_eps.push_back(merge_s > 0 ? s.entries_scanned / merge_s : 0);
      pass_rw.push_back(merge_s > 0 ? (s.index_bytes_read + s.index_bytes_written) / merge_s / 1e6
                                    : 0);
      forced.push_back(p->ToJson());
    }
    out["forced_pass"] = {{"runs", forced},
                          {"entries_scanned_per_merge_second", Median(pass_eps)},
                          {"index_mb_read_written_per_merge_second", Median(pass_rw)}};
    std::snprintf(buf, sizeof buf,
                  "%.2f M entries/s scanned+rewritten (%.1f MB/s read+written; reps %s)",
                  Median(pass_eps) / 1e6, Median(pass_rw), List(pass_eps, "%.0f").c_str());
    row("   merge-scan in RunDedupPass(force), " + std::to_string(a.few) + " records", buf);
    env.vol.reset();
  }

  // ================================================================ figures 2-4
  if (!a.skip_passes) {
    std::vector<double> uniq_rps, uniq_mbps, new_mbps, hit_mbps, mem_u, mem_n, mem_h, rand_iops;
    std::vector<double> new_reads_per, new_dev_us, hit_reads_per, hit_dev_us, rand_cpu_us;
    std::vector<double> new_cpu_us, hit_cpu_us;
    json reps = json::array();
    for (int rep = 0; rep < a.pass_reps; rep++) {
      json jr;
      if (Status s = Reformat(&env); !s.ok()) return Fail(s);
      // 3. unique-only: one file of distinct blocks (content set 1).
      auto w = WriteMonitoredFile(env.vol.get(), "unique", a.blocks, 1);
      if (!w.ok()) return Fail(w.status());
      std::printf("  wrote 'unique' (%" PRIu64 " MiB, monitored) in %.2f s\n", file_bytes / kMiB,
                  *w);
      auto pu = RunPassInChild(&env, DedupOptions{});
      if (!pu.ok()) return Fail(pu.status());
      PrintPass("unique-only", rep, *pu);
      {
        const DedupStats& s = pu->r.stats;
        uniq_rps.push_back(s.log_records / pu->r.wall_s);
        uniq_mbps.push_back(s.log_records * double(kBlockSize) / pu->r.wall_s / 1e6);
        mem_u.push_back(pu->mib_per_m_records());
        jr["unique_only"] = pu->ToJson();
      }
      // 2. two identical files (content set 2): every block becomes shared.
      for (const char* name : {"copy-a", "copy-b"}) {
        auto wc = WriteMonitoredFile(env.vol.get(), name, a.blocks, 2);
        if (!wc.ok()) return Fail(wc.status());
        std::printf("  wrote '%s' (%" PRIu64 " MiB, monitored) in %.2f s\n", name,
                    file_bytes / kMiB, *wc);
      }
      auto pn = RunPassInChild(&env, DedupOptions{});
      if (!pn.ok()) return Fail(pn.status());
      PrintPass("unique->shared (2 copies)", rep, *pn);
      {
        const DedupStats& s = pn->r.stats;
        new_mbps.push_back(s.shared_new * double(kBlockSize) / pn->r.wall_s / 1e6);
        mem_n.push_back(pn->mib_per_m_records());
        if (s.shared_new) {
          new_reads_per.push_back(double(pn->r.dev.reads) / s.shared_new);
          new_dev_us.push_back(1e6 * pn->r.dev.device_seconds() / s.shared_new);
          new_cpu_us.push_back(1e6 * pn->r.cpu_s / s.shared_new);
        }
        jr["new_shared"] = pn->ToJson();
        if (s.shared_new != a.blocks) {
          std::printf("  note: %" PRIu64 " new shared blocks, expected %" PRIu64 "\n",
                      s.shared_new, a.blocks);
        }
      }
      // Shared -> shared: a third copy.
      {
        auto wc = WriteMonitoredFile(env.vol.get(), "copy-c", a.blocks, 2);
        if (!wc.ok()) return Fail(wc.status());
        std::printf("  wrote 'copy-c' (%" PRIu64 " MiB, monitored) in %.2f s\n",
                    file_bytes / kMiB, *wc);
      }
      auto ph = RunPassInChild(&env, DedupOptions{});
      if (!ph.ok()) return Fail(ph.status());
      PrintPass("shared->shared (3rd copy)", rep, *ph);
      {
        const DedupStats& s = ph->r.stats;
        hit_mbps.push_back(s.shared_hits * double(kBlockSize) / ph->r.wall_s / 1e6);
        mem_h.push_back(ph->mib_per_m_records());
        if (s.shared_hits) {
          hit_reads_per.push_back(double(ph->r.dev.reads) / s.shared_hits);
          hit_dev_us.push_back(1e6 * ph->r.dev.device_seconds() / s.shared_hits);
          hit_cpu_us.push_back(1e6 * ph->r.cpu_s / s.shared_hits);
        }
        jr["shared_hits"] = ph->ToJson();
      }
      // The device's random 4 KiB read rate right after the passes.
      {
        auto rr = ReadFileRandom(env.vol.get(), "copy-a", 2.0);
        if (!rr.ok()) return Fail(rr.status());
        rand_iops.push_back(rr->entries_per_s());
        rand_cpu_us.push_back(1e6 * rr->cpu / double(rr->entries));
        std::printf("  random 4K File::Read (QD1) of 'copy-a': %.0f IOPS, %.0f us each, "
                    "%.0f us CPU each\n",
                    rr->entries_per_s(), 1e6 / rr->entries_per_s(), rand_cpu_us.back());
        jr["random_4k_read_iops"] = rr->entries_per_s();
        jr["random_4k_read_cpu_us"] = rand_cpu_us.back();
      }
      reps.push_back(jr);
    }
    env.vol.reset();
    const double nm = Median(new_mbps);
    out["passes"] = {{"blocks_per_file", a.blocks},
                     {"reps", reps},
                     {"unique_only_records_per_s", Median(uniq_rps)},
                     {"unique_only_mb_per_s", Median(uniq_mbps)},
                     {"new_shared_mb_per_s", nm},
                     {"new_shared_target_mb_per_s", kShareTargetMBps},
                     {"new_shared_target_met", nm >= kShareTargetMBps},
                     {"dede_prototype_mb_per_s", kDedeSharedMBps},
                     {"shared_hit_mb_per_s", Median(hit_mbps)},
                     {"random_4k_read_iops", Median(rand_iops)},
                     {"random_4k_read_cpu_us", Median(rand_cpu_us)},
                     {"new_shared_cpu_us_per_block", Median(new_cpu_us)},
                     {"shared_hit_cpu_us_per_block", Median(hit_cpu_us)},
                     {"new_shared_device_reads_per_block", Median(new_reads_per)},
                     {"new_shared_device_us_per_block", Median(new_dev_us)},
                     {"shared_hit_device_reads_per_block", Median(hit_reads_per)},
                     {"shared_hit_device_us_per_block", Median(hit_dev_us)},
                     {"memory_mib_per_million_records",
                      {{"unique_only", Median(mem_u)},
                       {"new_shared", Median(mem_n)},
                       {"shared_hits", Median(mem_h)}}}};
    std::snprintf(buf, sizeof buf, "%.1f MB/s (%.0f blocks/s; reps %s)  target >= %.0f: %s; "
                  "DeDe %.1f",
                  nm, nm * 1e6 / kBlockSize, List(new_mbps, "%.1f").c_str(), kShareTargetMBps,
                  nm >= kShareTargetMBps ? "met" : "MISSED", kDedeSharedMBps);
    row("2. new shared blocks (unique->shared), " + std::to_string(a.blocks) + " blocks", buf);
    std::snprintf(buf, sizeof buf, "%.1f MB/s (%.0f blocks/s; reps %s)", Median(hit_mbps),
                  Median(hit_mbps) * 1e6 / kBlockSize, List(hit_mbps, "%.1f").c_str());
    row("   shared->shared (3rd copy)", buf);
    std::snprintf(buf, sizeof buf,
                  "new: %.2f reads, %.0f us in device, %.0f us CPU; hit: %.2f reads, %.0f us, "
                  "%.0f us CPU",
                  Median(new_reads_per), Median(new_dev_us), Median(new_cpu_us),
                  Median(hit_reads_per), Median(hit_dev_us), Median(hit_cpu_us));
    row("   device work per shared block", buf);
    std::snprintf(buf, sizeof buf,
                  "%.0f IOPS (%.0f us each, %.0f us CPU) -> %.1f MB/s at 3 reads/block",
                  Median(rand_iops), 1e6 / Median(rand_iops), Median(rand_cpu_us),
                  Median(rand_iops) / 3 * 4096 / 1e6);
    row("   random 4K File::Read QD1, same run", buf);
    std::snprintf(buf, sizeof buf, "%.0f records/s = %.1f MB/s logical (reps %s)",
                  Median(uniq_rps), Median(uniq_mbps), List(uniq_rps, "%.0f").c_str());
    row("3. unique-only records", buf);
    std::snprintf(buf, sizeof buf, "unique-only %.1f, new-shared %.1f, shared-hit %.1f",
                  Median(mem_u), Median(mem_n), Median(mem_h));
    row("4. peak pass memory, MiB per million records", buf);
  }

  // ---- summary
  std::printf("\n%-62s %s\n", "figure (median of reps)", "result");
  for (const auto& [label, value] : table) std::printf("%-62s %s\n", label.c_str(), value.c_str());
  std::fflush(stdout);

  if (!a.json_path.empty()) {
    std::ofstream f(a.json_path);
    f << out.dump(2) << "\n";
    if (!f) return Fail(Status::IoError("cannot write " + a.json_path));
  }
  return kExitOk;
}

}  // namespace
}  // namespace dede::bench

int main(int argc, char** argv) {
  try {
    return dede::bench::Main(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "dede-bench-index: " << e.what() << std::endl;
    return 1;
  }
}
