// `dede analyze`, run as a real process on raw image files: hand-built
// images with figures worked out by hand (zero blocks, same-offset and
// shifted duplicates, partial tails, chunks made of repeated halves), a
// dede-vmgen set checked against an independent count of block contents,
// the progress meter on a terminal, and bad input.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tests/integration/rig.h"
#include "tests/random_bytes.h"

namespace dede {
namespace {

using json = nlohmann::json;
using test::BinaryPath;
using test::ProcessResult;
using test::RunProcess;
using test::TempDir;

constexpr size_t kBlk = 4096;
constexpr uint32_t kSizes[] = {4096, 8192, 16384, 65536, 262144, 1048576};

ProcessResult Dede(std::vector<std::string> args) {
  args.insert(args.begin(), BinaryPath("dede"));
  return RunProcess(args);
}

std::string Describe(const std::vector<std::string>& args, const ProcessResult& r) {
  std::ostringstream s;
  s << "dede";
  for (const auto& a : args) s << ' ' << a;
  s << "\n  exit " << r.exit_code << " signal " << r.signal << "\n  stdout: " << r.out
    << "\n  stderr: " << r.err;
  return s.str();
}

json AnalyzeJson(std::vector<std::string> files) {
  files.insert(files.begin(), "analyze");
  files.push_back("--json");
  ProcessResult r = Dede(files);
  INFO(Describe(files, r));
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.empty());  // no progress meter: stderr is not a terminal
  json j;
  REQUIRE_NOTHROW(j = json::parse(r.out));
  return j;
}

void WriteWholeFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  REQUIRE(out.good());
}

std::string RandomBlock(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(kBlk, '\0');
  dede::test::FillRandom(rng, s.data(), s.size());
  return s;
}

const json& SizeEntry(const json& j, uint32_t block_size) {
  for (const auto& e : j.at("block_sizes")) {
    if (e.at("block_size") == block_size) return e;
  }
  FAIL("no entry for block size " << block_size);
  throw std::logic_error("unreachable");
}

// Per block size: chunks, zero, non-zero, distinct, linked-clone distinct.
struct Want {
  uint32_t block_size;
  uint64_t chunks, zero, nonzero, distinct, lc_distinct;
};

void CheckFigures(const json& e, const Want& w) {
  INFO("block size " << w.block_size << ": " << e.dump());
  const uint64_t b = w.block_size;
  CHECK(e.at("chunks") == w.chunks);
  CHECK(e.at("zero_chunks") == w.zero);
  CHECK(e.at("zero_bytes") == w.zero * b);
  CHECK(e.at("nonzero_chunks") == w.nonzero);
  CHECK(e.at("distinct") == w.distinct);
  CHECK(e.at("physical_bytes") == w.distinct * b);
  CHECK(e.at("savings_bytes") == (w.nonzero - w.distinct) * b);
  CHECK(
      e.at("savings_pct").get<double>() ==
      Approx(100.0 * static_cast<double>(w.nonzero - w.distinct) / static_cast<double>(w.nonzero)));
  CHECK(e.at("linked_clone_distinct") == w.lc_distinct);
  CHECK(e.at("linked_clone_savings_pct").get<double>() ==
        Approx(100.0 * static_cast<double>(w.nonzero - w.lc_distinct) /
               static_cast<double>(w.nonzero)));
}

// Independent figures from the bytes: chunk contents (zero-padded to B) as
// strings in hash sets.
Want CountByContent(const std::vector<std::string>& images, uint32_t b) {
  Want w{b, 0, 0, 0, 0, 0};
  std::unordered_set<std::string> all;
  size_t longest = 0;
  for (const auto& img : images) longest = std::max(longest, img.size());
  const std::string zero(b, '\0');
  for (size_t off = 0; off < longest; off += b) {
    std::unordered_set<std::string> here;
    for (const auto& img : images) {
      if (off >= img.size()) continue;
      std::string c = img.substr(off, b);
      c.resize(b, '\0');
      w.chunks++;
      if (c == zero) {
        w.zero++;
        continue;
      }
      w.nonzero++;
      here.insert(c);
      all.insert(std::move(c));
    }
    w.lc_distinct += here.size();
  }
  w.distinct = all.size();
  return w;
}

}  // namespace

