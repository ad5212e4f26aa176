// `dede analyze RAWFILE...`: how much exact deduplication would save on a
// set of raw disk images, at block sizes 4 KiB .. 1 MiB, against what
// linked clones would save, with a histogram of duplication counts (DeDe
// paper, section 4.1). No volume is involved. The counting lives in
// analyze.h; this file reads the images (all in lockstep, window by window)
// and prints the figures.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "tools/dede/analyze.h"
#include "tools/dede/cli.h"

namespace po = boost::program_options;

namespace dede::cli {
namespace {

using json = nlohmann::json;
using analyze::Analyzer;
using analyze::Histogram;
using analyze::SizeFigures;

constexpr const char* kDetails =
    "Reads the images (regular files or block devices) once, all of them side by\n"
    "side, and reports for each block size B in 4K, 8K, 16K, 64K, 256K and 1M:\n"
    "\n"
    "  chunks         every B-byte chunk of every image. A last partial chunk is\n"
    "                 padded with zeros to B bytes, as a volume with B-byte blocks\n"
    "                 would store it; every byte figure is a chunk count times B.\n"
    "  zero           chunks that are all zeros. They are left out of every dedup\n"
    "                 figure (a thin volume does not store them) and reported\n"
    "                 apart.\n"
    "  non-zero       the other chunks, of all images together.\n"
    "  distinct       different contents among the non-zero chunks. Exact dedup\n"
    "                 stores each once: physical = distinct x B, savings =\n"
    "                 1 - distinct / non-zero.\n"
    "  linked clones  sharing only between chunks at the same offset in different\n"
    "                 images, as linked clones share an unmodified base disk\n"
    "                 (DeDe, section 4.1.3): the sum over offsets of the distinct\n"
    "                 non-zero contents at that offset replaces distinct. Copies\n"
    "                 at other offsets do not count, so this never saves more\n"
    "                 than exact dedup. Images of different sizes compare the\n"
    "                 offsets they have in common.\n"
    "\n"
    "and a histogram, at 4K, of duplication counts: for each distinct non-zero\n"
    "content, how many chunks hold it, in buckets 1, 2, 3-4, 5-8, ... (number of\n"
    "contents and number of chunks per bucket).\n"
    "\n"
    "Contents are compared by fingerprint, not byte by byte: XXH3-128 of each 4 KiB\n"
    "block, and for larger chunks XXH3-128 of the concatenated 4 KiB fingerprints\n"
    "(seeded with B). Equal chunks always match; distinct chunks would need a\n"
    "128-bit collision, which is negligible at any data size (under 2^-49 for\n"
    "2^40 blocks), so the figures are exact for any practical purpose.\n"
    "\n"
    "Memory: one table per block size with an entry (20 bytes, at 38-75% load)\n"
    "per distinct content, plus a 4 MiB read buffer; nothing else grows with the\n"
    "image size. On a terminal, progress (bytes, rate, ETA) goes to stderr.";

struct Image {
  std::string path;
  FdCloser fd;
  uint64_t size = 0;
};

Result<Image> OpenImage(const std::string& path) {
  FdCloser fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Status::FromErrno("cannot open " + path, errno);
  ASSIGN_OR_RETURN(uint64_t size, SizeOfFd(fd.get(), path));
  (void)::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  return Image{path, std::move(fd), size};
}

// Reads exactly len bytes at offset (the image must not shrink meanwhile).
Status ReadExactly(const Image& img, uint64_t offset, uint8_t* buf, size_t len) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(img.fd.get(), buf + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(img.path + ": read at offset " + std::to_string(offset + done),
                               errno);
    }
    if (n == 0) {
      return Status::IoError(img.path + ": file shrank while reading (end at offset " +
                             std::to_string(offset + done) + ")");
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// Positional arguments in args: options of this command take no values, so
// everything not starting with '-' is one, and everything after "--".
size_t CountPositionals(const std::vector<std::string>& args) {
  size_t n = 0;
  bool options_done = false;
  for (const auto& a : args) {
    if (!options_done && a == "--") {
      options_done = true;
    } else if (options_done || a.empty() || a[0] != '-' || a == "-") {
      n++;
    }
  }
  return n;
}

bool WantsHelp(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "--") break;
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

std::string BlockName(uint32_t b) {
  return b >= (1u << 20) ? std::to_string(b >> 20) + "M" : std::to_string(b >> 10) + "K";
}

std::string Pct(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %%", v);
  return buf;
}

void PrintTable(const std::vector<std::vector<std::string>>& rows, size_t indent) {
  // Right-aligned columns (the first, a label, left-aligned).
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t c = 0; c < row.size(); c++) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string out(indent, ' ');
    for (size_t c = 0; c < row.size(); c++) {
      const std::string pad(width[c] - row[c].size(), ' ');
      out += c == 0 ? row[c] + pad : "  " + pad + row[c];
    }
    std::cout << out << '\n';
  }
}

json SizeJson(const SizeFigures& f) {
  return {{"block_size", f.block_size},
          {"chunks", f.chunks},
          {"zero_chunks", f.zero_chunks},
          {"zero_bytes", f.zero_bytes()},
          {"nonzero_chunks", f.nonzero_chunks},
          {"nonzero_bytes", f.nonzero_bytes()},
          {"distinct", f.distinct},
          {"physical_bytes", f.physical_bytes()},
          {"savings_bytes", f.savings_bytes()},
          {"savings_pct", f.savings_pct()},
          {"linked_clone_distinct", f.linked_clone_distinct},
          {"linked_clone_physical_bytes", f.linked_clone_physical_bytes()},
          {"linked_clone_savings_bytes", f.linked_clone_savings_bytes()},
          {"linked_clone_savings_pct", f.linked_clone_savings_pct()}};
}

json HistogramJson(const Histogram& h) {
  json buckets = json::array();
  for (const auto& b : h.buckets) {
    buckets.push_back({{"min_count", b.min_count},
                       {"max_count", b.max_count},
                       {"distinct", b.distinct},
                       {"blocks", b.blocks}});
  }
  return {{"block_size", h.block_size}, {"max_count", h.max_count}, {"buckets", buckets}};
}

void PrintHuman(const std::vector<Image>& images, uint64_t total_bytes,
                const std::vector<SizeFigures>& figures, const Histogram& hist, double secs,
                size_t table_bytes) {
  std::cout << "analyzed " << Count(images.size(), "image") << ", " << HumanSize(total_bytes)
            << " in " << HumanDuration(secs) << " (" << HumanRate(total_bytes, secs) << ")\n";
  std::vector<std::vector<std::string>> rows;
  for (const auto& img : images) rows.push_back({img.path, HumanSize(img.size)});
  PrintTable(rows, 2);

  std::cout << "\nexact dedup (zero chunks excluded) and linked clones (same offset only):\n";
  rows = {{"BLOCK", "CHUNKS", "ZERO", "ZERO BYTES", "NON-ZERO", "DISTINCT", "PHYSICAL", "SAVED",
           "SAVINGS", "CLONES PHYSICAL", "CLONES SAVINGS"}};
  for (const auto& f : figures) {
    rows.push_back(
        {BlockName(f.block_size), std::to_string(f.chunks), std::to_string(f.zero_chunks),
         HumanSize(f.zero_bytes()), std::to_string(f.nonzero_chunks), std::to_string(f.distinct),
         HumanSize(f.physical_bytes()), HumanSize(f.savings_bytes()), Pct(f.savings_pct()),
         HumanSize(f.linked_clone_physical_bytes()), Pct(f.linked_clone_savings_pct())});
  }
  PrintTable(rows, 2);

  std::cout << "\nduplication counts at " << BlockName(hist.block_size)
            << " (chunks holding each distinct non-zero content; most: " << hist.max_count
            << "):\n";
  rows = {{"COUNT", "CONTENTS", "CHUNKS", "% OF CHUNKS"}};
  uint64_t nonzero = figures.front().nonzero_chunks;
  for (const auto& b : hist.buckets) {
    std::string range = b.min_count == b.max_count
                            ? std::to_string(b.min_count)
                            : std::to_string(b.min_count) + "-" + std::to_string(b.max_count);
    rows.push_back(
        {range, std::to_string(b.distinct), std::to_string(b.blocks),
         Pct(nonzero == 0 ? 0.0
                          : 100.0 * static_cast<double>(b.blocks) / static_cast<double>(nonzero))});
  }
  PrintTable(rows, 2);
  std::cout << "\nfingerprints: XXH3-128; tables " << HumanSize(table_bytes) << std::endl;
}

}  // namespace

