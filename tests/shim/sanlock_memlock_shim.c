// LD_PRELOAD shim for the sanlock daemons of the integration tests
// (tests/integration/cluster_rig.h). Built as a module; never linked into
// anything.
//
// 1. At start-up `sanlock daemon` raises RLIMIT_MEMLOCK and RLIMIT_RTPRIO to
//    unlimited and exits ("cannot set the limits for memlock 1", then the
//    same for rtprio) when that fails. Where root lacks CAP_SYS_RESOURCE
//    (containers, this project's build and CI machines) setrlimit fails
//    with EPERM; the shim turns exactly that EPERM, for those two limits,
//    into success. The rig starts the daemon with "-l 0" (no mlockall) and
//    "-h 0" (no realtime scheduling), so the limits are never needed.
//
// 2. sanlock reads its configuration from the fixed path
//    /etc/sanlock/sanlock.conf and appends to the fixed log file
//    /var/log/sanlock.log. When DEDE_SANLOCK_CONF / DEDE_SANLOCK_LOG name
//    files, stat() and fopen() of those fixed paths are redirected to
//    them, so every simulated host is hermetic: its own (usually empty)
//    configuration, its own log, nothing written outside the test's
//    directories.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

static const char* Redirect(const char* path) {
  if (path == NULL) return path;
  const char* var = NULL;
  if (strcmp(path, "/etc/sanlock/sanlock.conf") == 0) {
    var = "DEDE_SANLOCK_CONF";
  } else if (strcmp(path, "/var/log/sanlock.log") == 0) {
    var = "DEDE_SANLOCK_LOG";
  } else {
    return path;
  }
  const char* to = getenv(var);
  return (to != NULL && *to != '\0') ? to : path;
}

typedef int (*setrlimit_fn)(__rlimit_resource_t, const struct rlimit*);

int setrlimit(__rlimit_resource_t resource, const struct rlimit* rlim) {
  static setrlimit_fn real = NULL;
  if (real == NULL) real = (setrlimit_fn)dlsym(RTLD_NEXT, "setrlimit");
  int rv = real(resource, rlim);
  if (rv != 0 && errno == EPERM && (resource == RLIMIT_MEMLOCK || resource == RLIMIT_RTPRIO)) {
    errno = 0;
    return 0;
  }
  return rv;
}

typedef int (*stat_fn)(const char*, struct stat*);

int stat(const char* path, struct stat* st) {
  static stat_fn real = NULL;
  if (real == NULL) real = (stat_fn)dlsym(RTLD_NEXT, "stat");
  return real(Redirect(path), st);
}

typedef FILE* (*fopen_fn)(const char*, const char*);

FILE* fopen(const char* path, const char* mode) {
  static fopen_fn real = NULL;
  if (real == NULL) real = (fopen_fn)dlsym(RTLD_NEXT, "fopen");
  return real(Redirect(path), mode);
}
