// dede_ratecap_bench: does the dedup rate cap hold? (issue 6;
// docs/BENCHMARKS.md, "Dedup rate cap (issue 6)").
//
// One path-backed volume in a sparse file under --dir (O_DIRECT when the
// file system allows it, as dedupd opens its device). Before every run the
// scene is rebuilt from scratch on it: the volume is reformatted and
// --files files of --mib MiB are written with File::Write in 1 MiB requests
// through a WriteMonitor whose batches go to the files' write logs
// (AppendToWriteLog, as `dede import` does). File 1 is random; files
// 2..N repeat its content. The volume is synced, closed and reopened, so
// every run's pass starts from the same state and does the same work.
//
// Then one dedup pass, set up as dedupd sets it up (agent/dedupd_main.cc):
// an IoThrottle at the run's cap as DedupOptions::io_budget, its Settle as
// settle_io, batch_ops = IoThrottle::BatchOpsFor(cap). The first run is
// unlimited (its rate is the pass's natural rate on this machine), then
// one run per --rates cap, the whole sequence --reps times.
//
// The honest measure is not the throttle's own counter: the device under
// the volume is wrapped in a counting BlockDevice that counts every byte
// read and written by ANY thread, and separately the bytes issued by a
// thread that charges no budget (CurrentIoBudget() == nullptr), which the
// cap cannot see. A sampler thread reads the counters every 20 ms, giving
// the lowest and highest rate over any 1 s stretch of the pass.
//
//   achieved MB/s = device bytes read + written during RunDedupPass
//                   / wall seconds of RunDedupPass       (MB = 10^6 bytes)
//
// Target: every capped run's achieved rate within +-10% (--tolerance) of
// its cap. A cap at or above the unlimited run's rate cannot be reached
// and is reported as not meaningful instead (not counted).
//
// Exit status: 0 every meaningful cap within the tolerance, 3 a cap missed
// it, 1 operational error, 2 usage error.
#include <fcntl.h>
#include <sys/statfs.h>
#include <sys/sysinfo.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/program_options.hpp>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agent/dedup_pass.h"
#include "agent/io_throttle.h"
#include "kmod/writemon/write_log.h"
#include "kmod/writemon/write_monitor.h"
#include "tools/bench/bench_env.h"
#include "tools/bench/bench_util.h"
#include "util/io_budget.h"
#include "volume/block_device.h"
#include "volume/volume.h"

namespace dede::bench {
namespace {

namespace po = boost::program_options;
using json = nlohmann::json;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitTargetMissed = 3;

constexpr uint64_t kMiB = 1ull << 20;
constexpr double kMB = 1e6;         // rates are quoted in MB/s (dede policy rate=)
constexpr size_t kChunk = 1 << 20;  // write request
constexpr double kSampleS = 0.020;  // sampler period
constexpr double kWindowS = 1.0;    // stretch for the lowest / highest rate

double Now() {
  return ClockSeconds(CLOCK_MONOTONIC);
}

// ------------------------------------------------------------ device

// Counts every command below the volume, from every thread (atomics: the
// pass's shard read-ahead issues I/O from a helper thread). Bytes issued
// by a thread without an I/O budget are counted apart: the cap never sees
// them.
class CountingDevice : public BlockDevice {
 public:
  explicit CountingDevice(BlockDevice* d) : d_(d) {}
  uint64_t size_bytes() const override { return d_->size_bytes(); }
  Status Read(uint64_t off, void* buf, size_t len) override {
    reads_++;
    read_bytes_ += len;
    if (CurrentIoBudget() == nullptr) unbudgeted_bytes_ += len;
    return d_->Read(off, buf, len);
  }
  Status Write(uint64_t off, const void* buf, size_t len) override {
    writes_++;
    write_bytes_ += len;
    if (CurrentIoBudget() == nullptr) unbudgeted_bytes_ += len;
    return d_->Write(off, buf, len);
  }
  Status Flush() override {
    flushes_++;
    return d_->Flush();
  }
  Status Discard(uint64_t off, uint64_t len) override {
    discards_++;
    discard_bytes_ += len;
    return d_->Discard(off, len);
  }
  std::string name() const override { return d_->name(); }
  std::string local_lock_path() const override { return d_->local_lock_path(); }