int RunAnalyze(const Command& cmd, const std::vector<std::string>& args) {
  ArgParser parser(cmd);
  // Any number of images: one required name, and as many more as given.
  parser.AddPositional("RAWFILE", "raw disk image (regular file or block device); one or more");
  if (!WantsHelp(args)) {
    for (size_t i = 1; i < CountPositionals(args); i++) parser.AddPositional("RAWFILE", "");
  }
  parser.options()("json", po::bool_switch(), "print a JSON object");
  parser.SetDetails(kDetails);
  if (auto rc = parser.Parse(args)) return *rc;
  const bool as_json = parser.flag("json");

  std::vector<Image> images;
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < CountPositionals(args); i++) {
    auto img = OpenImage(parser.positional(i));
    if (!img.ok()) return Fail(cmd, img.status());
    total_bytes += img->size;
    images.push_back(std::move(img.value()));
  }

  Analyzer analyzer(images.size());
  const size_t window = analyzer.window_bytes();
  AlignedBuffer buf(window);
  InterruptGuard interrupt;
  Progress progress("analyzing", total_bytes);
  uint64_t done = 0;
  Status st;
  for (uint64_t pos = 0; done < total_bytes && st.ok(); pos += window) {
    for (size_t i = 0; i < images.size() && st.ok(); i++) {
      if (pos >= images[i].size) continue;  // ended: no slice
      if (interrupt.interrupted()) {
        st = Status::Unavailable("interrupted");
        break;
      }
      const size_t len = static_cast<size_t>(std::min<uint64_t>(window, images[i].size - pos));
      st = ReadExactly(images[i], pos, buf.data(), len);
      if (!st.ok()) break;
      analyzer.AddSlice(i, {buf.data(), len});
      done += len;
      progress.Update(done);
    }
    if (st.ok()) analyzer.EndWindow();
  }
  progress.Finish();
  if (!st.ok()) return Fail(cmd, st);
  const double secs = progress.elapsed_seconds();

  const std::vector<SizeFigures> figures = analyzer.Figures();
  const Histogram hist = analyzer.BuildHistogramAt(0);
  if (as_json) {
    json j;
    json imgs = json::array();
    for (const auto& img : images) imgs.push_back({{"path", img.path}, {"size_bytes", img.size}});
    j["images"] = imgs;
    j["total_bytes"] = total_bytes;
    j["hash"] = "xxh128";
    j["partial_chunk"] = "zero-padded";
    json sizes = json::array();
    for (const auto& f : figures) sizes.push_back(SizeJson(f));
    j["block_sizes"] = sizes;
    j["histogram"] = HistogramJson(hist);
    j["elapsed_seconds"] = secs;
    j["table_bytes"] = analyzer.table_memory_bytes();
    PrintJson(j);
    return kExitOk;
  }
  PrintHuman(images, total_bytes, figures, hist, secs, analyzer.table_memory_bytes());
  return kExitOk;
}

}  // namespace dede::cli