TEST_CASE("dede analyze: hand-built images, every figure", "[analyze]") {
  TempDir dir;
  // 4 KiB blocks: A, B, D random; C zero but its last byte; Z zero. T is a
  // 100-byte tail (the file ends there).
  const std::string A = RandomBlock(1), B = RandomBlock(2), D = RandomBlock(4);
  std::string C(kBlk, '\0');
  C.back() = 1;
  const std::string Z(kBlk, '\0');
  const std::string T(100, '\x55');
  auto cat = [](std::initializer_list<std::string> parts) {
    std::string s;
    for (const auto& p : parts) s += p;
    return s;
  };
  std::string z16;
  for (int i = 0; i < 16; i++) z16 += Z;
  const std::vector<std::string> data = {
      cat({A, B, A, A, Z, C, A, A, T}),        // img1: 32868 bytes
      cat({A, B, D, A, Z, Z, A, A}),           // img2
      cat({B, A, A, A, C}),                    // img3: shifted A and B
      cat({A, B, D, A, Z, Z, A, A}),           // img4: a clone of img2
      cat({B, A, A, A, C, Z}),                 // img5: img3 plus a zero block
      z16 + cat({A, B, A, A, Z, C, A, A, T}),  // img6: img1 shifted by 64 KiB
  };
  std::vector<std::string> files;
  for (size_t i = 0; i < data.size(); i++) {
    files.push_back(dir.file("img" + std::to_string(i + 1) + ".raw"));
    WriteWholeFile(files.back(), data[i]);
  }

  const json j = AnalyzeJson(files);
  INFO(j.dump(2));
  REQUIRE(j.at("images").size() == 6);
  uint64_t total = 0;
  for (size_t i = 0; i < data.size(); i++) {
    CHECK(j.at("images")[i].at("path") == files[i]);
    CHECK(j.at("images")[i].at("size_bytes") == data[i].size());
    total += data[i].size();
  }
  CHECK(total == 241864);
  CHECK(j.at("total_bytes") == total);
  CHECK(j.at("hash") == "xxh128");
  REQUIRE(j.at("block_sizes").size() == 6);

  // Worked out by hand (see the layout above):
  //  4K: A x24, B x6, C x4 (img3's, img5's, img1's and img6's), D x2, T x2;
  //      per offset 2+2+2+1+1+1+1+1+1 in the first 9, then img6's 8.
  //  8K: [A B] x4, [A A] x8 (two equal halves), [Z C], [T 0], [D A], [B A],
  //      [C 0] (= img5's [C Z]) x2 each; per offset 2+2+2+1+1, then 5.
  //  16K: seven contents, each twice; per offset 3+3+1, then 3.
  //  64K: img1 = img6's second chunk, img2 = img4, img3 = img5 (padding
  //      equals explicit zeros); img6's first chunk is zero.
  //  256K, 1M: one chunk per image; img6's differs from img1's.
  const Want want[] = {
      {4096, 61, 23, 38, 5, 20}, {8192, 32, 10, 22, 7, 13}, {16384, 18, 4, 14, 7, 10},
      {65536, 7, 1, 6, 3, 4},    {262144, 6, 0, 6, 4, 4},   {1048576, 6, 0, 6, 4, 4},
  };
  for (const Want& w : want) CheckFigures(SizeEntry(j, w.block_size), w);
  // The same from an independent count of the bytes.
  for (uint32_t b : kSizes) CheckFigures(SizeEntry(j, b), CountByContent(data, b));

  const json& h = j.at("histogram");
  CHECK(h.at("block_size") == 4096);
  CHECK(h.at("max_count") == 24);
  const uint64_t buckets[][4] = {{1, 1, 0, 0}, {2, 2, 2, 4},  {3, 4, 1, 4},
                                 {5, 8, 1, 6}, {9, 16, 0, 0}, {17, 32, 1, 24}};
  REQUIRE(h.at("buckets").size() == std::size(buckets));
  for (size_t i = 0; i < std::size(buckets); i++) {
    const json& bk = h.at("buckets")[i];
    INFO(bk.dump());
    CHECK(bk.at("min_count") == buckets[i][0]);
    CHECK(bk.at("max_count") == buckets[i][1]);
    CHECK(bk.at("distinct") == buckets[i][2]);
    CHECK(bk.at("blocks") == buckets[i][3]);
  }

  SECTION("the human table") {
    std::vector<std::string> args = {"analyze"};
    args.insert(args.end(), files.begin(), files.end());
    ProcessResult r = Dede(args);
    INFO(Describe(args, r));
    REQUIRE(r.exit_code == 0);
    CHECK(r.err.empty());
    CHECK(r.out.find("analyzed 6 images, 236.2 KiB") != std::string::npos);
    CHECK(r.out.find(files[5]) != std::string::npos);
    CHECK(r.out.find("DISTINCT") != std::string::npos);
    // 4K: 38 non-zero, 5 distinct: 86.8 % saved; linked clones 47.4 %.
    CHECK(r.out.find("86.8 %") != std::string::npos);
    CHECK(r.out.find("47.4 %") != std::string::npos);
    CHECK(r.out.find("17-32") != std::string::npos);
  }
  SECTION("one image: linked clones share nothing, exact dedup still finds copies") {
    const json one = AnalyzeJson({files[0]});
    CheckFigures(SizeEntry(one, 4096), {4096, 9, 1, 8, 4, 8});  // A x5, B, C, T
    CheckFigures(SizeEntry(one, 8192), {8192, 5, 0, 5, 4, 5});  // [A A] twice
  }
  SECTION("the same file twice is two identical images") {
    const json two = AnalyzeJson({files[1], files[1]});
    CheckFigures(SizeEntry(two, 4096), {4096, 16, 4, 12, 3, 6});
    CheckFigures(SizeEntry(two, 1048576), {1048576, 2, 0, 2, 1, 1});
  }
}