  struct Counts {
    uint64_t reads = 0, writes = 0, flushes = 0, discards = 0;
    uint64_t read_bytes = 0, write_bytes = 0, discard_bytes = 0, unbudgeted_bytes = 0;
    uint64_t bytes() const { return read_bytes + write_bytes; }
    Counts operator-(const Counts& o) const {
      Counts c;
      c.reads = reads - o.reads;
      c.writes = writes - o.writes;
      c.flushes = flushes - o.flushes;
      c.discards = discards - o.discards;
      c.read_bytes = read_bytes - o.read_bytes;
      c.write_bytes = write_bytes - o.write_bytes;
      c.discard_bytes = discard_bytes - o.discard_bytes;
      c.unbudgeted_bytes = unbudgeted_bytes - o.unbudgeted_bytes;
      return c;
    }
    json ToJson() const {
      return json{{"reads", reads},
                  {"writes", writes},
                  {"flushes", flushes},
                  {"discards", discards},
                  {"read_bytes", read_bytes},
                  {"write_bytes", write_bytes},
                  {"discard_bytes", discard_bytes},
                  {"unbudgeted_bytes", unbudgeted_bytes}};
    }
  };
  Counts counts() const {
    Counts c;
    c.reads = reads_.load();
    c.writes = writes_.load();
    c.flushes = flushes_.load();
    c.discards = discards_.load();
    c.read_bytes = read_bytes_.load();
    c.write_bytes = write_bytes_.load();
    c.discard_bytes = discard_bytes_.load();
    c.unbudgeted_bytes = unbudgeted_bytes_.load();
    return c;
  }
  uint64_t bytes() const { return read_bytes_.load() + write_bytes_.load(); }

 private:
  BlockDevice* d_;
  std::atomic<uint64_t> reads_{0}, writes_{0}, flushes_{0}, discards_{0};
  std::atomic<uint64_t> read_bytes_{0}, write_bytes_{0}, discard_bytes_{0}, unbudgeted_bytes_{0};
};

// Reads the device's byte counter every kSampleS until stopped.
class Sampler {
 public:
  explicit Sampler(const CountingDevice* dev) : dev_(dev) {
    Take();
    thread_ = std::thread([this] {
      std::unique_lock<std::mutex> l(mu_);
      while (!stop_) {
        cv_.wait_for(l, std::chrono::duration<double>(kSampleS));
        if (stop_) break;
        l.unlock();
        Take();
        l.lock();
      }
    });
  }
  ~Sampler() { Stop(); }
  // Stops the thread and takes a last sample.
  void Stop() {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (stop_) return;
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    Take();
  }
  // (seconds since t0, device bytes since the first sample), after Stop().
  std::vector<std::pair<double, uint64_t>> Samples(double t0) const {
    std::vector<std::pair<double, uint64_t>> v;
    for (size_t i = 0; i < t_.size(); i++) v.emplace_back(t_[i] - t0, b_[i] - b_[0]);
    return v;
  }
  // Lowest and highest device rate (bytes/s) over any stretch of at least
  // kWindowS between two samples; {0, 0} if the run was shorter.
  std::pair<double, double> WindowRates() const {
    double lo = 0, hi = 0;
    bool any = false;
    size_t j = 0;
    for (size_t i = 0; i < t_.size(); i++) {
      if (j < i) j = i;
      while (j < t_.size() && t_[j] - t_[i] < kWindowS) j++;
      if (j >= t_.size()) break;
      const double r = double(b_[j] - b_[i]) / (t_[j] - t_[i]);
      lo = any ? std::min(lo, r) : r;
      hi = any ? std::max(hi, r) : r;
      any = true;
    }
    return {lo, hi};
  }

