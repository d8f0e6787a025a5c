// LD_PRELOAD shim that widens a race between a thread's creator and the new thread:
// the first free() a thread makes within WINDOW_US (200) microseconds of its own
// pthread_create() sleeps DELAY_US (20000) microseconds after freeing, so the new
// thread runs while its creator is in the middle of whatever called free() (e.g. a
// std::vector reallocating under a worker that reads it: tests/test_nccl_rules.py).
//
//   cc -shared -fPIC -o race.so race_after_thread_start.c -ldl
//   LD_PRELOAD=$PWD/race.so python script.py
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

extern void __libc_free(void *);

static __thread long long last_create_ns;

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int pthread_create(pthread_t *thread, const pthread_attr_t *attr, void *(*fn)(void *), void *arg) {
  static int (*real)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
  if (!real) real = dlsym(RTLD_NEXT, "pthread_create");
  int rc = real(thread, attr, fn, arg);
  last_create_ns = now_ns();
  return rc;
}

void free(void *p) {
  __libc_free(p);
  if (p && last_create_ns) {
    long long since = now_ns() - last_create_ns;
    last_create_ns = 0;
    const char *window = getenv("WINDOW_US"), *delay = getenv("DELAY_US");
    if (since < (window ? atoll(window) : 200) * 1000LL) usleep(delay ? atoi(delay) : 20000);
  }
}