TEST_CASE("dede analyze: empty and all-zero images", "[analyze]") {
  TempDir dir;
  WriteWholeFile(dir.file("empty.raw"), "");
  WriteWholeFile(dir.file("zeros.raw"), std::string(3 * kBlk + 5, '\0'));
  const json j = AnalyzeJson({dir.file("empty.raw"), dir.file("zeros.raw")});
  INFO(j.dump(2));
  const json& e = SizeEntry(j, 4096);
  CHECK(e.at("chunks") == 4);
  CHECK(e.at("zero_chunks") == 4);
  CHECK(e.at("nonzero_chunks") == 0);
  CHECK(e.at("distinct") == 0);
  CHECK(e.at("savings_pct") == 0.0);
  CHECK(e.at("linked_clone_savings_pct") == 0.0);
  CHECK(j.at("histogram").at("buckets").empty());
  CHECK(SizeEntry(j, 1048576).at("zero_chunks") == 1);
}

TEST_CASE("dede analyze: a dede-vmgen set against an independent count", "[analyze]") {
  TempDir dir;
  std::vector<std::string> gen = {BinaryPath("dede-vmgen"), "--out", dir.path()};
  gen.insert(gen.end(), {"--images", "4", "--size", "12M", "--seed", "5"});
  ProcessResult g = RunProcess(gen);
  INFO(g.out << g.err);
  REQUIRE(g.exit_code == 0);
  std::vector<std::string> files, data;
  for (int i = 0; i < 4; i++) {
    files.push_back(dir.file("vm-0" + std::to_string(i) + ".img"));
    data.push_back(test::ReadWholeFileText(files.back()));
    REQUIRE(data.back().size() == 12u << 20);
  }
  const json j = AnalyzeJson(files);
  INFO(j.dump(2));
  CHECK(j.at("total_bytes") == 48u << 20);
  for (uint32_t b : kSizes) {
    const json& e = SizeEntry(j, b);
    INFO("block size " << b);
    // Guaranteed: exact dedup saves at least what linked clones save.
    CHECK(e.at("savings_pct").get<double>() >= e.at("linked_clone_savings_pct").get<double>());
    CHECK(e.at("distinct").get<uint64_t>() <= e.at("linked_clone_distinct").get<uint64_t>());
    CHECK(e.at("chunks") == 4 * ((12u << 20) / b));
    CHECK(e.at("zero_chunks").get<uint64_t>() + e.at("nonzero_chunks").get<uint64_t>() ==
          e.at("chunks").get<uint64_t>());
  }
  // 4K against a count of the block contents themselves.
  {
    std::unordered_set<std::string> distinct;
    uint64_t zero = 0, nonzero = 0;
    const std::string zero_block(kBlk, '\0');
    for (const auto& img : data) {
      for (size_t off = 0; off < img.size(); off += kBlk) {
        std::string blk = img.substr(off, kBlk);
        if (blk == zero_block) {
          zero++;
        } else {
          nonzero++;
          distinct.insert(std::move(blk));
        }
      }
    }
    const json& e = SizeEntry(j, 4096);
    CHECK(e.at("distinct") == distinct.size());
    CHECK(e.at("zero_chunks") == zero);
    CHECK(e.at("nonzero_chunks") == nonzero);
    // vmgen images share a golden OS: there is something to save.
    CHECK(distinct.size() < nonzero);
    CHECK(e.at("linked_clone_savings_pct").get<double>() > 0.0);
  }
  // Every size, every figure, against the byte-level reference.
  for (uint32_t b : kSizes) CheckFigures(SizeEntry(j, b), CountByContent(data, b));

  // The histogram adds up to the non-zero chunks and the distinct contents.
  uint64_t blocks = 0, contents = 0;
  for (const auto& bk : j.at("histogram").at("buckets")) {
    blocks += bk.at("blocks").get<uint64_t>();
    contents += bk.at("distinct").get<uint64_t>();
  }
  CHECK(blocks == SizeEntry(j, 4096).at("nonzero_chunks"));
  CHECK(contents == SizeEntry(j, 4096).at("distinct"));
}