 private:
  void Take() {
    t_.push_back(Now());
    b_.push_back(dev_->bytes());
  }
  const CountingDevice* dev_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
  // Written by the sampler thread only, read after Stop().
  std::vector<double> t_;
  std::vector<uint64_t> b_;
};

// ------------------------------------------------------------ scene

// Writes blocks [0, n) of content set `set` into a new file `name` of n
// blocks with File::Write in 1 MiB requests, through a WriteMonitor whose
// batch is appended to the file's write log at the end (as `dede import`
// does; n <= 64 Ki blocks stays under its 256 MiB flush step).
Status WriteMonitoredFile(Volume* vol, const std::string& name, uint64_t n, uint64_t set,
                          uint8_t* buf) {
  ASSIGN_OR_RETURN(FileId fid, vol->Create(name, n * kBlockSize));
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, vol->OpenFile(name));
  WriteMonitorOptions mo;
  mo.algo = vol->superblock().hash_algo;
  mo.memory_cap_bytes = size_t{256} << 20;
  WriteMonitor monitor(mo);
  monitor.AddFile(fid, true);
  const uint64_t per = kChunk / kBlockSize;
  for (uint64_t b = 0; b < n; b += per) {
    const uint64_t k = std::min(per, n - b);
    for (uint64_t j = 0; j < k; j++) FillBlock(buf + j * kBlockSize, set, b + j);
    RETURN_IF_ERROR(f->Write(b * kBlockSize, buf, k * kBlockSize));
    monitor.OnWrite(fid, b * kBlockSize, buf, k * kBlockSize);
  }
  MonitorBatch batch = monitor.Take(fid);
  if (batch.dropped_records != 0) {
    return Status::IoError(name + ": the write monitor shed " +
                           std::to_string(batch.dropped_records) + " records");
  }
  RETURN_IF_ERROR(AppendToWriteLog(vol, batch));
  f.reset();
  return Status::Ok();
}

// Reformats the device and writes the scene: `files` files of `blocks`
// blocks, all with content set 1. Returns seconds.
Result<double> BuildScene(BlockDevice* dev, int files, uint64_t blocks) {
  const double t0 = Now();
  RETURN_IF_ERROR(FormatVolume(dev, FormatOptions{}, /*force=*/true));
  ASSIGN_OR_RETURN(std::unique_ptr<Volume> vol, Volume::Open(dev, OpenOptions{}));
  AlignedBuf buf = NewAligned(kChunk);
  for (int i = 1; i <= files; i++) {
    RETURN_IF_ERROR(WriteMonitoredFile(vol.get(), "vm-" + std::to_string(i), blocks, 1, buf.get()));
  }
  RETURN_IF_ERROR(vol->Sync());
  vol.reset();
  RETURN_IF_ERROR(dev->Flush());
  return Now() - t0;
}

// ------------------------------------------------------------ one run

// What the pass's settle points saw (called on the pass thread only).
struct SettleTrace {
  double last_end = 0;  // when the previous settle returned
  uint64_t last_charged = 0;
  uint64_t settles = 0;
  uint64_t max_debt = 0;  // largest charge between two settle points
  double max_debt_at = 0;
  double max_gap = 0;  // longest time between two settle points
  double max_gap_at = 0;
  uint64_t max_gap_bytes = 0;
  std::vector<std::pair<double, uint64_t>> points;  // (time, debt) of every settle
  void Note(double t, uint64_t charged) {
    const uint64_t debt = charged - last_charged;
    last_charged = charged;
    settles++;
    points.emplace_back(t, debt);
    if (debt > max_debt) {
      max_debt = debt;
      max_debt_at = t;
    }
    if (t - last_end > max_gap) {
      max_gap = t - last_end;
      max_gap_at = t;
      max_gap_bytes = debt;
    }
  }
};

struct Run {
  int rep = 0;
  uint64_t cap = 0;  // bytes/s; 0 = unlimited
  size_t batch_ops = 0;
  double build_s = 0;
  double seconds = 0;  // RunDedupPass wall time
  CountingDevice::Counts dev;
  uint64_t close_bytes = 0;     // device bytes while the files and volume closed (not in the pass)
  uint64_t charged = 0;         // the throttle's own count
  double waited_s = 0;          // the throttle's sleeps
  double lo_1s = 0, hi_1s = 0;  // bytes/s over the slowest / fastest 1 s stretch
  DedupStats stats;
  uint64_t settles = 0;    // settle_io calls (+1 for the tail)
  uint64_t max_debt = 0;   // bytes charged between two settle points, at most
  double max_debt_at = 0;  // seconds into the pass
  double max_gap_s = 0;    // seconds between two settle points, at most
  double max_gap_at = 0;
  uint64_t max_gap_bytes = 0;                        // bytes charged in that gap
  std::vector<std::pair<double, uint64_t>> trace;    // settle (seconds into the pass, debt)
  std::vector<std::pair<double, uint64_t>> samples;  // (seconds into the pass, device bytes)

