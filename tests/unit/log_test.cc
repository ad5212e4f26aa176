// util/log: the line format on a terminal or file, and under journald.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <string>

#include "util/log.h"

using namespace dede;

TEST_CASE("log lines off the journal are PROGRAM: LEVEL: MSG", "[log]") {
  CHECK(FormatLogLine(LogLevel::kError, "dedupd", "cannot open volume v", false) ==
        "dedupd: error: cannot open volume v\n");
  CHECK(FormatLogLine(LogLevel::kWarning, "dedupd", "w", false) == "dedupd: warning: w\n");
  CHECK(FormatLogLine(LogLevel::kInfo, "dede", "serving 3 exports", false) ==
        "dede: info: serving 3 exports\n");
  CHECK(FormatLogLine(LogLevel::kDebug, "dedupd", "d", false) == "dedupd: debug: d\n");
  // No priority prefix anywhere, even for several lines.
  CHECK(FormatLogLine(LogLevel::kError, "dedupd", "a\nb", false) == "dedupd: error: a\nb\n");
}

TEST_CASE("log lines on the journal start with the syslog priority", "[log]") {
  CHECK(FormatLogLine(LogLevel::kError, "dedupd", "cannot open volume v", true) ==
        "<3>error: cannot open volume v\n");
  CHECK(FormatLogLine(LogLevel::kWarning, "dedupd", "w", true) == "<4>warning: w\n");
  CHECK(FormatLogLine(LogLevel::kInfo, "dedupd", "i", true) == "<6>info: i\n");
  CHECK(FormatLogLine(LogLevel::kDebug, "dedupd", "d", true) == "<7>debug: d\n");
  CHECK(FormatLogLine(LogLevel::kInfo, "dedupd", "", true) == "<6>info: \n");
  // journald splits at newlines: every line keeps the message's priority.
  CHECK(FormatLogLine(LogLevel::kWarning, "dedupd", "first\nsecond\nthird", true) ==
        "<4>warning: first\n<4>second\n<4>third\n");
  CHECK(FormatLogLine(LogLevel::kError, "dedupd", "ends\n", true) == "<3>error: ends\n\n");
}

TEST_CASE("JOURNAL_STREAM must name the stream's device and inode", "[log]") {
  CHECK(JournalStreamMatches("8:1234", 8, 1234));
  CHECK(JournalStreamMatches("64769:18446744073709551615", 64769, UINT64_MAX));
  CHECK_FALSE(JournalStreamMatches(nullptr, 8, 1234));
  CHECK_FALSE(JournalStreamMatches("", 8, 1234));
  CHECK_FALSE(JournalStreamMatches("8:1235", 8, 1234));  // another file
  CHECK_FALSE(JournalStreamMatches("9:1234", 8, 1234));
  CHECK_FALSE(JournalStreamMatches("8", 8, 1234));
  CHECK_FALSE(JournalStreamMatches("8:", 8, 1234));
  CHECK_FALSE(JournalStreamMatches(":1234", 8, 1234));
  CHECK_FALSE(JournalStreamMatches("8:1234x", 8, 1234));
  CHECK_FALSE(JournalStreamMatches(" 8:1234", 8, 1234));
  CHECK_FALSE(JournalStreamMatches("-8:1234", 8, 1234));
  CHECK_FALSE(JournalStreamMatches("8:99999999999999999999999", 8, 1234));  // overflows

  // Against a real file, the way LogLine checks stderr.
  std::FILE* f = std::tmpfile();
  REQUIRE(f != nullptr);
  struct stat st;
  REQUIRE(::fstat(::fileno(f), &st) == 0);
  const std::string env =
      std::to_string(static_cast<uint64_t>(st.st_dev)) + ":" + std::to_string(static_cast<uint64_t>(st.st_ino));
  CHECK(JournalStreamMatches(env.c_str(), st.st_dev, st.st_ino));
  CHECK_FALSE(JournalStreamMatches(env.c_str(), st.st_dev, st.st_ino + 1));
  std::fclose(f);
}