TEST_CASE("dede analyze: progress on a terminal", "[analyze]") {
  TempDir dir;
  WriteWholeFile(dir.file("a.raw"), RandomBlock(9) + RandomBlock(9));
  // script(1) runs the command on a pseudo-terminal and copies its output.
  const std::string command = BinaryPath("dede") + " analyze " + dir.file("a.raw");
  ProcessResult r = RunProcess({"script", "-qec", command, "/dev/null"});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("\ranalyzing [") != std::string::npos);
  CHECK(r.out.find("100%") != std::string::npos);
  CHECK(r.out.find("analyzed 1 image, 8.0 KiB") != std::string::npos);
  CHECK(r.out.find("50.0 %") != std::string::npos);  // two equal blocks
}

TEST_CASE("dede analyze: bad input", "[analyze]") {
  TempDir dir;
  WriteWholeFile(dir.file("ok.raw"), RandomBlock(3));
  auto check_fails = [](const std::vector<std::string>& args, const std::string& what) {
    ProcessResult r = Dede(args);
    INFO(Describe(args, r));
    CHECK(r.signal == 0);
    CHECK(r.exit_code == 1);
    CHECK(r.out.empty());
    CHECK(r.err.rfind("dede: analyze: ", 0) == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.find(what) != std::string::npos);
  };
  check_fails({"analyze", dir.file("ok.raw"), dir.file("missing.raw")}, "missing.raw");
  check_fails({"analyze", dir.file("missing.raw"), "--json"}, "No such file");
  check_fails({"analyze", dir.path()}, "neither a regular file nor a block device");

  auto check_usage = [](const std::vector<std::string>& args) {
    ProcessResult r = Dede(args);
    INFO(Describe(args, r));
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(r.err.find("usage: dede analyze RAWFILE...") != std::string::npos);
  };
  check_usage({"analyze"});
  check_usage({"analyze", "--json"});
  check_usage({"analyze", dir.file("ok.raw"), "--bogus"});

  ProcessResult help = Dede({"analyze", "--help"});
  CHECK(help.exit_code == 0);
  CHECK(help.out.find("XXH3-128") != std::string::npos);
  CHECK(help.out.find("linked clones") != std::string::npos);
  ProcessResult tool = Dede({"--help"});
  CHECK(tool.out.find("analyze") != std::string::npos);
}

}  // namespace dede
