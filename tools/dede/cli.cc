#include "tools/dede/cli.h"

#include <linux/fs.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <new>

namespace po = boost::program_options;

namespace dede::cli {
namespace {

// The hidden option that collects positional arguments.
constexpr const char* kPositionalKey = "dede-positional";

std::string OneLine(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

void PrintUsageLine(std::ostream& out, const Command& cmd) {
  out << "usage: dede " << cmd.name;
  if (cmd.synopsis[0] != '\0') out << ' ' << cmd.synopsis;
  out << '\n';
}

}  // namespace

// ---------------------------------------------------------------- errors

int Fail(const Command& cmd, const std::string& message) {
  std::cerr << "dede: " << cmd.name << ": " << OneLine(message) << std::endl;
  return kExitFailure;
}

int Fail(const Command& cmd, const Status& st) {
  return Fail(cmd, st.message().empty() ? std::string(st.CodeName()) : st.message());
}

int UsageError(const Command& cmd, const std::string& message) {
  std::cerr << "dede: " << cmd.name << ": " << OneLine(message) << '\n';
  PrintUsageLine(std::cerr, cmd);
  std::cerr << "Try 'dede " << cmd.name << " --help' for more information." << std::endl;
  return kExitUsage;
}

// ---------------------------------------------------------------- parsing

ArgParser::ArgParser(const Command& cmd) : cmd_(cmd), options_("Options", 100, 50) {
  options_.add_options()("help,h", po::bool_switch(), "show this help and exit");
}

void ArgParser::AddPositional(const std::string& name, const std::string& help) {
  positional_names_.emplace_back(name, help);
}

std::optional<int> ArgParser::Parse(const std::vector<std::string>& args) {
  po::options_description hidden;
  hidden.add_options()(kPositionalKey, po::value<std::vector<std::string>>());
  po::options_description all;
  all.add(options_).add(hidden);
  po::positional_options_description positional;
  positional.add(kPositionalKey, -1);
  // No abbreviated option names: a typo must not silently pick an option.
  const int style = po::command_line_style::default_style & ~po::command_line_style::allow_guessing;
  try {
    po::store(po::command_line_parser(args).options(all).positional(positional).style(style).run(),
              vm_);
    po::notify(vm_);
  } catch (const po::error& e) {
    return UsageError(cmd_, e.what());
  }
  if (flag("help")) {
    PrintHelp();
    return kExitOk;
  }
  if (vm_.count(kPositionalKey)) {
    positional_values_ = vm_[kPositionalKey].as<std::vector<std::string>>();
  }
  if (positional_values_.size() < positional_names_.size()) {
    return UsageError(cmd_, "missing " + positional_names_[positional_values_.size()].first);
  }
  if (positional_values_.size() > positional_names_.size()) {
    return UsageError(cmd_,
                      "unexpected argument '" + positional_values_[positional_names_.size()] + "'");
  }
  for (size_t i = 0; i < positional_values_.size(); i++) {
    if (positional_values_[i].empty()) {
      return UsageError(cmd_, positional_names_[i].first + " must not be empty");
    }
  }
  return std::nullopt;
}

bool ArgParser::flag(const std::string& name) const {
  auto it = vm_.find(name);
  if (it == vm_.end() || it->second.empty()) return false;
  const bool* b = boost::any_cast<bool>(&it->second.value());
  return b != nullptr && *b;
}

std::optional<std::string> ArgParser::value(const std::string& name) const {
  auto it = vm_.find(name);
  if (it == vm_.end() || it->second.empty()) return std::nullopt;
  const std::string* s = boost::any_cast<std::string>(&it->second.value());
  if (s == nullptr) return std::nullopt;
  return *s;
}

void ArgParser::PrintHelp() const {
  PrintUsageLine(std::cout, cmd_);
  std::cout << '\n' << cmd_.summary << "\n\n";
  if (!positional_names_.empty()) {
    std::cout << "Arguments:\n";
    for (const auto& [name, help] : positional_names_) {
      std::string pad = name.size() < 10 ? std::string(10 - name.size(), ' ') : " ";
      std::cout << "  " << name << pad << help << '\n';
    }
    std::cout << '\n';
  }
  std::cout << options_;
  if (!details_.empty()) std::cout << '\n' << details_ << '\n';
}


std::string HumanSize(uint64_t bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes) / 1024;
  size_t unit = 0;
  while (v >= 1024 && unit + 1 < std::size(kUnits)) {
    v /= 1024;
    unit++;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[unit]);
  return buf;
}

std::string Count(uint64_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

std::string HumanDuration(double seconds) {
  char buf[48];
  if (seconds < 10) {
    std::snprintf(buf, sizeof buf, "%.1f s", seconds);
  } else if (seconds < 60) {
    std::snprintf(buf, sizeof buf, "%.0f s", seconds);
  } else if (seconds < 3600) {
    auto s = static_cast<uint64_t>(seconds);
    std::snprintf(buf, sizeof buf, "%llu min %02llu s", static_cast<unsigned long long>(s / 60),
                  static_cast<unsigned long long>(s % 60));
  } else {
    auto s = static_cast<uint64_t>(seconds);
    std::snprintf(buf, sizeof buf, "%llu h %02llu min", static_cast<unsigned long long>(s / 3600),
                  static_cast<unsigned long long>(s / 60 % 60));
  }
  return buf;
}

std::string HumanRate(uint64_t bytes, double seconds) {
  if (seconds <= 0) return "-";
  double mib_s = static_cast<double>(bytes) / seconds / (1024.0 * 1024.0);
  char buf[32];
  std::snprintf(buf, sizeof buf, mib_s >= 10 ? "%.0f MiB/s" : "%.1f MiB/s", mib_s);
  return buf;
}

void PrintJson(const nlohmann::json& j) {
  std::cout << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
}

// ---------------------------------------------------------------- volumes

Result<SanlockOptions> SanlockOptionsFromEnv() {
  SanlockOptions o;
  // A variable that is set must say a number: "1x" or "ten" silently read
  // as 1 or the default would join the lockspace as the wrong host.
  auto number = [](const char* name, uint64_t max, uint32_t* out) -> Status {
    const char* v = std::getenv(name);
    if (v == nullptr) return Status::Ok();
    std::optional<uint64_t> n = ParseUnsigned(v);
    if (!n || *n > max) {
      return Status::Invalid(std::string(name) + "='" + v + "' is not a number in 0-" +
                             std::to_string(max));
    }
    *out = static_cast<uint32_t>(*n);
    return Status::Ok();
  };
  RETURN_IF_ERROR(number("DEDE_HOST_ID", kMaxHosts, &o.host_id));
  if (const char* v = std::getenv("DEDE_LEASE_PATH")) o.lease_path = v;
  RETURN_IF_ERROR(number("DEDE_LEASE_IO_TIMEOUT", kMaxLeaseIoTimeoutS, &o.io_timeout_s));
  return o;
}

std::optional<std::string> ReservedName(const std::string& name) {
  // A name no file can have is a usage error too (it was exit 1, from the
  // volume's Create, after the volume was opened).
  if (Status st = ValidateFileName(name); !st.ok()) return st.message();
  if (name.rfind(".dede-", 0) != 0) return std::nullopt;
  return "'" + name + "': names beginning with .dede- are reserved for dede's own files";
}

std::string IscsiInitiatorFromEnv() {
  const char* v = std::getenv("DEDE_INITIATOR_NAME");
  return v ? v : "";
}

Result<OpenedVolume> OpenVolume(const std::string& spec, bool read_only,
                                bool pass_damaged_journals) {
  OpenOptions opts;
  opts.read_only = read_only;
  opts.pass_damaged_journals = pass_damaged_journals;
  opts.iscsi_initiator_name = IscsiInitiatorFromEnv();
  // Used only when the volume was formatted with --locks sanlock.
  ASSIGN_OR_RETURN(opts.sanlock, SanlockOptionsFromEnv());
  return OpenVolumeSpec(spec, opts);
}

// ---------------------------------------------------------------- progress

Progress::Progress(std::string verb, uint64_t total_bytes)
    : verb_(std::move(verb)),
      total_(total_bytes),
      enabled_(::isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

double Progress::elapsed_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::Update(uint64_t done_bytes) {
  if (!enabled_) return;
  auto now = std::chrono::steady_clock::now();
  if (drawn_ && now - last_draw_ < std::chrono::milliseconds(100) && done_bytes < total_) return;
  last_draw_ = now;
  Draw(done_bytes);
}

void Progress::Draw(uint64_t done_bytes) {
  double elapsed = elapsed_seconds();
  double fraction =
      total_ == 0 ? 1.0 : static_cast<double>(done_bytes) / static_cast<double>(total_);
  std::string eta = "--";
  if (done_bytes > 0 && elapsed > 0.2) {
    double rate = static_cast<double>(done_bytes) / elapsed;
    eta = HumanDuration(static_cast<double>(total_ - std::min(total_, done_bytes)) / rate);
  }
  constexpr int kBarWidth = 30;
  int filled = static_cast<int>(fraction * kBarWidth);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kBarWidth, '.');
  std::fprintf(stderr, "\r%s [%s] %3d%%  %s / %s  %s  ETA %s\033[K", verb_.c_str(), bar.c_str(),
               static_cast<int>(fraction * 100), HumanSize(done_bytes).c_str(),
               HumanSize(total_).c_str(), HumanRate(done_bytes, elapsed).c_str(), eta.c_str());
  std::fflush(stderr);
  drawn_ = true;
}

void Progress::Finish() {
  if (!drawn_) return;
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
  drawn_ = false;
}

// ---------------------------------------------------------------- buffers

AlignedBuffer::AlignedBuffer(size_t size) : size_(size) {
  constexpr size_t kAlign = 4096;
  data_ = static_cast<uint8_t*>(std::aligned_alloc(kAlign, (size + kAlign - 1) / kAlign * kAlign));
  if (data_ == nullptr) throw std::bad_alloc();
}

AlignedBuffer::~AlignedBuffer() {
  std::free(data_);
}

// ---------------------------------------------------------------- signals

namespace {
// A lock-free atomic may be stored from a signal handler.
std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free);
void OnInterrupt(int) {
  g_interrupted.store(true);
}
struct sigaction g_old_int, g_old_term;
}  // namespace

InterruptGuard::InterruptGuard() {
  g_interrupted.store(false);
  struct sigaction sa {};
  sa.sa_handler = OnInterrupt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  ::sigaction(SIGINT, &sa, &g_old_int);
  ::sigaction(SIGTERM, &sa, &g_old_term);
}

InterruptGuard::~InterruptGuard() {
  ::sigaction(SIGINT, &g_old_int, nullptr);
  ::sigaction(SIGTERM, &g_old_term, nullptr);
}

bool InterruptGuard::interrupted() const {
  return g_interrupted.load();
}

const std::atomic<bool>* InterruptGuard::flag() const {
  return &g_interrupted;
}

Result<uint64_t> SizeOfFd(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::FromErrno("cannot stat " + path, errno);
  if (S_ISREG(st.st_mode)) return static_cast<uint64_t>(st.st_size);
  if (S_ISBLK(st.st_mode)) {
    uint64_t size = 0;
    if (::ioctl(fd, BLKGETSIZE64, &size) != 0) {
      return Status::FromErrno("cannot get the size of " + path, errno);
    }
    return size;
  }
  return Status::Invalid(path + " is neither a regular file nor a block device");
}


}  // namespace dede::cli