  double rate() const { return seconds > 0 ? double(dev.bytes()) / seconds : 0; }
  double ratio() const { return cap ? rate() / double(cap) : 0; }
};

Result<Run> RunOnce(CountingDevice* dev, int files, uint64_t blocks, uint64_t cap, int rep) {
  Run run;
  run.rep = rep;
  run.cap = cap;
  ASSIGN_OR_RETURN(run.build_s, BuildScene(dev, files, blocks));
  // A fresh process's view, as `dede dedup` or a restarted dedupd: the
  // volume is opened anew (its caches empty; O_DIRECT: no page cache).
  ASSIGN_OR_RETURN(std::unique_ptr<Volume> vol, Volume::Open(dev, OpenOptions{}));
  IoThrottle throttle(cap);
  DedupOptions o;
  o.io_budget = &throttle;
  // Each settle point: the bytes charged since the previous one (the debt
  // it pays) and the time since the previous one ended (a stretch the cap
  // cannot act in).
  SettleTrace trace;
  o.settle_io = [&](const std::function<void()>& between) {
    const double t = Now();
    const uint64_t charged = throttle.bytes();
    trace.Note(t, charged);
    throttle.Settle(between);
    trace.last_end = Now();
  };
  o.batch_ops = IoThrottle::BatchOpsFor(cap, o.batch_ops);
  run.batch_ops = o.batch_ops;
  auto access = std::make_unique<VolumeFileAccess>(vol.get());
  const CountingDevice::Counts c0 = dev->counts();
  Sampler sampler(dev);
  const double t0 = Now();
  trace.last_end = t0;
  Result<DedupStats> st = RunDedupPass(vol.get(), access.get(), o);
  run.seconds = Now() - t0;
  sampler.Stop();
  const CountingDevice::Counts c1 = dev->counts();
  run.dev = c1 - c0;
  run.charged = throttle.bytes();
  trace.Note(t0 + run.seconds, run.charged);  // the tail after the last settle point
  run.settles = trace.settles;
  run.max_debt = trace.max_debt;
  run.max_debt_at = trace.max_debt_at > 0 ? trace.max_debt_at - t0 : 0;
  run.max_gap_s = trace.max_gap;
  run.max_gap_at = trace.max_gap_at > 0 ? trace.max_gap_at - t0 : 0;
  run.max_gap_bytes = trace.max_gap_bytes;
  run.trace = std::move(trace.points);
  for (auto& p : run.trace) p.first -= t0;
  run.samples = sampler.Samples(t0);
  run.waited_s = double(throttle.waited_ns()) / 1e9;
  std::tie(run.lo_1s, run.hi_1s) = sampler.WindowRates();
  access.reset();
  vol.reset();
  run.close_bytes = dev->bytes() - c1.bytes();
  if (!st.ok()) return st.status().WithContext("dedup pass");
  run.stats = *st;
  return run;
}

// ------------------------------------------------------------ main

struct Args {
  std::string dir = "/var/tmp";
  int files = 4;
  uint64_t mib = 64;
  std::string rates = "10,25,50";
  int reps = 1;
  double tolerance = 0.10;
  std::string json_path;
  std::string trace_path;
};

int Usage(const std::string& msg, const po::options_description& desc) {
  std::cerr << "dede_ratecap_bench: " << msg << "\n"
            << "usage: dede_ratecap_bench [options]\n"
            << desc;
  return kExitUsage;
}

int Fail(const Status& st) {
  std::cerr << "dede_ratecap_bench: " << st.ToString() << std::endl;
  return kExitError;
}

// "10,25,12.5" MB/s -> bytes/s; empty on a bad list.
std::vector<uint64_t> ParseRates(const std::string& s, bool* ok) {
  std::vector<uint64_t> out;
  *ok = true;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || end == nullptr || *end != '\0' || !(v > 0) || v > 1e6) {
      *ok = false;
      return {};
    }
    out.push_back(uint64_t(std::llround(v * kMB)));
  }
  if (out.empty()) *ok = false;
  return out;
}

std::string CapText(uint64_t cap) {
  if (cap == 0) return "unlimited";
  char b[32];
  std::snprintf(b, sizeof b, "%g MB/s", double(cap) / kMB);
  return b;
}

int Main(int argc, char** argv) {
  Args a;
  po::options_description desc("options");
  desc.add_options()("help,h", "show this help and exit")(
      "dir", po::value<std::string>(&a.dir)->default_value(a.dir),
      "directory for the sparse device file (disk-backed; not tmpfs)")(
      "files", po::value<int>(&a.files)->default_value(a.files),
      "files in the scene: file 1 random, files 2..N the same content")(
      "mib", po::value<uint64_t>(&a.mib)->default_value(a.mib), "MiB per file")(
      "rates", po::value<std::string>(&a.rates)->default_value(a.rates),
      "caps to run, MB/s (10^6 bytes), comma-separated; an unlimited run always comes first")(
      "reps", po::value<int>(&a.reps)->default_value(a.reps),
      "repetitions of the whole sequence (unlimited, then each cap)")(
      "tolerance", po::value<double>(&a.tolerance)->default_value(a.tolerance),
      "target: achieved rate within this fraction of the cap")(
      "json", po::value<std::string>(&a.json_path), "also write the results as JSON to FILE")(
      "trace", po::value<std::string>(&a.trace_path),
      "write every run's device-byte samples (20 ms) and settle points as JSON to FILE");
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
    std::cout << "usage: dede_ratecap_bench [options]\n\n"
                 "Runs the same dedup pass (--files files of --mib MiB, files 2..N copies of file\n"
                 "1, written through the write monitor) unlimited and under each cap of --rates,\n"
                 "on a path-backed volume in a sparse file under --dir (O_DIRECT; removed at the\n"
                 "end). The scene is rebuilt before every pass. Counts the device bytes of ALL\n"
                 "threads below the volume and reports achieved MB/s = bytes / pass seconds\n"
                 "against the cap. Exit status 3 if a cap below the unlimited rate is missed by\n"
                 "more than --tolerance.\n\n"
              << desc;
    return kExitOk;
  }
  bool rates_ok = false;
  const std::vector<uint64_t> caps = ParseRates(a.rates, &rates_ok);
  if (!rates_ok) return Usage("--rates: comma-separated MB/s values > 0, e.g. 10,25,50", desc);
  if (a.files < 2 || a.files > 64) return Usage("--files must be 2..64", desc);
  if (a.mib < 1 || a.mib > 256) return Usage("--mib must be 1..256", desc);
  if (a.reps < 1 || a.reps > 20) return Usage("--reps must be 1..20", desc);
  if (!(a.tolerance > 0 && a.tolerance < 1)) return Usage("--tolerance must be in (0, 1)", desc);

  const uint64_t blocks = a.mib * kMiB / kBlockSize;
  const uint64_t data = uint64_t(a.files) * a.mib * kMiB;
  // Data, logs (~1/64 of the data), index and fixed metadata. At least
  // 1.25 GiB: below 1 GiB the volume gets a 256-block journal instead of
  // 1,024 and commits far more often (as in dede-bench-index).
  const uint64_t dev_bytes =
      std::max<uint64_t>(1280 * kMiB, (data + data / 8 + 192 * kMiB + kMiB - 1) / kMiB * kMiB);

  // ---- device
  auto scratch = ScratchFile::Create(a.dir + "/dede-ratecap-bench.XXXXXX", dev_bytes);
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
  out["device"] = {
      {"path", path}, {"bytes", dev_bytes}, {"o_direct", direct}, {"file_system", fs_type}};
  json jcaps = json::array();
  for (uint64_t c : caps) jcaps.push_back(double(c) / kMB);
  out["args"] = {{"files", a.files},
                 {"mib", a.mib},
                 {"rates_mb_per_s", jcaps},
                 {"reps", a.reps},
                 {"tolerance", a.tolerance}};
  std::printf("device   %s (%" PRIu64 " MiB sparse file, %s, %s)\n", path.c_str(), dev_bytes / kMiB,
              fs_type.c_str(),
              direct ? "O_DIRECT" : "buffered: O_DIRECT refused -- numbers measure the page cache");
  std::printf("scene    %d files x %" PRIu64 " MiB (%" PRIu64
              " blocks each; files 2..%d copy file 1), rebuilt before every pass\n",
              a.files, a.mib, blocks, a.files);
  std::printf("runs     unlimited, then caps %s MB/s; reps %d; target: within %g%% of the cap\n",
              a.rates.c_str(), a.reps, 100 * a.tolerance);
  std::fflush(stdout);

  // ---- precondition: write the whole device once, so no pass pays the
  // host file system's first-allocation cost.
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

  // ---- runs
  std::vector<Run> runs;
  std::vector<double> natural;  // unlimited runs' bytes/s
  auto print = [&](const Run& r) {
    const CountingDevice::Counts& d = r.dev;
    std::printf("rep %d  %-10s %8.1f MB in %6.2f s = %7.2f MB/s", r.rep + 1, CapText(r.cap).c_str(),
                double(d.bytes()) / kMB, r.seconds, r.rate() / kMB);
    if (r.cap) std::printf(" = %.3fx cap", r.ratio());
    std::printf(" | read %.1f MB (%" PRIu64 " reads) write %.1f MB (%" PRIu64 " writes) %" PRIu64
                " flushes, unbudgeted %.2f MB | throttle charged %.1f MB, waited %.2f s"
                " | 1 s stretches %.1f-%.1f MB/s | %" PRIu64
                " settles, largest debt %.2f MB"
                " at %.2f s, longest gap %.3f s at %.2f s (%.2f MB)"
                " | batch_ops %zu | shared new %" PRIu64 " hits %" PRIu64 " unique %" PRIu64
                " | scene %.1f s\n",
                double(d.read_bytes) / kMB, d.reads, double(d.write_bytes) / kMB, d.writes,
                d.flushes, double(d.unbudgeted_bytes) / kMB, double(r.charged) / kMB, r.waited_s,
                r.lo_1s / kMB, r.hi_1s / kMB, r.settles, double(r.max_debt) / kMB, r.max_debt_at,
                r.max_gap_s, r.max_gap_at, double(r.max_gap_bytes) / kMB, r.batch_ops,
                r.stats.shared_new, r.stats.shared_hits, r.stats.unique_added, r.build_s);
    std::fflush(stdout);
  };
  for (int rep = 0; rep < a.reps; rep++) {
    std::vector<uint64_t> seq{0};
    seq.insert(seq.end(), caps.begin(), caps.end());
    for (uint64_t cap : seq) {
      auto r = RunOnce(&dev, a.files, blocks, cap, rep);
      if (!r.ok()) return Fail(r.status());
      print(*r);
      if (cap == 0) natural.push_back(r->rate());
      runs.push_back(*r);
    }
  }
  const double natural_rate = Median(natural);

  // ---- summary
  bool all_met = true;
  int meaningful = 0, met = 0;
  json jruns = json::array();
  json traces = json::array();
  std::printf("\nunlimited (natural) rate: %.1f MB/s (median of %zu)\n", natural_rate / kMB,
              natural.size());
  std::printf("%-4s %-10s %10s %9s %9s %7s %10s %9s %11s %13s  %s\n", "rep", "cap", "device MB",
              "seconds", "MB/s", "x cap", "charged MB", "waited s", "unbudg. MB", "1 s min-max",
              "target");
  for (const Run& r : runs) {
    std::string verdict = "-";
    bool counted = false, ok = true;
    if (r.cap) {
      if (double(r.cap) >= natural_rate) {
        verdict = "n/a: cap >= unlimited rate";
      } else {
        counted = true;
        meaningful++;
        ok = std::fabs(r.ratio() - 1) <= a.tolerance;
        if (ok) met++;
        all_met = all_met && ok;
        verdict = ok ? "met" : "MISSED";
      }
    }
    char ratio[16] = "-";
    if (r.cap) std::snprintf(ratio, sizeof ratio, "%.3f", r.ratio());
    char win[32] = "-";
    if (r.hi_1s > 0) std::snprintf(win, sizeof win, "%.1f-%.1f", r.lo_1s / kMB, r.hi_1s / kMB);
    std::printf("%-4d %-10s %10.1f %9.2f %9.2f %7s %10.1f %9.2f %11.2f %13s  %s\n", r.rep + 1,
                CapText(r.cap).c_str(), double(r.dev.bytes()) / kMB, r.seconds, r.rate() / kMB,
                ratio, double(r.charged) / kMB, r.waited_s, double(r.dev.unbudgeted_bytes) / kMB,
                win, verdict.c_str());
    json j;
    j["rep"] = r.rep + 1;
    j["cap_mb_per_s"] = double(r.cap) / kMB;
    j["batch_ops"] = r.batch_ops;
    j["scene_seconds"] = r.build_s;
    j["seconds"] = r.seconds;
    j["device"] = r.dev.ToJson();
    j["device_bytes"] = r.dev.bytes();
    j["achieved_mb_per_s"] = r.rate() / kMB;
    if (r.cap) j["ratio_to_cap"] = r.ratio();
    j["throttle_charged_bytes"] = r.charged;
    j["throttle_waited_seconds"] = r.waited_s;
    j["slowest_1s_mb_per_s"] = r.lo_1s / kMB;
    j["fastest_1s_mb_per_s"] = r.hi_1s / kMB;
    j["bytes_after_pass_closing"] = r.close_bytes;
    j["settle_points"] = r.settles;
    j["largest_debt_bytes"] = r.max_debt;
    j["largest_debt_at_seconds"] = r.max_debt_at;
    j["longest_settle_gap_seconds"] = r.max_gap_s;
    j["longest_settle_gap_at_seconds"] = r.max_gap_at;
    j["longest_settle_gap_bytes"] = r.max_gap_bytes;
    if (!a.trace_path.empty()) {
      json jt;
      jt["rep"] = r.rep + 1;
      jt["cap_mb_per_s"] = double(r.cap) / kMB;
      jt["device_samples"] = r.samples;  // [seconds into the pass, device bytes]
      jt["settles"] = r.trace;           // [seconds into the pass, debt bytes paid]
      traces.push_back(jt);
    }
    j["target"] = r.cap == 0 ? "unlimited" : (counted ? (ok ? "met" : "missed") : "not meaningful");
    j["stats"] = {{"log_records", r.stats.log_records},
                  {"unique_added", r.stats.unique_added},
                  {"shared_new", r.stats.shared_new},
                  {"shared_hits", r.stats.shared_hits},
                  {"already_shared", r.stats.already_shared},
                  {"stale_records", r.stats.stale_records},
                  {"shards_rewritten", r.stats.shards_rewritten},
                  {"index_bytes_read", r.stats.index_bytes_read},
                  {"index_bytes_written", r.stats.index_bytes_written},
                  {"gather_seconds", r.stats.gather_ns / 1e9},
                  {"merge_seconds", r.stats.merge_ns / 1e9}};
    jruns.push_back(j);
  }
  std::printf("target (within %g%% of the cap): %d of %d meaningful capped runs met%s\n",
              100 * a.tolerance, met, meaningful, all_met ? "" : " -- MISSED");
  std::fflush(stdout);

  out["runs"] = jruns;
  out["natural_mb_per_s"] = natural_rate / kMB;
  out["meaningful_capped_runs"] = meaningful;
  out["capped_runs_met"] = met;
  out["target_met"] = all_met;
  double load[3];
  if (::getloadavg(load, 3) == 3) out["machine"]["loadavg_at_end"] = {load[0], load[1], load[2]};
  if (!a.json_path.empty()) {
    std::ofstream f(a.json_path);
    f << out.dump(2) << "\n";
    if (!f) return Fail(Status::IoError("cannot write " + a.json_path));
  }
  if (!a.trace_path.empty()) {
    std::ofstream f(a.trace_path);
    f << traces.dump() << "\n";
    if (!f) return Fail(Status::IoError("cannot write " + a.trace_path));
  }
  return all_met ? kExitOk : kExitTargetMissed;
}

}  // namespace
}  // namespace dede::bench

int main(int argc, char** argv) {
  try {
    return dede::bench::Main(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "dede_ratecap_bench: " << e.what() << std::endl;
    return 1;
  }
}
